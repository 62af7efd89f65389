"""Tool-call parsers (hermes, llama3_json, mistral, pythonic): table tests for complete and
streamed output. The streamed argument fragments concatenate to the same JSON as the complete
parse; deltas have the OpenAI shape; malformed markup degrades to content."""

from __future__ import annotations

import json

import pytest

from tito_derender.domain import (
    EngineOutput, FinishReason, OutputDelta, RequestContext, ToolCallDelta, ToolChoiceMode)
from tito_derender.parsers import TOOL_PARSERS, tool_stage_for
from tito_derender.parsers.tool_stage import ToolStage
from tito_derender.stream import DerenderStream

from parser_streams import chunkings, merge as merge_calls

W = {"city": "Paris", "days": [1, 2.5e1], "q": "a\"b é", "nested": {"ok": True, "none": None}}
W_JSON = json.dumps(W, ensure_ascii=False)

# (parser, text, content, [(name, arguments)])
CASES = [
    ("hermes", f'<tool_call>\n{{"name": "get_weather", "arguments": {W_JSON}}}\n</tool_call>', "",
     [("get_weather", W)]),
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
               '<tool_call>\n{"arguments": {"y": [1, {"z": "w"}]}, "name": "b"}\n</tool_call>',
     "Let me check.", [("a", {"x": 1}), ("b", {"y": [1, {"z": "w"}]})]),
    ("hermes", '<tool_call>{"name": "no_args"}</tool_call>', "", [("no_args", {})]),
    ("hermes", '<tool_call>{"name": "s", "arguments": "{\\"k\\": 2}"}</tool_call>', "", [("s", {"k": 2})]),
    ("hermes", 'before <tool_call>{"name": "f", "arguments": {}}</tool_call> after', "before after"[:6] + " after",
     [("f", {})]),
    ("hermes", "plain text with <tool_ and < signs", "plain text with <tool_ and < signs", []),
    ("llama3_json", '{"name": "f", "parameters": {"a": 1}}', "", [("f", {"a": 1})]),
    ("llama3_json", f'<|python_tag|>{{"name": "f", "parameters": {W_JSON}}}; {{"name": "g", "arguments": {{}}}}', "",
     [("f", W), ("g", {})]),
    ("llama3_json", '  {"name": "f", "parameters": {"a": "x;y"}} ; {"name": "g", "parameters": {"b": 2}}', "",
     [("f", {"a": "x;y"}), ("g", {"b": 2})]),
    ("llama3_json", 'The answer is {"name": "f"}', 'The answer is {"name": "f"}', []),
    ("mistral", f'[TOOL_CALLS] [{{"name": "f", "arguments": {W_JSON}}}, {{"name": "g", "arguments": {{"b": 2}}}}]',
     "", [("f", W), ("g", {"b": 2})]),
    ("mistral", 'Sure.[TOOL_CALLS][{"name": "f", "arguments": {}}]', "Sure.", [("f", {})]),
    ("mistral", 'no calls [TOOL_ here', "no calls [TOOL_ here", []),
    ("pythonic", '[get_weather(city="Paris", days=[1, 25.0]), g(b=\'x, y)\', c={"k": (1, 2)}), h()]', "",
     [("get_weather", {"city": "Paris", "days": [1, 25.0]}), ("g", {"b": "x, y)", "c": {"k": [1, 2]}}), ("h", {})]),
    ("pythonic", '[f(a=True, b=None, c=-1.5, d="é")]', "", [("f", {"a": True, "b": None, "c": -1.5, "d": "é"})]),
    ("pythonic", 'Not a call list [f(a=1)]', "Not a call list [f(a=1)]", []),
]

# Malformed markup: the complete parse gives it back as content, untouched.
MALFORMED = [
    ("hermes", '<tool_call>{"name": broken}</tool_call> tail'),
    ("hermes", '<tool_call>{"arguments": {"a": 1}}</tool_call>'),  # no name
    ("hermes", '<tool_call>{"name": "f", "arguments": {"a": [1, {"b": "c'),  # cut off
    ("hermes", '<tool_call>["f"]</tool_call>'),
    ("hermes", '<tool_call>{"name": "f", "arguments": 3}</tool_call>'),
    ("llama3_json", '{"answer": 42}'),
    ("llama3_json", '{"name": "f", "parameters": {"a": }}'),
    ("mistral", '[TOOL_CALLS] nope'),
    ("mistral", '[TOOL_CALLS] [{"name": "f", "arguments": {"a": 1}'),
    ("pythonic", '[Note] hello'),
    ("pythonic", '[f(a=1, 2)]'),
    ("pythonic", '[f(a=g(1))]'),
    ("pythonic", '[f(a={1, 2})]'),  # a set is not JSON
]


