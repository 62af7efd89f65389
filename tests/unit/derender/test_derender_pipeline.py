"""The whole choice pipeline: logprobs with text, parser-name validation, n > 1 with parsers,
DerenderFull filling tool calls and reasoning, and the default for spaces between specials."""

from __future__ import annotations

import json

import pytest

from tito.errors import InvalidArgument
from tito.v1 import chat_pb2, derender_pb2, sampling_pb2
from tito_derender.convert import context_from_proto, text_options
from tito_derender.domain import (
    EngineOutput, FinishReason, PositionLogprobs, RequestContext, TokenLogprob, ToolChoiceMode)
from tito_derender.full import derender_full
from tito_derender.stream import DerenderStream


def test_logprobs_carry_token_text_and_bytes_even_for_partial_characters(tiny_tokenizer):
    ids = hf_of(tiny_tokenizer).encode("é ok", add_special_tokens=False)
    positions = tuple(PositionLogprobs(sampled=TokenLogprob(i, -0.5, 1),
                                       top=(TokenLogprob(i, -0.5, 1), TokenLogprob(5, -2.0, 2))) for i in ids)
    stream = DerenderStream(tiny_tokenizer, RequestContext(logprobs=True))
    chunks = []
    for token_id, position in zip(ids, positions):
        chunks += stream.feed(EngineOutput(index=0, token_ids=(token_id,), logprobs=(position,)))
    chunks += stream.feed(EngineOutput(index=0, finish_reason=FinishReason.STOP))
    entries = [entry for chunk in chunks for entry in chunk.logprobs]
    assert [e.token_id for e in entries] == ids  # every token once, in order
    assert b"".join(e.bytes for e in entries) == "é ok".encode()
    assert all(e.token == hf_of(tiny_tokenizer).decode([e.token_id]) for e in entries)
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[1].token_id == 5 for e in entries)
    # A chunk carries the logprobs of the tokens whose text it brings: none are lost while text waits.
    for chunk in chunks:
        if chunk.logprobs:
            assert chunk.content or chunk.finish_reason


def test_logprobs_must_match_the_token_ids(tiny_tokenizer):
    stream = DerenderStream(tiny_tokenizer, RequestContext(logprobs=True))
    with pytest.raises(InvalidArgument) as error:
        stream.feed(EngineOutput(index=0, token_ids=(1, 2), logprobs=(PositionLogprobs(TokenLogprob(1, -1.0)),)))
    assert error.value.field == "generate_response.logprobs"
    with pytest.raises(InvalidArgument) as error:
        stream.feed(EngineOutput(index=0, token_ids=(1,), logprobs=(
            PositionLogprobs(TokenLogprob(1, -1.0), top=(TokenLogprob(10**6, -2.0),)),)))
    assert error.value.field == "generate_response.logprobs[0].top[0].token_id"


@pytest.mark.parametrize("every_chunk", [True, False])
def test_usage_in_every_chunk_counts_the_prompt_and_the_choices_tokens_so_far(tiny_tokenizer, every_chunk):
    texts = {0: "one two three four", 1: "five six"}
    ids = {index: hf_of(tiny_tokenizer).encode(text, add_special_tokens=False) for index, text in texts.items()}
    stream = DerenderStream(tiny_tokenizer, RequestContext(n=2, prompt_tokens=9, usage_in_every_chunk=every_chunk))
    fed, content_chunks = {0: 0, 1: 0}, 0
    for step in range(max(map(len, ids.values()))):
        for index in (0, 1):
            if step < len(ids[index]):
                fed[index] += 1
                for chunk in stream.feed(EngineOutput(index=index, token_ids=(ids[index][step],))):
                    content_chunks += 1
                    if every_chunk:  # the tokens generated, counted as vLLM counts them
                        assert (chunk.usage.prompt_tokens, chunk.usage.completion_tokens) == (9, fed[index])
                    else:
                        assert chunk.usage is None
    assert content_chunks >= 4
    [first_final] = stream.feed(EngineOutput(index=1, finish_reason=FinishReason.STOP))
    [last_final] = stream.feed(EngineOutput(index=0, finish_reason=FinishReason.STOP))
    # Final chunks keep their meaning: every choice finished so far.
    assert first_final.usage.completion_tokens == len(ids[1])
    assert last_final.usage.completion_tokens == len(ids[0]) + len(ids[1])


