"""Parser behaviour on real model output shapes, table-driven and through the whole derender
stream (detokenizer, reasoning, tool stage), each case streamed under several chunkings of its
token ids (one id per message, random sizes, all at once) and equal to the non-streamed parse
(DerenderFull's mode):

- Mistral, both forms: v11+ `[TOOL_CALLS]name{args}` (and v13's `[TOOL_CALLS]name[ARGS]{args}`),
  and the older `[TOOL_CALLS][{...}, ...]` list, with `[TOOL_CALLS]` a real special token of the
  tokenizer (kept in the text: skip_special_tokens false, as render sets it for this parser);
- qwen3 reasoning where the model opens a tool call without writing `</think>`;
- pythonic lists mixing good and malformed calls.
"""

from __future__ import annotations

import json
import random

import pytest
from transformers import AutoTokenizer

from tito_derender.detokenizer import TextOptions
from tito_derender.domain import EngineOutput, FinishReason, RequestContext, ToolChoiceMode
from tito_derender.full import derender_full
from tito_derender.parsers import TOOL_PARSERS, needs_special_tokens
from tito_derender.stream import DerenderStream
from tito_derender.tokenizer import TextTokenizer
from hf_reference import hf_of

MISTRAL_SPECIAL_TOKENS = ["[TOOL_CALLS]", "[ARGS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]"]


def with_mistral_tokens(source, directory) -> TextTokenizer:
    hf = AutoTokenizer.from_pretrained(str(source))
    hf.add_special_tokens({"additional_special_tokens": MISTRAL_SPECIAL_TOKENS})
    hf.save_pretrained(str(directory))
    tokenizer = TextTokenizer.load(directory)
    assert tokenizer.is_special(hf_of(tokenizer).convert_tokens_to_ids("[TOOL_CALLS]"))
    return tokenizer


@pytest.fixture(scope="module", params=["byte-level", "sentencepiece"])
def mistral_tokenizer(request, tiny_text_model, tmp_path_factory) -> TextTokenizer:
    """Tekken-like (byte-level BPE, v11+) or SentencePiece-like (v3) with Mistral's special tokens."""
    directory = tmp_path_factory.mktemp("mistral")
    if request.param == "byte-level":
        return with_mistral_tokens(tiny_text_model, directory)
    return with_mistral_tokens(hf_of(request.getfixturevalue("metaspace_tokenizer")).name_or_path, directory)


def id_chunkings(ids: list[int]):
    yield "all", [ids]
    yield "one", [[token_id] for token_id in ids]
    for seed in range(3):
        rng, pieces, position = random.Random(seed), [], 0
        while position < len(ids):
            size = rng.randint(1, 5)
            pieces.append(ids[position:position + size])
            position += size
        yield f"random{seed}", pieces


def streamed(tokenizer, ctx, chunks, finish=FinishReason.STOP):
    """(content, reasoning, [(name, arguments)]) of a stream fed `chunks` of token ids."""
    stream = DerenderStream(tokenizer, ctx)
    out = [chunk for ids in chunks for chunk in stream.feed(EngineOutput(index=0, token_ids=tuple(ids)))]
    out += stream.feed(EngineOutput(index=0, finish_reason=finish))
    calls: list[list[str]] = []
    for delta in (d for chunk in out for d in chunk.tool_calls):
        if delta.name:
            assert delta.index == len(calls) and not delta.arguments
            calls.append([delta.name, ""])
        else:
            calls[delta.index][1] += delta.arguments
    return ("".join(c.content for c in out), "".join(c.reasoning_content for c in out),
            [(name, json.loads(arguments)) for name, arguments in calls])


def complete(tokenizer, ctx, ids, finish=FinishReason.STOP):
    outputs = [EngineOutput(index=0, token_ids=tuple(ids)), EngineOutput(index=0, finish_reason=finish)]
    [choice], _ = derender_full(tokenizer, ctx, outputs)
    return (choice.content, choice.reasoning_content,
            [(call.name, json.loads(call.arguments)) for call in choice.tool_calls])


def check_case(tokenizer, ctx, text, expected, finish=FinishReason.STOP, compare_complete=True):
    ids = hf_of(tokenizer).encode(text, add_special_tokens=False)
    if compare_complete:
        assert complete(tokenizer, ctx, ids, finish) == expected
    for name, chunks in id_chunkings(ids):
        assert streamed(tokenizer, ctx, chunks, finish) == expected, name


