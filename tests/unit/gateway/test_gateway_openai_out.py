"""Derender's chunks -> OpenAI's whole and streamed shapes."""

from __future__ import annotations

from tito.v1 import derender_pb2, engine_pb2
from tito_gateway import openai_out

STOP = engine_pb2.FINISH_REASON_STOP
LENGTH = engine_pb2.FINISH_REASON_LENGTH
TOOLS = engine_pb2.FINISH_REASON_TOOL_CALLS


def chunks():
    """Two choices, interleaved as derender sends them; usage totals on each final chunk."""
    return [
        derender_pb2.ChatChunk(index=0, role="assistant", reasoning_content="think"),
        derender_pb2.ChatChunk(index=1, role="assistant", content="B"),
        derender_pb2.ChatChunk(index=0, content="A1"),
        derender_pb2.ChatChunk(index=1, finish_reason=LENGTH,
                               usage=engine_pb2.Usage(prompt_tokens=5, completion_tokens=2)),
        derender_pb2.ChatChunk(index=0, tool_calls=[derender_pb2.ToolCallDelta(index=0, id="call_1", type="function",
                                                                               name="f", arguments='{"a"')]),
        derender_pb2.ChatChunk(index=0, tool_calls=[derender_pb2.ToolCallDelta(index=0, arguments=": 1}")],
                               finish_reason=TOOLS, usage=engine_pb2.Usage(prompt_tokens=5, completion_tokens=6,
                                                                           cached_tokens=1)),
    ]


def test_a_whole_chat_completion_assembles_each_choice():
    assembled = openai_out.Assembled()
    for chunk in chunks():
        assembled.add(chunk)
    body = openai_out.chat_completion("chatcmpl-x", "m", assembled, logprobs=False)
    first, second = body["choices"]
    assert first["message"] == {"role": "assistant", "content": "A1", "reasoning": "think", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a": 1}'}}]}
    assert first["finish_reason"] == "tool_calls" and second["finish_reason"] == "length"
    assert second["message"] == {"role": "assistant", "content": "B"}
    assert body["usage"] == {"prompt_tokens": 5, "completion_tokens": 6, "total_tokens": 11,
                             "prompt_tokens_details": {"cached_tokens": 1}}


def test_with_echo_on_a_tool_call_answers_content_is_a_string_and_the_role_is_the_calls():
    tool_call = derender_pb2.ChatChunk(index=0, role="assistant", finish_reason=TOOLS, tool_calls=[
        derender_pb2.ToolCallDelta(index=0, id="call_1", type="function", name="f", arguments="{}")])
    assembled = openai_out.Assembled()
    assembled.add(tool_call)
    assert openai_out.chat_completion("c", "m", assembled, False)["choices"][0]["message"]["content"] is None
    # vLLM prepends the echo (here nothing) to the content, making it a string.
    echoed = openai_out.chat_completion("c", "m", assembled, False, echo="", role="user")["choices"][0]["message"]
    assert echoed["content"] == "" and echoed["role"] == "user"
    stream = openai_out.ChatStream("c", "m", openai_out.StreamUsage(), logprobs=False, role="user")
    assert stream.chunk(tool_call)["choices"][0]["delta"]["role"] == "user"


def test_streamed_chunks_and_the_usage_chunk():
    stream = openai_out.ChatStream("chatcmpl-x", "m", openai_out.StreamUsage(include_usage=True), logprobs=False)
    events = [event for chunk in chunks() if (event := stream.chunk(chunk)) is not None]
    assert events[0]["choices"][0]["delta"] == {"role": "assistant", "reasoning": "think"}
    assert events[1]["choices"][0]["delta"] == {"role": "assistant", "content": "B"}
    assert events[4]["choices"][0]["delta"]["tool_calls"] == [
        {"index": 0, "id": "call_1", "type": "function", "function": {"name": "f", "arguments": '{"a"'}}]
    assert events[5]["choices"][0]["delta"]["tool_calls"] == [{"index": 0, "function": {"arguments": ": 1}"}}]
    assert all(event["usage"] is None for event in events)
    assert stream.final()["usage"]["completion_tokens"] == 6 and stream.final()["choices"] == []


def test_announced_roles_open_each_choice_and_derenders_chunks_then_carry_none():
    stream = openai_out.ChatStream("chatcmpl-x", "m", openai_out.StreamUsage(), logprobs=False)
    roles = stream.roles(2)
    assert [event["choices"] for event in roles] == [
        [{"index": index, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}]
        for index in (0, 1)]
    assert all(event["id"] == "chatcmpl-x" and "usage" not in event for event in roles)
    events = [event for chunk in chunks() if (event := stream.chunk(chunk)) is not None]
    assert events[0]["choices"][0]["delta"] == {"reasoning": "think"}
    assert events[1]["choices"][0]["delta"] == {"content": "B"}
    assert not any("role" in event["choices"][0]["delta"] for event in events)
    # A role-only chunk from derender, already announced, says nothing more: it is left out.
    assert stream.chunk(derender_pb2.ChatChunk(index=0, role="assistant")) is None


def test_completion_logprobs_in_the_legacy_shape():
    entry = derender_pb2.TokenLogprobText(token="ab", logprob=-0.5, top_logprobs=[
        derender_pb2.TopLogprob(token="ab", logprob=-0.5), derender_pb2.TopLogprob(token="c", logprob=-1.0)])
    assert openai_out.completion_logprobs([entry, entry], 3) == {
        "tokens": ["ab", "ab"], "token_logprobs": [-0.5, -0.5], "top_logprobs": [{"ab": -0.5, "c": -1.0}] * 2,
        "text_offset": [3, 5]}


def completion_chunks():
    """Prompt 0's choices 0 and 1, prompt 1's choices 2 and 3 (n = 2), as merge numbers them."""
    return [derender_pb2.ChatChunk(index=2, content=" world"), derender_pb2.ChatChunk(index=0, content=" there"),
            derender_pb2.ChatChunk(index=1, finish_reason=LENGTH), derender_pb2.ChatChunk(index=3, content="!"),
            derender_pb2.ChatChunk(index=0, content=".", finish_reason=STOP),
            derender_pb2.ChatChunk(index=2, finish_reason=STOP), derender_pb2.ChatChunk(index=3, finish_reason=STOP)]


def test_echo_starts_each_choice_with_its_prompts_text_whole_and_streamed():
    echo = openai_out.Echo(["Hi", "Hello"], n=2)
    assembled = openai_out.Assembled()
    for chunk in completion_chunks():
        assembled.add(chunk)
    body = openai_out.text_completion("cmpl-x", "m", assembled, logprobs=False, echo=echo)
    expected = ["Hi there.", "Hi", "Hello world", "Hello!"]
    assert [choice["text"] for choice in body["choices"]] == expected
    stream = openai_out.CompletionStream("cmpl-x", "m", openai_out.StreamUsage(), logprobs=False, n=2, echo=echo)
    texts: dict[int, str] = {}
    for chunk in completion_chunks():
        event = stream.chunk(chunk)
        if event is not None:
            texts[event["choices"][0]["index"]] = texts.get(event["choices"][0]["index"], "") + \
                event["choices"][0]["text"]
    assert [texts[index] for index in range(4)] == expected


def test_usage_adds_up_over_the_prompts_of_a_completion():
    """Each prompt's final chunks count its own choices finished so far; the request's is the sum."""
    def final(index, prompt_tokens, completion_tokens):
        return derender_pb2.ChatChunk(index=index, finish_reason=STOP, usage=engine_pb2.Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=1))
    assembled = openai_out.Assembled(choices_per_prompt=2)
    for chunk in (final(1, 3, 2), final(2, 4, 1), final(0, 3, 5), final(3, 4, 3)):
        assembled.add(chunk)
    assert openai_out.text_completion("cmpl-x", "m", assembled, logprobs=False)["usage"] == {
        "prompt_tokens": 7, "completion_tokens": 8, "total_tokens": 15, "prompt_tokens_details": {"cached_tokens": 2}}


