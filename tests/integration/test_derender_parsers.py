"""DerenderService over real gRPC with the output options a render context carries: reasoning
(qwen3), tools (hermes) with thinking on, stop strings with cancel_generation, logprobs, and
unknown parser names rejected with the field named."""

from __future__ import annotations

import json

import grpc
import pytest

from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, derender_pb2, derender_pb2_grpc, engine_pb2, sampling_pb2
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server

DEADLINE = 20

WEATHER_TOOL = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
    name="get_weather", description="Weather for a city"))
AGENT_OUTPUT = ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", '
                '"arguments": {"city": "Paris", "days": 3}}\n</tool_call>')


@pytest.fixture
def stub(aio_server, tiny_text_model):
    server = aio_server(lambda: create_server(DerenderConfig(address="127.0.0.1:0", model=str(tiny_text_model))))
    channel = server.channel()
    yield derender_pb2_grpc.DerenderServiceStub(channel)
    channel.close()


def agent_context(hf_tokenizer, **fields) -> derender_pb2.DerenderContext:
    """What render produces for a chat with tools and thinking on (prompt ends "<|im_start|>assistant\\n")."""
    prompt_ids = hf_tokenizer.encode("<|im_start|>user\nWeather?<|im_end|>\n<|im_start|>assistant\n",
                                     add_special_tokens=False)
    base = dict(request_id="agent-1", prompt_tail_token_ids=prompt_ids[-8:], prompt_tokens=len(prompt_ids),
                reasoning_parser="qwen3", tool_parser="hermes", tools=[WEATHER_TOOL],
                tool_choice=chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_AUTO), thinking_enabled=True,
                n=1, text_options=sampling_pb2.OutputTextOptions(skip_special_tokens=True))
    base.update(fields)
    return derender_pb2.DerenderContext(**base)


def engine_messages(ids, final_reason=engine_pb2.FINISH_REASON_STOP, stop_token=None):
    messages = [derender_pb2.DerenderRequest(generate_response=engine_pb2.GenerateResponse(index=0, token_ids=[i]))
                for i in ids]
    # The engine's count is every token it streamed for the choice (derender refuses more).
    last = engine_pb2.GenerateResponse(index=0, finish_reason=final_reason, usage=engine_pb2.Usage(
        prompt_tokens=20, completion_tokens=len(ids) + (stop_token is not None)))
    if stop_token is not None:
        last.token_ids.append(stop_token)
        last.matched_stop_token_id = stop_token
    messages.append(derender_pb2.DerenderRequest(generate_response=last))
    return messages


def test_render_style_context_with_thinking_and_tools(stub, hf_tokenizer):
    ids = hf_tokenizer.encode(AGENT_OUTPUT, add_special_tokens=False)
    im_end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    requests = [derender_pb2.DerenderRequest(context=agent_context(hf_tokenizer))]
    requests += engine_messages(ids, stop_token=im_end)
    chunks = [r.chunk for r in stub.Derender(iter(requests), timeout=DEADLINE)]
    assert chunks[0].role == "assistant"
    assert "".join(c.reasoning_content for c in chunks) == "\nThe user wants the weather.\n"
    assert "".join(c.content for c in chunks) == ""
    deltas = [d for c in chunks for d in c.tool_calls]
    assert deltas[0].name == "get_weather" and deltas[0].id.startswith("call_") and deltas[0].type == "function"
    assert all(d.index == 0 and not d.id and not d.name for d in deltas[1:])
    assert len(deltas) > 3  # the arguments streamed in several fragments
    assert json.loads("".join(d.arguments for d in deltas)) == {"city": "Paris", "days": 3}
    last = chunks[-1]
    assert last.finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS
    assert last.HasField("usage") and last.usage.completion_tokens == len(ids) + 1


def test_full_with_tools_and_reasoning(stub, hf_tokenizer):
    ids = hf_tokenizer.encode(AGENT_OUTPUT, add_special_tokens=False)
    response = stub.DerenderFull(derender_pb2.DerenderFullRequest(
        context=agent_context(hf_tokenizer),
        responses=[engine_pb2.GenerateResponse(index=0, token_ids=ids[:9]),
                   engine_pb2.GenerateResponse(index=0, token_ids=ids[9:],
                                               finish_reason=engine_pb2.FINISH_REASON_STOP)]),
        timeout=DEADLINE)
    [choice] = response.choices
    assert choice.finish_reason == engine_pb2.FINISH_REASON_TOOL_CALLS
    assert choice.message.reasoning_content == "\nThe user wants the weather.\n"
    assert not choice.message.HasField("content")  # only calls: content is null, as in OpenAI
    [call] = choice.message.tool_calls
    assert call.id.startswith("call_") and call.type == "function" and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "days": 3}