# ------------------------------------------------------------------------------------- Mistral
WEATHER = {"city": "Paris", "days": [1, 2.5], "note": "a \"quoted\" é", "nested": {"ok": True, "none": None}}
W = json.dumps(WEATHER, ensure_ascii=False)

# (model output, content, calls)
MISTRAL = [
    # v11+: name then the arguments object
    (f"[TOOL_CALLS]get_weather{W}", "", [("get_weather", WEATHER)]),
    ('Sure.[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{"tz": "UTC"}', "Sure.",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    ('[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}', "", [("get_weather", {"city": "Paris"})]),  # v13
    ("[TOOL_CALLS]get_time{}", "", [("get_time", {})]),
    ('[TOOL_CALLS]get_time{"tz": "UTC"} Anything else?', " Anything else?", [("get_time", {"tz": "UTC"})]),
    ('[TOOL_CALLS]get_weather(city="Paris")', '[TOOL_CALLS]get_weather(city="Paris")', []),  # no object
    ("[TOOL_CALLS]get_weather", "[TOOL_CALLS]get_weather", []),  # cut off before the arguments
    # before v11: a JSON list of call objects (or one object)
    (f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {W}}}, {{"name": "get_time", "arguments": {{}}}}]', "",
     [("get_weather", WEATHER), ("get_time", {})]),
    ('Let me see. [TOOL_CALLS] {"name": "get_time", "arguments": {"tz": "UTC"}}', "Let me see.",
     [("get_time", {"tz": "UTC"})]),
    ("[TOOL_CALLS] nope", "[TOOL_CALLS] nope", []),
    ("no calls [TOOL_ here", "no calls [TOOL_ here", []),
]


def mistral_context(**fields) -> RequestContext:
    base = dict(tool_parser="mistral", tool_names=("get_weather", "get_time"), tool_choice=ToolChoiceMode.AUTO,
                text=TextOptions(skip_special_tokens=False))
    base.update(fields)
    return RequestContext(**base)


@pytest.mark.parametrize("text,content,calls", MISTRAL, ids=[case[0][:40] for case in MISTRAL])
def test_mistral_both_forms(mistral_tokenizer, text, content, calls):
    assert hf_of(mistral_tokenizer).convert_tokens_to_ids("[TOOL_CALLS]") in hf_of(mistral_tokenizer).encode(
        "x[TOOL_CALLS]y", add_special_tokens=False)
    check_case(mistral_tokenizer, mistral_context(), text, (content, "", calls))


def test_mistral_v11_arguments_stream_in_fragments_and_a_cut_call_is_closed(mistral_tokenizer):
    text = '[TOOL_CALLS]get_weather{"city": "Paris", "note": "a long argument value"}'
    ids = hf_of(mistral_tokenizer).encode(text, add_special_tokens=False)
    stream = DerenderStream(mistral_tokenizer, mistral_context())
    deltas = [d for i in ids for c in stream.feed(EngineOutput(index=0, token_ids=(i,))) for d in c.tool_calls]
    assert deltas[0].name == "get_weather" and len([d for d in deltas if d.arguments]) > 5
    # Cut off: streamed, the call is out and its arguments are closed; complete, it is content.
    cut = hf_of(mistral_tokenizer).encode('[TOOL_CALLS]get_weather{"city": "Par', add_special_tokens=False)
    for _, chunks in id_chunkings(cut):
        assert streamed(mistral_tokenizer, mistral_context(), chunks, FinishReason.LENGTH) == (
            "", "", [("get_weather", {"city": "Par"})])
    assert complete(mistral_tokenizer, mistral_context(), cut, FinishReason.LENGTH) == (
        '[TOOL_CALLS]get_weather{"city": "Par', "", [])


