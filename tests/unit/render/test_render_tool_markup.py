"""Tool-call constraints in every tool markup derender parses, at the mask level.

For each markup, render builds the constraint (tool_choice required / named, parallel or not),
the engine's compile of it on the family's vocabulary drives a seeded random walk (at each step a
random token among those the mask allows: what a random-weight model under the mask does), and
derender's own parser reads the walk's text: the calls it finds name the tools and their
arguments validate against the tools' schemas. Malformed markup is refused by the grammar.
Families whose engine model cannot be built here use their offline tokenizers
(tests/support/family_tokenizers.py).
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
import xgrammar
from google.protobuf import struct_pb2
from transformers import AutoTokenizer

from tests.support.family_tokenizers import ensure_family_tokenizer
from tito.structured_output import StructuredOutputSpec, grammar_of
from tito.v1 import chat_pb2, render_pb2
from tito_derender.domain import OutputDelta
from tito_derender.parsers import REASONING_PARSERS, TOOL_PARSERS
from tito_derender.parsers.tool_stage import ToolStage
from tito_derender.parsers.tools.markup import MarkupToolParser
from tito_render.config import RenderConfig
from tito_render.convert import chat_request_from_proto, tool_choice_from_proto
from tito_render.model import load_render_model
from tito_render.structured import ReasoningStart, resolve_structured_output

WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                            "days": {"type": "integer", "minimum": 1, "maximum": 9},
                                            "unit": {"enum": ["c", "f"]}},
           "required": ["city", "days", "unit"], "additionalProperties": False}
SEARCH = {"type": "object", "properties": {"query": {"type": "string", "maxLength": 5}, "exact": {"type": "boolean"}},
          "required": ["query", "exact"], "additionalProperties": False}
SCHEMAS = {"get_weather": WEATHER, "search": SEARCH}

# (markup key, tool parser, tokenizer: "tiny" or a family of tests/support/family_tokenizers.py)
MARKUPS = [
    ("hermes", "hermes", "tiny"),
    ("llama3_json", "llama3_json", "tiny"),
    ("mistral", "mistral", "tiny"),
    ("mistral_v13", "mistral", "tiny"),
    ("mistral_list", "mistral", "tiny"),
    ("qwen3_coder", "qwen3_coder", "qwen3_coder"),
    ("deepseek_v3", "deepseek_v3", "deepseek_r1"),
    ("deepseek_v31", "deepseek_v3", "deepseek_v31"),
    ("kimi_k2", "kimi_k2", "kimi_k2"),
    ("glm45", "glm45", "glm45"),
    ("gpt_oss", "gpt_oss", "gpt_oss"),
]


def struct(obj: dict) -> struct_pb2.Struct:
    value = struct_pb2.Struct()
    value.update(obj)
    return value


def tool(name: str) -> chat_pb2.Tool:
    return chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
        name=name, parameters=struct(SCHEMAS[name]), strict=True))


def tools_dicts() -> list[dict]:
    return [{"type": "function", "function": {"name": n, "parameters": s, "strict": True}} for n, s in SCHEMAS.items()]


@pytest.fixture(scope="module")
def tokenizers(tiny_text_model):
    cache: dict[str, tuple] = {}

    def get(name: str):
        if name not in cache:
            path = tiny_text_model if name == "tiny" else ensure_family_tokenizer(name)
            tokenizer = AutoTokenizer.from_pretrained(str(path))
            stops = [tokenizer.eos_token_id]
            if name == "gpt_oss":
                stops.append(tokenizer.convert_tokens_to_ids("<|call|>"))  # gpt-oss's generation config
            info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer), stop_token_ids=stops)
            cache[name] = (path, tokenizer, stops, xgrammar.GrammarCompiler(info, cache_enabled=False))
        return cache[name]
    return get


def constraint_for(markup: str, tool_choice: chat_pb2.ToolChoice, parallel: bool | None = None,
                   reasoning: ReasoningStart | None = None):
    request = render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content="hi")],
                                           tools=[tool(name) for name in SCHEMAS], tool_choice=tool_choice)
    if parallel is not None:
        request.parallel_tool_calls = parallel
    return resolve_structured_output(chat_request_from_proto(request), tools_dicts(),
                                     tool_choice_from_proto(tool_choice), markup, reasoning)


_COMPILED: dict[tuple[int, StructuredOutputSpec], object] = {}


def compiled(compiler, constraint):
    """The engine's compile of `constraint` (cached: a compile costs more than a walk)."""
    key = (id(compiler), constraint)
    if key not in _COMPILED:
        _COMPILED[key] = compiler.compile_grammar(grammar_of(constraint))
    return _COMPILED[key]