def test_tool_choice_none_and_thinking_off_give_plain_content(stub, hf_tokenizer):
    ids = hf_tokenizer.encode(AGENT_OUTPUT, add_special_tokens=False)
    context = agent_context(hf_tokenizer, thinking_enabled=False,
                            tool_choice=chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_NONE))
    requests = [derender_pb2.DerenderRequest(context=context)] + engine_messages(ids)
    chunks = [r.chunk for r in stub.Derender(iter(requests), timeout=DEADLINE)]
    assert "".join(c.content for c in chunks) == AGENT_OUTPUT
    assert not any(c.tool_calls or c.reasoning_content for c in chunks)
    assert chunks[-1].finish_reason == engine_pb2.FINISH_REASON_STOP


def test_stop_string_asks_to_cancel_and_later_messages_are_ignored(stub, hf_tokenizer):
    ids = hf_tokenizer.encode("Count: one, two, three, four", add_special_tokens=False)
    context = derender_pb2.DerenderContext(text_options=sampling_pb2.OutputTextOptions(stop=["three"]))
    requests = [derender_pb2.DerenderRequest(context=context)] + engine_messages(ids, engine_pb2.FINISH_REASON_ABORT)
    chunks = [r.chunk for r in stub.Derender(iter(requests), timeout=DEADLINE)]
    assert "".join(c.content for c in chunks) == "Count: one, two, "
    finals = [c for c in chunks if c.finish_reason]
    assert len(finals) == 1 and finals[0] == chunks[-1]
    assert finals[0].finish_reason == engine_pb2.FINISH_REASON_STOP and finals[0].matched_stop == "three"
    assert finals[0].cancel_generation


def test_logprobs_over_the_wire(stub, hf_tokenizer):
    ids = hf_tokenizer.encode("日本 ok", add_special_tokens=False)
    requests = [derender_pb2.DerenderRequest(context=derender_pb2.DerenderContext(logprobs=True))]
    for token_id in ids:
        requests.append(derender_pb2.DerenderRequest(generate_response=engine_pb2.GenerateResponse(
            index=0, token_ids=[token_id], logprobs=[engine_pb2.PositionLogprobs(
                sampled=engine_pb2.TokenLogprob(token_id=token_id, logprob=-0.25, rank=1),
                top=[engine_pb2.TokenLogprob(token_id=token_id, logprob=-0.25, rank=1)])])))
    requests.append(derender_pb2.DerenderRequest(generate_response=engine_pb2.GenerateResponse(
        index=0, finish_reason=engine_pb2.FINISH_REASON_LENGTH)))
    chunks = [r.chunk for r in stub.Derender(iter(requests), timeout=DEADLINE)]
    entries = [e for c in chunks for e in c.logprobs]
    assert [e.token_id for e in entries] == ids
    assert b"".join(e.bytes for e in entries).decode() == "日本 ok"
    assert all(e.logprob == pytest.approx(-0.25) and e.top_logprobs[0].token == e.token for e in entries)


@pytest.mark.parametrize("field,value", [("tool_parser", "json_magic"), ("reasoning_parser", "o1")])
def test_unknown_parser_is_invalid_argument_and_the_server_keeps_working(stub, hf_tokenizer, field, value):
    context = derender_pb2.DerenderContext(**{field: value})
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Derender(iter([derender_pb2.DerenderRequest(context=context)]), timeout=DEADLINE))
    details = error_details(error.value)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert f"context.{field}" in details["fields"]
    with pytest.raises(grpc.RpcError) as error:
        stub.DerenderFull(derender_pb2.DerenderFullRequest(context=context), timeout=DEADLINE)
    assert error.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    ids = hf_tokenizer.encode("fine", add_special_tokens=False)
    requests = [derender_pb2.DerenderRequest(context=derender_pb2.DerenderContext())] + engine_messages(ids)
    assert "".join(r.chunk.content for r in stub.Derender(iter(requests), timeout=DEADLINE)) == "fine"


def test_spaces_between_special_tokens_only_when_asked(stub, hf_tokenizer):
    ids = hf_tokenizer.encode("a<|im_end|><|im_start|>b", add_special_tokens=False)
    plain = stub.Detokenize(derender_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=False),
                            timeout=DEADLINE)
    assert plain.text == hf_tokenizer.decode(ids, skip_special_tokens=False) == "a<|im_end|><|im_start|>b"
    spaced = stub.Detokenize(derender_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=False,
                                                            spaces_between_special_tokens=True), timeout=DEADLINE)
    assert spaced.text == "a<|im_end|> <|im_start|>b"