def test_mistral_named_tool_choice_and_skipped_special_tokens(mistral_tokenizer):
    named = mistral_context(tool_choice=ToolChoiceMode.NAMED, tool_choice_function="get_time")
    text = '[TOOL_CALLS]get_weather{"city": "Paris"}[TOOL_CALLS]get_time{}'
    check_case(mistral_tokenizer, named, text, ('[TOOL_CALLS]get_weather{"city": "Paris"}', "", [("get_time", {})]))
    # With skip_special_tokens on, [TOOL_CALLS] never reaches the text: nothing to parse. This is
    # why the parser declares needs_special_tokens and render keeps special tokens for it.
    skipped = mistral_context(text=TextOptions(skip_special_tokens=True))
    check_case(mistral_tokenizer, skipped, text, ('get_weather{"city": "Paris"}get_time{}', "", []))
    assert needs_special_tokens("mistral") and not needs_special_tokens("hermes")


def test_render_and_derender_agree_on_which_parsers_need_special_tokens():
    from tito_render.config import TOOL_PARSERS as RENDER_TOOL_PARSERS
    from tito.parsers import TOOL_PARSERS_NEEDING_SPECIAL_TOKENS

    assert set(RENDER_TOOL_PARSERS) <= set(TOOL_PARSERS)
    assert TOOL_PARSERS_NEEDING_SPECIAL_TOKENS == {name for name in RENDER_TOOL_PARSERS if needs_special_tokens(name)}


# --------------------------------------------------------------------- qwen3 reasoning + calls
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
CALL2 = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Bergen"}}\n</tool_call>'
OSLO, BERGEN = ("get_weather", {"city": "Oslo"}), ("get_weather", {"city": "Bergen"})

# (context fields, model output, content, reasoning, calls)
QWEN3 = [
    ({}, f"<think>I should check the weather.\n{CALL}", "", "I should check the weather.\n", [OSLO]),
    ({}, f"<think>Two cities.\n\n{CALL}\n{CALL2}", "", "Two cities.\n\n", [OSLO, BERGEN]),
    ({"prompt_opens_reasoning": True}, f"Let me look.{CALL}", "", "Let me look.", [OSLO]),
    ({}, f"<think>Checking.</think>\n\n{CALL}", "", "Checking.", [OSLO]),  # with </think>: as before
    # The model was thinking about a call: </think> or other text follows it, so it is reasoning.
    ({}, f"<think>maybe {CALL} no.</think>Sunny.", "Sunny.", f"maybe {CALL} no.", []),
    ({}, f"<think>maybe {CALL}</think>Sunny.", "Sunny.", f"maybe {CALL}", []),
    ({}, f"<think>maybe {CALL}\nthen more thought", "", f"maybe {CALL}\nthen more thought", []),
    ({}, "<think>a <tool_call> is how I call</think>ok", "ok", "a <tool_call> is how I call", []),
    # No tools offered: no tool stage, so calls never end the reasoning.
    ({"tool_names": ()}, f"<think>I should check.\n{CALL}", "", f"I should check.\n{CALL}", []),
]


def qwen3_context(**fields) -> RequestContext:
    base = dict(reasoning_parser="qwen3", thinking_enabled=True, tool_parser="hermes",
                tool_names=("get_weather",), tool_choice=ToolChoiceMode.AUTO)
    base.update(fields)
    return RequestContext(**base)


@pytest.mark.parametrize("fields,text,content,reasoning,calls", QWEN3, ids=[c[1][:40] for c in QWEN3])
def test_qwen3_reasoning_ends_at_a_tool_call_without_think_end(tiny_tokenizer, fields, text, content, reasoning,
                                                               calls):
    check_case(tiny_tokenizer, qwen3_context(**fields), text, (content, reasoning, calls))


def test_qwen3_cut_off_inside_a_call_without_think_end(tiny_tokenizer):
    text = '<think>Checking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Os'
    ids = hf_of(tiny_tokenizer).encode(text, add_special_tokens=False)
    results = {name: streamed(tiny_tokenizer, qwen3_context(), chunks, FinishReason.LENGTH)
               for name, chunks in id_chunkings(ids)}
    assert set(map(repr, results.values())) == {repr(("", "Checking.\n", [("get_weather", {"city": "Os"})]))}
    assert complete(tiny_tokenizer, qwen3_context(), ids, FinishReason.LENGTH) == (
        text.removeprefix("<think>Checking.\n"), "Checking.\n", [])