def parse(parser_name, pieces, streaming=True, accept=None):
    options = {"streaming": streaming}
    if accept is not None:
        options["accept_name"] = accept
    stage = ToolStage(TOOL_PARSERS[parser_name](**options))
    content, deltas = "", []
    for piece in pieces:
        out = stage.process(OutputDelta(content=piece), final=False)
        content, deltas = content + out.content, deltas + out.tool_calls
    out = stage.process(OutputDelta(), final=True)
    return content + out.content, deltas + out.tool_calls


def merge(deltas: list[ToolCallDelta]) -> list[tuple[str, str, str]]:
    """`parser_streams.merge`, every id in OpenAI's `call_...` shape: the ids these parsers mint."""
    return merge_calls(deltas, id_prefix="call_")


@pytest.mark.parametrize("parser_name,text,content,calls", CASES)
def test_parser_table_complete_and_streamed(parser_name, text, content, calls):
    full_content, full_deltas = parse(parser_name, [text], streaming=False)
    full_calls = merge(full_deltas)
    assert full_content == content
    assert [(name, json.loads(arguments)) for _, name, arguments in full_calls] == calls
    for pieces in chunkings(text, len(text)):
        streamed_content, deltas = parse(parser_name, pieces)
        streamed_calls = merge(deltas)
        assert streamed_content == content, pieces
        # The fragments concatenate to exactly the arguments of the complete parse.
        assert [(n, a) for _, n, a in streamed_calls] == [(n, a) for _, n, a in full_calls], pieces
        assert len({call_id for call_id, _, _ in streamed_calls}) == len(streamed_calls)


def test_arguments_really_stream_in_fragments():
    text = '<tool_call>{"name": "f", "arguments": {"text": "a long argument value"}}</tool_call>'
    _, deltas = parse("hermes", list(text))
    fragments = [d.arguments for d in deltas if not d.name and d.arguments]
    assert len(fragments) > 10  # one per character or so, not one blob at the end
    assert json.loads("".join(fragments)) == {"text": "a long argument value"}


@pytest.mark.parametrize("parser_name,text", MALFORMED)
def test_malformed_markup_is_content_never_an_error(parser_name, text):
    content, deltas = parse(parser_name, [text], streaming=False)
    assert (content, deltas) == (text, [])
    # Streamed: never an exception; a call whose name was already out gets valid JSON arguments.
    for pieces in chunkings(text, 3):
        _, deltas = parse(parser_name, pieces)
        for _, _, arguments in merge(deltas):
            assert isinstance(json.loads(arguments), dict)


def test_ids_are_unique_across_calls_and_streams():
    text = '<tool_call>{"name": "f", "arguments": {}}</tool_call>' * 3
    ids = [call_id for _ in range(5) for call_id, _, _ in merge(parse("hermes", [text])[1])]
    assert len(ids) == 15 and len(set(ids)) == 15


def test_tool_choice_named_only_accepts_that_function():
    text = ('<tool_call>{"name": "other", "arguments": {}}</tool_call>'
            '<tool_call>{"name": "wanted", "arguments": {"a": 1}}</tool_call>')
    for streaming in (True, False):
        content, deltas = parse("hermes", list(text), streaming=streaming, accept=lambda name: name == "wanted")
        assert content == '<tool_call>{"name": "other", "arguments": {}}</tool_call>'
        assert [(n, json.loads(a)) for _, n, a in merge(deltas)] == [("wanted", {"a": 1})]


def context(**fields) -> RequestContext:
    base = dict(tool_parser="hermes", tool_names=("get_weather",), tool_choice=ToolChoiceMode.AUTO)
    base.update(fields)
    return RequestContext(**base)


def test_which_requests_parse_tool_calls():
    assert tool_stage_for(context()) is not None
    assert tool_stage_for(context(tool_choice=ToolChoiceMode.REQUIRED)) is not None
    assert tool_stage_for(context(tool_choice=ToolChoiceMode.NONE)) is None  # markup stays content
    assert tool_stage_for(context(tool_names=())) is None  # no tools offered
    assert tool_stage_for(context(tool_parser="")) is None


CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def stream_text(tokenizer, ctx, text, finish=FinishReason.STOP):
    stream = DerenderStream(tokenizer, ctx)
    chunks = []
    for token_id in hf_of(tokenizer).encode(text, add_special_tokens=False):
        chunks += stream.feed(EngineOutput(index=0, token_ids=(token_id,)))
    chunks += stream.feed(EngineOutput(index=0, finish_reason=finish))
    return chunks


@pytest.mark.parametrize("finish,expected", [(FinishReason.STOP, FinishReason.TOOL_CALLS),
                                             (FinishReason.LENGTH, FinishReason.LENGTH),
                                             (FinishReason.ABORT, FinishReason.ABORT)])