def test_continuous_usage_puts_each_chunks_own_usage_on_it():
    """As vLLM's continuous_usage_stats: the prompt's tokens and the choice's tokens so far on every
    chunk (derender's in the chunks that do not end a choice), the totals in the usage chunk."""
    def usage(completion_tokens):
        return engine_pb2.Usage(prompt_tokens=5, completion_tokens=completion_tokens)
    stream = openai_out.ChatStream("chatcmpl-x", "m", openai_out.StreamUsage(include_usage=True, continuous=True),
                                   logprobs=False)
    events = stream.roles(2, prompt_tokens=5)
    for chunk in [derender_pb2.ChatChunk(index=0, content="a", usage=usage(1)),
                  derender_pb2.ChatChunk(index=1, content="b", usage=usage(2)),
                  derender_pb2.ChatChunk(index=1, finish_reason=STOP, usage=usage(3)),  # choice 1: 3 tokens
                  derender_pb2.ChatChunk(index=0, content="c", usage=usage(4)),
                  derender_pb2.ChatChunk(index=0, finish_reason=LENGTH, usage=usage(7))]:  # choice 0: 4 tokens
        events.append(stream.chunk(chunk))
    assert [(e["choices"][0]["index"], e["usage"]["completion_tokens"]) for e in events] == [
        (0, 0), (1, 0), (0, 1), (1, 2), (1, 3), (0, 4), (0, 4)]
    assert all(e["usage"]["prompt_tokens"] == 5 and e["usage"]["total_tokens"] == 5 + e["usage"]["completion_tokens"]
               for e in events)
    assert stream.final()["usage"]["completion_tokens"] == 7
    plain = openai_out.ChatStream("chatcmpl-x", "m", openai_out.StreamUsage(include_usage=True), logprobs=False)
    assert plain.chunk(derender_pb2.ChatChunk(index=0, content="a", usage=usage(1)))["usage"] is None