_BIT = torch.arange(32, dtype=torch.int32)


def allowed_tokens(bitmask, vocab_size: int) -> list[int]:
    """The ids a one-row bitmask allows, ascending: bit i % 32 of word i // 32, as
    xgrammar.testing.bitmask_to_bool_mask reads it (that one loops in Python over the vocabulary,
    ~1 s a mask for a 150k vocabulary, most of a walk's time)."""
    return ((bitmask[0].unsqueeze(1) >> _BIT) & 1).flatten()[:vocab_size].nonzero().flatten().tolist()


def test_allowed_tokens_reads_the_mask_as_xgrammar_does():
    bitmask = torch.randint(-2**31, 2**31 - 1, (1, 40), dtype=torch.int32, generator=torch.Generator().manual_seed(3))
    for vocab_size in (1250, 1280):
        expected = xgrammar.testing.bitmask_to_bool_mask(bitmask, vocab_size)[0].nonzero().flatten().tolist()
        assert allowed_tokens(bitmask, vocab_size) == expected


def random_walk(compiler, tokenizer, stops, constraint, seed: int, prefix: str = "", max_steps: int = 1200) -> str:
    """The text of a seeded random walk under the constraint's masks, to the grammar's end, after
    `prefix` (which the grammar must take). A stop token is taken 70% of the time it is allowed."""
    matcher = xgrammar.GrammarMatcher(compiled(compiler, constraint))
    bitmask = xgrammar.allocate_token_bitmask(1, len(tokenizer))
    rng, ids = random.Random(seed), tokenizer.encode(prefix, add_special_tokens=False) if prefix else []
    assert all(matcher.accept_token(token) for token in ids), prefix
    for _ in range(max_steps):
        if matcher.is_terminated():
            break
        matcher.fill_next_token_bitmask(bitmask)
        allowed = allowed_tokens(bitmask, len(tokenizer))
        assert allowed, "the grammar allows no token"
        stop = [token for token in stops if token in allowed]
        others = [token for token in allowed if token not in stops]
        if stop and (not others or rng.random() < 0.7):
            token = stop[0]
        else:
            token = rng.choice(others)
        assert matcher.accept_token(token)
        ids.append(token)
    assert matcher.is_terminated(), "the walk did not reach the grammar's end"
    return tokenizer.decode([token for token in ids if token not in stops], skip_special_tokens=False)


def parse(tool_parser: str, text: str, reasoning_parser: str = "",
          prompt_opens: bool = False) -> tuple[str, str, list[tuple[str, dict]]]:
    """Content, reasoning and the (name, arguments) calls derender reads from `text`."""
    stages = [REASONING_PARSERS[reasoning_parser](prompt_opens, None)] if reasoning_parser else []
    parser_class = TOOL_PARSERS[tool_parser]
    options = {"tools": SCHEMAS} if issubclass(parser_class, MarkupToolParser) else {}
    stages.append(ToolStage(parser_class(streaming=False, **options)))
    content, reasoning, calls = "", "", []
    for final, piece in ((False, text), (True, "")):
        delta = OutputDelta(content=piece)
        for stage in stages:
            delta = stage.process(delta, final=final)
        content, reasoning = content + delta.content, reasoning + delta.reasoning_content
        for call in delta.tool_calls:
            if call.name:
                calls.append([call.name, ""])
            calls[call.index][1] += call.arguments
    return content, reasoning, [(name, json.loads(arguments)) for name, arguments in calls]


def assert_valid_calls(calls: list[tuple[str, dict]], names: set[str]) -> None:
    assert calls
    for name, arguments in calls:
        assert name in names
        jsonschema.validate(arguments, SCHEMAS[name])


REQUIRED = chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_REQUIRED)
NAMED = chat_pb2.ToolChoice(function_name="search")


@pytest.mark.parametrize("markup, tool_parser, family", MARKUPS)
@pytest.mark.parametrize("seed", [1, 2])
def test_required_calls_parse_and_validate(tokenizers, markup, tool_parser, family, seed):
    _, tokenizer, stops, compiler = tokenizers(family)
    text = random_walk(compiler, tokenizer, stops, constraint_for(markup, REQUIRED), seed)
    content, _, calls = parse(tool_parser, text)
    assert content.strip() == "", text
    assert_valid_calls(calls, set(SCHEMAS))