def test_finish_reason_tool_calls_only_when_the_engine_stopped_normally(tiny_tokenizer, finish, expected):
    chunks = stream_text(tiny_tokenizer, context(), CALL, finish)
    assert chunks[-1].finish_reason == expected
    [(_, name, arguments)] = merge([d for c in chunks for d in c.tool_calls])
    assert (name, json.loads(arguments)) == ("get_weather", {"city": "Oslo"})


@pytest.mark.parametrize("choice,expected", [(ToolChoiceMode.AUTO, FinishReason.TOOL_CALLS),
                                             (ToolChoiceMode.REQUIRED, FinishReason.TOOL_CALLS),
                                             (ToolChoiceMode.NAMED, FinishReason.STOP)])
def test_a_named_tool_choice_ends_with_stop_as_openai_and_vllm_end_it(tiny_tokenizer, choice, expected):
    ctx = context(tool_choice=choice, tool_choice_function="get_weather" if choice == ToolChoiceMode.NAMED else "")
    for streaming in (True, False):
        stream = DerenderStream(tiny_tokenizer, ctx, streaming=streaming)
        chunks = stream.feed(EngineOutput(index=0, token_ids=tuple(hf_of(tiny_tokenizer).encode(
            CALL, add_special_tokens=False)), finish_reason=FinishReason.STOP))
        assert chunks[-1].finish_reason == expected
        [(_, name, _)] = merge([d for c in chunks for d in c.tool_calls])
        assert name == "get_weather"


def test_tool_choice_none_keeps_markup_as_content(tiny_tokenizer):
    chunks = stream_text(tiny_tokenizer, context(tool_choice=ToolChoiceMode.NONE), CALL)
    assert "".join(c.content for c in chunks) == CALL
    assert chunks[-1].finish_reason == FinishReason.STOP and not any(c.tool_calls for c in chunks)


def test_tool_markup_inside_reasoning_is_not_a_call(tiny_tokenizer):
    ctx = context(reasoning_parser="qwen3", thinking_enabled=True)
    chunks = stream_text(tiny_tokenizer, ctx, f"<think>maybe {CALL}?</think>\n\n{CALL}")
    assert "".join(c.reasoning_content for c in chunks) == f"maybe {CALL}?"
    assert "".join(c.content for c in chunks) == ""
    assert len(merge([d for c in chunks for d in c.tool_calls])) == 1
    assert chunks[-1].finish_reason == FinishReason.TOOL_CALLS


# -- property: any arguments, any split, streamed == complete ---------------------------------
import keyword  # noqa: E402

from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hf_reference import hf_of  # noqa: E402

_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.floats(-1e6, 1e6, allow_nan=False)
    | st.text(alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]), max_size=6),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
    max_leaves=8)
# Argument names are identifiers but not Python keywords: `f(or=1)` is no valid pythonic call.
_arguments = st.dictionaries(st.from_regex(r"[a-z_][a-z0-9_]{0,5}", fullmatch=True).filter(
    lambda name: not keyword.iskeyword(name)), _values, max_size=4)


def _markup(parser_name: str, calls: list[tuple[str, dict]]) -> str:
    if parser_name == "hermes":
        return "".join(f'<tool_call>\n{json.dumps({"name": n, "arguments": a}, ensure_ascii=False)}\n</tool_call>\n'
                       for n, a in calls)
    if parser_name == "llama3_json":
        return "; ".join(json.dumps({"name": n, "parameters": a}) for n, a in calls)
    if parser_name == "mistral":
        return "[TOOL_CALLS] " + json.dumps([{"name": n, "arguments": a} for n, a in calls])
    return "[" + ", ".join(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in a.items()) + ")" for n, a in calls) + "]"


@pytest.mark.parametrize("parser_name", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_any_arguments_any_split_stream_like_the_complete_parse(parser_name):
    # The model families with their own markup: test_derender_family_parsers.py.
    @settings(max_examples=40, deadline=None, database=None)
    @given(calls=st.lists(st.tuples(st.sampled_from(["f", "get_weather", "a.b"]), _arguments), min_size=1, max_size=3),
           cuts=st.lists(st.integers(0, 400), max_size=12))
    def check(calls, cuts):
        text = _markup(parser_name, calls)
        full_content, full_deltas = parse(parser_name, [text], streaming=False)
        full_calls = merge(full_deltas)
        assert [(n, json.loads(a)) for _, n, a in full_calls] == calls
        assert full_content == ""
        bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
        pieces = [text[a:b] for a, b in zip(bounds, bounds[1:])]
        content, deltas = parse(parser_name, pieces)
        assert content == ""
        assert [(n, a) for _, n, a in merge(deltas)] == [(n, a) for _, n, a in full_calls]

    check()