@pytest.mark.parametrize("field,value", [("tool_parser", "nope"), ("reasoning_parser", "qwen9")])
def test_unknown_parser_names_are_rejected_naming_the_known_ones(tiny_tokenizer, field, value):
    with pytest.raises(InvalidArgument) as error:
        DerenderStream(tiny_tokenizer, RequestContext(**{field: value}))
    assert error.value.field == f"context.{field}"
    assert "hermes" in error.value.message or "qwen3" in error.value.message


AGENT = ('<think>\nNeed weather.\n</think>\n\nChecking.\n<tool_call>\n{"name": "get_weather", '
         '"arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>')
AGENT_CONTEXT = RequestContext(reasoning_parser="qwen3", tool_parser="hermes", tool_names=("get_weather",),
                               tool_choice=ToolChoiceMode.AUTO, thinking_enabled=True, n=2, prompt_tokens=9)


def test_two_choices_each_with_its_own_parser_state(tiny_tokenizer):
    a = hf_of(tiny_tokenizer).encode(AGENT, add_special_tokens=False)
    b = hf_of(tiny_tokenizer).encode("<think>short</think>Just text.", add_special_tokens=False)
    stream = DerenderStream(tiny_tokenizer, AGENT_CONTEXT)
    chunks = []
    for step in range(max(len(a), len(b))):
        for index, ids in ((0, a), (1, b)):
            if step < len(ids):
                chunks += stream.feed(EngineOutput(index=index, token_ids=(ids[step],)))
    chunks += stream.feed(EngineOutput(index=1, finish_reason=FinishReason.STOP))
    chunks += stream.feed(EngineOutput(index=0, finish_reason=FinishReason.STOP))
    first = [c for c in chunks if c.index == 0]
    second = [c for c in chunks if c.index == 1]
    assert "".join(c.reasoning_content for c in first) == "\nNeed weather.\n"
    assert "".join(c.content for c in first) == "\n\nChecking."
    arguments = "".join(d.arguments for c in first for d in c.tool_calls)
    assert json.loads(arguments) == {"city": "Paris", "unit": "C"}
    assert first[-1].finish_reason == FinishReason.TOOL_CALLS
    assert ("".join(c.reasoning_content for c in second), "".join(c.content for c in second)) == \
        ("short", "Just text.")
    assert second[-1].finish_reason == FinishReason.STOP


def test_full_fills_tool_calls_reasoning_and_content(tiny_tokenizer):
    a = hf_of(tiny_tokenizer).encode(AGENT, add_special_tokens=False)
    broken = hf_of(tiny_tokenizer).encode('<tool_call>{"name": "get_weather", "arguments": {"city": ',
                                      add_special_tokens=False)
    choices, usage = derender_full(tiny_tokenizer, AGENT_CONTEXT, [
        EngineOutput(index=0, token_ids=tuple(a[:7])), EngineOutput(index=1, token_ids=tuple(broken)),
        EngineOutput(index=0, token_ids=tuple(a[7:]), finish_reason=FinishReason.STOP),
        EngineOutput(index=1, finish_reason=FinishReason.LENGTH)])
    first, second = choices
    assert first.reasoning_content == "\nNeed weather.\n" and first.content == "\n\nChecking."
    [call] = first.tool_calls
    assert call.name == "get_weather" and call.id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
    assert first.finish_reason == FinishReason.TOOL_CALLS
    # Non-streaming: a cut-off call is plain content, not a repaired call.
    assert second.tool_calls == [] and second.finish_reason == FinishReason.LENGTH
    assert second.content == '<tool_call>{"name": "get_weather", "arguments": {"city": '
    assert usage.completion_tokens == len(a) + len(broken)