@pytest.mark.parametrize("markup, tool_parser, family", MARKUPS)
def test_a_named_function_is_exactly_one_call_of_it(tokenizers, markup, tool_parser, family):
    _, tokenizer, stops, compiler = tokenizers(family)
    text = random_walk(compiler, tokenizer, stops, constraint_for(markup, NAMED), seed=5)
    _, _, calls = parse(tool_parser, text)
    assert len(calls) == 1
    assert_valid_calls(calls, {"search"})


@pytest.mark.parametrize("markup, tool_parser, family", MARKUPS)
def test_parallel_tool_calls_false_is_exactly_one_call_and_true_allows_more(tokenizers, markup, tool_parser, family):
    _, tokenizer, stops, compiler = tokenizers(family)
    for seed in range(4):
        text = random_walk(compiler, tokenizer, stops, constraint_for(markup, REQUIRED, parallel=False), seed)
        assert len(parse(tool_parser, text)[2]) == 1, text
    if markup == "gpt_oss":
        return  # a harmony call ends the turn: one call per turn whatever the request says
    # A stop token is taken 70% of the time it is allowed: some walk of a few goes on calling.
    counts = [len(parse(tool_parser, random_walk(compiler, tokenizer, stops, constraint_for(markup, REQUIRED),
                                                 seed))[2]) for seed in range(6)]
    assert max(counts) > 1, counts


def well_formed(markup: str, days: object = 3) -> str:
    """One get_weather call as the family writes it (days: as given, to break the schema)."""
    args = {"city": "Paris", "days": days, "unit": "c"}
    body = json.dumps(args)
    xml_coder = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in args.items())
    xml_glm = "".join(f"<arg_key>{k}</arg_key>\n<arg_value>{v}</arg_value>\n" for k, v in args.items())
    return {
        "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {body}}}\n</tool_call>',
        "llama3_json": f'{{"name": "get_weather", "parameters": {body}}}',
        "mistral": f"[TOOL_CALLS]get_weather{body}",
        "mistral_v13": f"[TOOL_CALLS]get_weather[ARGS]{body}",
        "mistral_list": f'[TOOL_CALLS][{{"name": "get_weather", "arguments": {body}}}]',
        "qwen3_coder": f"<tool_call>\n<function=get_weather>\n{xml_coder}</function>\n</tool_call>",
        "deepseek_v3": f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{body}"
                       f"\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
        "deepseek_v31": f"<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{body}<｜tool▁call▁end｜>"
                        f"<｜tool▁calls▁end｜>",
        "kimi_k2": f"<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>"
                   f"{body}<|tool_call_end|><|tool_calls_section_end|>",
        "glm45": f"<tool_call>get_weather\n{xml_glm}</tool_call>",
        "gpt_oss": f"<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{body}",
    }[markup]


def accepts(compiler, tokenizer, constraint, text: str) -> bool:
    matcher = xgrammar.GrammarMatcher(compiled(compiler, constraint))
    ids = tokenizer.encode(text, add_special_tokens=False)
    return all(matcher.accept_token(token) for token in ids) and matcher.is_completed()


@pytest.mark.parametrize("markup, tool_parser, family", MARKUPS)
def test_the_family_markup_is_accepted_and_malformed_markup_refused(tokenizers, markup, tool_parser, family):
    _, tokenizer, _, compiler = tokenizers(family)
    constraint = constraint_for(markup, REQUIRED)
    assert accepts(compiler, tokenizer, constraint, well_formed(markup))
    assert_valid_calls(parse(tool_parser, well_formed(markup))[2], {"get_weather"})
    assert not accepts(compiler, tokenizer, constraint, well_formed(markup, days="x"))  # schema: an integer
    assert not accepts(compiler, tokenizer, constraint, well_formed(markup).replace("get_weather", "get_time"))
    assert not accepts(compiler, tokenizer, constraint, "Sure! " + well_formed(markup))


@pytest.mark.parametrize("family, markup", [("qwen3_coder", "qwen3_coder"), ("deepseek_r1", "deepseek_v3"),
                                            ("deepseek_v31", "deepseek_v31"), ("kimi_k2", "kimi_k2"),
                                            ("glm45", "glm45"), ("gpt_oss", "gpt_oss")])
def test_render_picks_the_family_markup(family, markup):
    model = load_render_model(RenderConfig(model=str(ensure_family_tokenizer(family))))
    assert (model.tool_markup or model.tool_parser) == markup


