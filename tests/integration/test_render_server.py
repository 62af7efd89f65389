"""RenderService over real gRPC (port 0): rendering, errors with BadRequest fields, recovery."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, render_pb2, render_pb2_grpc
from tito_render.config import RenderConfig
from tito_render.server import SERVICE_NAME, create_server

TIMEOUT = 10


@pytest.fixture(scope="module")
def server(tiny_text_model, module_aio_server):
    # One server for the whole module (load the tokenizer once); every error test also checks
    # the server still works afterwards.
    config = RenderConfig(address="127.0.0.1:0", model=str(tiny_text_model))
    return module_aio_server(lambda: create_server(config))


@pytest.fixture(scope="module")
def stub(server):
    channel = server.channel()
    yield render_pb2_grpc.RenderServiceStub(channel)
    channel.close()


@pytest.fixture(scope="module")
def tokenizer(tiny_text_model):
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(tiny_text_model))


def user(text="What is the weather in Paris?") -> chat_pb2.ChatMessage:
    return chat_pb2.ChatMessage(role="user", content=text)


def good_chat(stub, tokenizer) -> None:
    response = stub.RenderChat(render_pb2.RenderChatRequest(messages=[user()]), timeout=TIMEOUT)
    expected = tokenizer.apply_chat_template([{"role": "user", "content": "What is the weather in Paris?"}],
                                             add_generation_prompt=True, tokenize=True)["input_ids"]
    assert list(response.generate_request.token_ids) == list(expected)


def test_health_is_serving(server):
    with server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", SERVICE_NAME):
            status = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=TIMEOUT).status
            assert status == health_pb2.HealthCheckResponse.SERVING


def test_render_chat_matches_apply_chat_template(stub, tokenizer):
    weather = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
        name="get_weather", description="Weather for a city"))
    request = render_pb2.RenderChatRequest(request_id="chat-1", messages=[user()], tools=[weather],
                                           return_prompt_text=True, cache_salt="tenant-a")
    request.sampling.max_tokens = 16
    request.sampling.temperature = 0.0
    response = stub.RenderChat(request, timeout=TIMEOUT)
    expected = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "description": "Weather for a city"}}],
        add_generation_prompt=True, tokenize=True)["input_ids"]
    generate = response.generate_request
    assert list(generate.token_ids) == list(expected)
    assert generate.request_id == "chat-1" and generate.cache_salt == "tenant-a"
    assert generate.sampling_params.max_tokens == 16 and generate.sampling_params.temperature == 0.0
    context = response.derender_context
    assert context.request_id == "chat-1"
    assert (context.reasoning_parser, context.tool_parser) == ("qwen3", "hermes")
    assert context.prompt_tokens == len(expected)
    assert list(context.prompt_tail_token_ids) == list(expected)[-8:]
    assert context.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_AUTO
    assert response.prompt_text.endswith("<|im_start|>assistant\n")


def _invalid_tool_json():
    return [user(), chat_pb2.ChatMessage(role="assistant", tool_calls=[chat_pb2.ToolCall(
        id="c1", function=chat_pb2.FunctionCall(name="f", arguments="{oops"))])]


BAD_CHATS = {
    "empty_messages": (render_pb2.RenderChatRequest(), "messages"),
    "unknown_role": (render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="wizard", content="x")]),
                     "messages[0].role"),
    "malformed_template": (render_pb2.RenderChatRequest(messages=[user()], chat_template="{% if %}"),
                           "chat_template"),
    "invalid_tool_json": (render_pb2.RenderChatRequest(messages=_invalid_tool_json()),
                          "messages[1].tool_calls[0].function.arguments"),
    "max_tokens_beyond_context": (render_pb2.RenderChatRequest(
        messages=[user()], sampling=render_pb2.SamplingOptions(max_tokens=100000)), "sampling.max_tokens"),
    "prompt_beyond_context": (render_pb2.RenderChatRequest(messages=[user("word " * 3000)]), "messages"),
}


@pytest.mark.parametrize("name", sorted(BAD_CHATS))
def test_bad_chat_is_invalid_argument_then_server_still_works(stub, tokenizer, name):
    request, field = BAD_CHATS[name]
    with pytest.raises(grpc.RpcError) as err:
        stub.RenderChat(request, timeout=TIMEOUT)
    details = error_details(err.value)
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT, details
    assert field in details["fields"], details
    assert details["reason"]
    good_chat(stub, tokenizer)


def test_video_part_on_text_model_is_unsupported_modality(stub, tokenizer):
    part = chat_pb2.ContentPart(video=chat_pb2.VideoFrames(frames=[chat_pb2.ImageSource(data=b"\x89PNG")]))
    with pytest.raises(grpc.RpcError) as err:
        stub.RenderChat(render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(
            role="user", content_parts=[part])]), timeout=TIMEOUT)
    details = error_details(err.value)
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT
    assert details["reason"] == "UNSUPPORTED_MODALITY"
    assert details["fields"] == ["messages[0].content_parts[0].video"]
    good_chat(stub, tokenizer)


def test_render_completion_text_and_ids(stub, tokenizer):
    text = stub.RenderCompletion(render_pb2.RenderCompletionRequest(prompt="Once upon a time"), timeout=TIMEOUT)
    assert list(text.generate_request.token_ids) == tokenizer("Once upon a time")["input_ids"]
    assert text.generate_request.request_id == text.derender_context.request_id != ""
    ids = stub.RenderCompletion(render_pb2.RenderCompletionRequest(prompt_token_ids=[10, 20, 30]), timeout=TIMEOUT)
    assert list(ids.generate_request.token_ids) == [10, 20, 30]
    assert ids.derender_context.prompt_tokens == 3
    assert ids.generate_request.sampling_params.max_tokens == 2048 - 3


@pytest.mark.parametrize("request_fields, fields", [
    (dict(), ["prompt", "prompt_token_ids"]),
    (dict(prompt="x", prompt_token_ids=[1]), ["prompt", "prompt_token_ids"]),
    (dict(prompt_token_ids=[1, 99999]), ["prompt_token_ids[1]"]),
])
def test_render_completion_exactly_one_prompt(stub, tokenizer, request_fields, fields):
    with pytest.raises(grpc.RpcError) as err:
        stub.RenderCompletion(render_pb2.RenderCompletionRequest(**request_fields), timeout=TIMEOUT)
    details = error_details(err.value)
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT
    assert details["fields"] == fields
    good_chat(stub, tokenizer)


def test_tokenize(stub, tokenizer):
    response = stub.Tokenize(render_pb2.TokenizeRequest(text="Hello, world!", return_token_strings=True),
                             timeout=TIMEOUT)
    assert list(response.token_ids) == tokenizer("Hello, world!", add_special_tokens=False)["input_ids"]
    assert len(response.token_strings) == len(response.token_ids)


def test_get_model_info(stub, tiny_text_model, tokenizer):
    info = stub.GetModelInfo(render_pb2.RenderServiceGetModelInfoRequest(), timeout=TIMEOUT)
    assert info.model_id == str(tiny_text_model)
    assert info.vocab_size == len(tokenizer)
    assert info.max_context_length == 2048
    assert (info.reasoning_parser, info.tool_parser) == ("qwen3", "hermes")
    assert info.has_chat_template and list(info.modalities) == []


def test_parser_flags_and_max_model_len(aio_server, tiny_text_model):
    config = RenderConfig(model=str(tiny_text_model), reasoning_parser="none", tool_parser="pythonic",
                          max_model_len=64)
    running = aio_server(lambda: create_server(config))
    with running.channel() as channel:
        stub = render_pb2_grpc.RenderServiceStub(channel)
        info = stub.GetModelInfo(render_pb2.RenderServiceGetModelInfoRequest(), timeout=TIMEOUT)
        assert (info.reasoning_parser, info.tool_parser, info.max_context_length) == ("", "pythonic", 64)
        response = stub.RenderChat(render_pb2.RenderChatRequest(messages=[user()]), timeout=TIMEOUT)
        context = response.derender_context
        assert context.reasoning_parser == "" and not context.thinking_enabled
        assert response.generate_request.sampling_params.max_tokens == 64 - context.prompt_tokens


def test_concurrent_renders_and_health_stay_responsive(server, stub, tokenizer):
    long_chat = render_pb2.RenderChatRequest(messages=[user("tell me a story " * 100)])
    with server.channel() as channel, ThreadPoolExecutor(8) as pool:
        health = health_pb2_grpc.HealthStub(channel)
        renders = [pool.submit(stub.RenderChat, long_chat, timeout=TIMEOUT) for _ in range(16)]
        assert health.Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT).status == \
            health_pb2.HealthCheckResponse.SERVING
        ids = {tuple(f.result().generate_request.token_ids) for f in renders}
        request_ids = {f.result().generate_request.request_id for f in renders}
    assert len(ids) == 1 and len(request_ids) == 16