@pytest.mark.parametrize("tool_parser,reads_schemas", [("qwen3_coder", True), ("glm45", True), ("kimi_k2", True),
                                                    ("hermes", False)])
def test_the_tools_schemas_reach_the_parsers_that_read_them(tool_parser, reads_schemas):
    """kimi_k2 matches a call with a bare counter id to its tool by the schemas."""
    tool = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(name="get_weather"))
    tool.function.parameters.update({"type": "object", "properties": {"city": {"type": "string"}}})
    context = context_from_proto(derender_pb2.DerenderContext(tool_parser=tool_parser, tools=[tool]))
    expected = (("get_weather", {"type": "object", "properties": {"city": {"type": "string"}}}),)
    assert context.tool_schemas == (expected if reads_schemas else ())


def test_spaces_between_special_tokens_default_false_when_absent():
    assert text_options(sampling_pb2.OutputTextOptions()).spaces_between_special_tokens is False
    assert text_options(sampling_pb2.OutputTextOptions()).skip_special_tokens is True
    explicit = sampling_pb2.OutputTextOptions(spaces_between_special_tokens=True, skip_special_tokens=False)
    assert text_options(explicit).spaces_between_special_tokens is True
    assert text_options(derender_pb2.DetokenizeRequest()).spaces_between_special_tokens is False


# -- fuzz: whatever a (random) model emits, derender answers with chunks, never an error --------
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from hf_reference import hf_of  # noqa: E402

_MARKUP = ["<think>", "</think>", "<tool_call>", "</tool_call>", '{"name": "get_weather", "arguments": {',
           '"city": "Oslo"', "}", "}}", "[", "]", "(", ")", ",", ":", '"', "\n", " STOP ", "日本", "🎉"]


@pytest.mark.parametrize("tool_parser", ["hermes", "llama3_json", "mistral", "pythonic"])
def test_fuzzed_outputs_never_fail(tiny_tokenizer, tool_parser):
    pieces = [hf_of(tiny_tokenizer).encode(m, add_special_tokens=False) for m in _MARKUP]

    @settings(max_examples=40, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(groups=st.lists(st.one_of(st.sampled_from(pieces), st.lists(st.integers(0, tiny_tokenizer.vocab_size - 1),
                                                                       max_size=3)), max_size=25),
           reasoning=st.sampled_from(["", "qwen3", "deepseek_r1"]), opens=st.booleans(),
           finish=st.sampled_from([FinishReason.STOP, FinishReason.LENGTH]), streaming=st.booleans())
    def check(groups, reasoning, opens, finish, streaming):
        ids = [i for group in groups for i in group]
        ctx = RequestContext(reasoning_parser=reasoning, tool_parser=tool_parser, tool_names=("get_weather",),
                             tool_choice=ToolChoiceMode.AUTO, thinking_enabled=True, prompt_opens_reasoning=opens,
                             stop=("STOP",))
        stream = DerenderStream(tiny_tokenizer, ctx, streaming=streaming)
        chunks = []
        for token_id in ids:
            chunks += stream.feed(EngineOutput(index=0, token_ids=(token_id,)))
        chunks += stream.feed(EngineOutput(index=0, finish_reason=finish))
        assert stream.finished and chunks and chunks[-1].finish_reason is not None
        calls: dict[int, str] = {}
        for chunk in chunks:
            for delta in chunk.tool_calls:
                if delta.name:
                    calls[delta.index] = ""
                calls[delta.index] += delta.arguments
        assert all(isinstance(json.loads(arguments), dict) for arguments in calls.values())
        if calls and chunks[-1].finish_reason != FinishReason.LENGTH:
            assert chunks[-1].finish_reason == FinishReason.TOOL_CALLS

    check()