@pytest.mark.parametrize("template, vocab, markup", [
    ('{{ "[TOOL_CALLS]" + name + "[ARGS]" + args }}', {}, "mistral_v13"),
    ("{{ '[TOOL_CALLS]' + tool_call.name + args }}", {}, "mistral"),
    ("{{ '[TOOL_CALLS] [' }}{% for c in calls %}{{ c | tojson }}{% endfor %}]", {}, "mistral_list"),
    ("", {"[ARGS]": 5}, "mistral_v13"),
    ("", {}, "mistral_list"),
])
def test_mistral_markup_follows_the_template(template, vocab, markup):
    from tito_render.tool_markup import markup_variant

    assert markup_variant("mistral", vocab, template) == markup


def test_auto_with_strict_tools_constrains_only_after_the_trigger(tokenizers):
    _, tokenizer, _, compiler = tokenizers("kimi_k2")
    auto = chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_AUTO)
    constraint = constraint_for("kimi_k2", auto)
    assert accepts(compiler, tokenizer, constraint, "It is sunny.")
    assert accepts(compiler, tokenizer, constraint, "Let me check. " + well_formed("kimi_k2"))
    assert not accepts(compiler, tokenizer, constraint, "Let me check. " + well_formed("kimi_k2", days=12))
    for markup in ("llama3_json", "gpt_oss", "pythonic"):  # no trigger: auto stays free
        assert constraint_for(markup, auto) is None


REASONING = {  # what a reasoning model writes before its answer (R1's prompt opened <think>)
    "qwen3": "<think>\nThe user wants the weather.\n</think>\n\n",
    "deepseek_r1": "\nThe user wants the weather.\n</think>\n\n",
    "gpt_oss": "<|channel|>analysis<|message|>The user wants the weather.<|end|><|start|>assistant",
}


@pytest.mark.parametrize("family, reasoning_parser, markup", [
    ("qwen3_coder", "qwen3", "qwen3_coder"), ("deepseek_r1", "deepseek_r1", "deepseek_v3"),
    ("glm45", "qwen3", "glm45"), ("gpt_oss", "gpt_oss", "gpt_oss")])
def test_tool_calls_after_reasoning(tokenizers, family, reasoning_parser, markup):
    """Thinking on: free reasoning first, then the calls; derender puts the reasoning in
    reasoning_content and the calls validate. Calls right away (no reasoning) are refused."""
    _, tokenizer, stops, compiler = tokenizers(family)
    opened = reasoning_parser == "deepseek_r1"
    constraint = constraint_for(markup, REQUIRED, parallel=False, reasoning=ReasoningStart(reasoning_parser, opened))
    for seed in (1, 2):
        text = random_walk(compiler, tokenizer, stops, constraint, seed, prefix=REASONING[reasoning_parser])
        content, reasoning, calls = parse(markup.split("_v31")[0], text, reasoning_parser, opened)
        assert "weather" in reasoning, text
        assert content.strip() == ""
        assert len(calls) == 1
        assert_valid_calls(calls, set(SCHEMAS))
    if reasoning_parser == "qwen3":
        assert not accepts(compiler, tokenizer, constraint, well_formed(markup))
        assert not accepts(compiler, tokenizer, constraint, REASONING["qwen3"] + "Sure. " + well_formed(markup))


@pytest.mark.parametrize("family, reasoning, before, after", [
    ("gpt_oss", ReasoningStart("gpt_oss"), REASONING["gpt_oss"], "<|channel|>final<|message|>"),
    ("gpt_oss", ReasoningStart("gpt_oss"), "", "<|channel|>final<|message|>"),  # the analysis is optional
    ("qwen3_coder", ReasoningStart("qwen3"), REASONING["qwen3"], ""),
    ("deepseek_r1", ReasoningStart("deepseek_r1", opened=True), REASONING["deepseek_r1"], ""),
])
def test_a_content_constraint_applies_after_the_reasoning(tokenizers, family, reasoning, before, after):
    from tito_render.structured import after_reasoning

    _, tokenizer, _, compiler = tokenizers(family)
    constraint = after_reasoning(StructuredOutputSpec("json_schema", json.dumps(WEATHER)), reasoning)
    answer = json.dumps({"city": "Paris", "days": 3, "unit": "c"})
    assert accepts(compiler, tokenizer, constraint, before + after + answer)
    assert not accepts(compiler, tokenizer, constraint, before + after + answer.replace('"c"', '"k"'))
    assert not accepts(compiler, tokenizer, constraint, before + after + "It is sunny.")
    if after:
        assert not accepts(compiler, tokenizer, constraint, before + answer)  # harmony: only in the final channel