def test_held_call_text_reaches_the_client_once_decided(tiny_tokenizer):
    """While a call inside the reasoning is undecided nothing of it is sent; then all of it is."""
    ids = hf_of(tiny_tokenizer).encode(f"<think>maybe {CALL}", add_special_tokens=False)
    stream = DerenderStream(tiny_tokenizer, qwen3_context())
    sent = "".join(c.reasoning_content + c.content for i in ids
                   for c in stream.feed(EngineOutput(index=0, token_ids=(i,))))
    assert sent == "maybe "
    more = hf_of(tiny_tokenizer).encode(" so.", add_special_tokens=False)
    rest = stream.feed(EngineOutput(index=0, token_ids=tuple(more)))
    assert "".join(c.reasoning_content for c in rest) == f"{CALL} so."


# ------------------------------------------------------------------------------------- pythonic
DEEP = "[" * 70 + "]" * 70
# (model output, content, calls)
PYTHONIC = [
    ('[get_weather(city="Paris"), bad(1), get_time(tz="UTC")]', "bad(1)",
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    ("[bad(1), get_time()]", "bad(1)", [("get_time", {})]),
    ('[get_weather(city="Paris"), oops]', "oops", [("get_weather", {"city": "Paris"})]),
    ('[get_weather(city=lookup("x")), get_time(tz=["a", {"k": (1, 2)}])]', 'get_weather(city=lookup("x"))',
     [("get_time", {"tz": ["a", {"k": [1, 2]}]})]),
    ("[get_weather(city={1, 2}), get_time()]", "get_weather(city={1, 2})", [("get_time", {})]),
    ('[get_weather(city="Paris")), get_time()]', 'get_weather(city="Paris"))', [("get_time", {})]),
    (f"[get_weather(city={DEEP}), get_time()]", f"get_weather(city={DEEP})", [("get_time", {})]),
    ("[get_weather(**options), get_time()]", "get_weather(**options)", [("get_time", {})]),
    ('[get_weather(city="Paris")] Done.', " Done.", [("get_weather", {"city": "Paris"})]),
    ('[get_weather(city="Paris"), get_time(tz="UTC")', "",  # cut off before "]": both complete
     [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "UTC"})]),
    ('[get_weather(city="Paris"), get_time(tz=', "get_time(tz=", [("get_weather", {"city": "Paris"})]),
    ('[tools.get_time(tz="UTC")]', "", [("tools.get_time", {"tz": "UTC"})]),
    # No valid call at all: not a call list, all of it is content, untouched.
    ("[get_weather(city=1, 2)]", "[get_weather(city=1, 2)]", []),
    ("[Note] hello", "[Note] hello", []),
    ('[get_weather(city="unclosed), get_time()]', '[get_weather(city="unclosed), get_time()]', []),
    ("Not a list [get_time()]", "Not a list [get_time()]", []),
]


def pythonic_context(**fields) -> RequestContext:
    base = dict(tool_parser="pythonic", tool_names=("get_weather", "get_time", "tools.get_time"),
                tool_choice=ToolChoiceMode.AUTO)
    base.update(fields)
    return RequestContext(**base)


@pytest.mark.parametrize("text,content,calls", PYTHONIC, ids=[c[0][:40] for c in PYTHONIC])
def test_pythonic_good_calls_survive_bad_ones(tiny_tokenizer, text, content, calls):
    check_case(tiny_tokenizer, pythonic_context(), text, (content, "", calls))


def test_pythonic_sends_a_call_only_once_it_is_known_valid(tiny_tokenizer):
    text = '[get_weather(city="Paris", days=[1, 2]), bad(1)'
    ids = hf_of(tiny_tokenizer).encode(text, add_special_tokens=False)
    stream = DerenderStream(tiny_tokenizer, pythonic_context())
    seen = []
    for position, token_id in enumerate(ids):
        chunks = stream.feed(EngineOutput(index=0, token_ids=(token_id,)))
        seen += [(hf_of(tiny_tokenizer).decode(ids[:position + 1]), d) for c in chunks for d in c.tool_calls]
    # The first delta arrives with the "," that ends the item, never earlier; "bad" never comes.
    assert [d.name for _, d in seen if d.name] == ["get_weather"]
    assert all(prefix.rstrip().endswith(",") for prefix, _ in seen)
    assert json.loads("".join(d.arguments for _, d in seen)) == {"city": "Paris", "days": [1, 2]}
