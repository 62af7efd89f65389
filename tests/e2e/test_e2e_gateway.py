"""End to end: `tito serve gateway` over the three services as processes, driven by the official
`openai` SDK. Whole and streamed answers equal what AsyncChatPipeline returns for the same chat;
errors arrive as the SDK's exception types with OpenAI's error JSON and the contract's reason."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest

from tito.v1 import chat_pb2, engine_pb2, render_pb2
from tito_client.pipeline import AsyncChatPipeline, Endpoints
from tito_models.demo import GREETING_ANSWER

from service_processes import running_gateway, running_services

pytestmark = pytest.mark.e2e

MODEL = "tito-demo"
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


@pytest.fixture(scope="module")
def stack(demo_model, tmp_path_factory):
    """The three services on Unix sockets and the gateway over them on a TCP port."""
    with running_services(demo_model, tmp_path_factory.mktemp("sockets")) as (addresses, _):
        with running_gateway(addresses, ["--served-model-name", MODEL]) as (base, _process):
            yield addresses, base


@pytest.fixture(scope="module")
def client(stack):
    _, base = stack
    with openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120) as sdk:
        yield sdk


def _pipeline_answer(addresses, request: render_pb2.RenderChatRequest) -> tuple[str, str, str]:
    """(content, reasoning, finish reason name) of a chat run through AsyncChatPipeline directly."""
    async def run():
        async with AsyncChatPipeline(Endpoints(**addresses), timeout=120) as pipeline:
            return [chunk async for chunk in pipeline.stream_chat(request)]
    chunks = asyncio.run(run())
    finish = next(c.finish_reason for c in chunks if c.finish_reason)
    return ("".join(c.content for c in chunks), "".join(c.reasoning_content for c in chunks),
            engine_pb2.FinishReason.Name(finish).removeprefix("FINISH_REASON_").lower())


def _greeting_request(thinking: bool) -> render_pb2.RenderChatRequest:
    request = render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content="Hello! What can you do?")],
        sampling=render_pb2.SamplingOptions(max_tokens=64, temperature=0.0))
    request.chat_template_kwargs.update({"enable_thinking": thinking})
    return request


def test_whole_and_streamed_text_equal_the_pipelines(stack, client):
    addresses, _ = stack
    content, _, finish = _pipeline_answer(addresses, _greeting_request(False))
    assert content == GREETING_ANSWER  # the demo model's trained answer: the chat really ran
    messages = [{"role": "user", "content": "Hello! What can you do?"}]
    whole = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=64, temperature=0,
                                           extra_body=NO_THINKING)
    assert whole.object == "chat.completion"
    assert whole.model == MODEL
    assert whole.choices[0].message.role == "assistant"
    assert whole.choices[0].message.content == content
    assert whole.choices[0].finish_reason == finish
    assert whole.usage.completion_tokens > 0
    assert whole.usage.total_tokens == whole.usage.prompt_tokens + whole.usage.completion_tokens

    stream = client.chat.completions.create(model=MODEL, messages=messages, max_completion_tokens=64,
                                            temperature=0, stream=True, stream_options={"include_usage": True},
                                            extra_body=NO_THINKING)
    chunks = list(stream)
    assert all(chunk.object == "chat.completion.chunk" for chunk in chunks)
    assert chunks[0].choices[0].delta.role == "assistant"
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == content
    assert [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason] == [finish]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert all(c.usage is None for c in chunks[:-1])
    assert len({c.id for c in chunks}) == 1


def test_models_lists_the_served_model(client):
    models = client.models.list()
    assert [model.id for model in models.data] == [MODEL]
    assert models.data[0].object == "model"


def test_health_and_metrics(stack, client):
    _, base = stack
    health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 200
    assert health.json() == {"status": "ok", "services": {"render": "SERVING", "engine": "SERVING",
                                                          "derender": "SERVING"}}
    client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4)
    metrics = httpx.get(f"{base}/metrics", timeout=10)
    assert metrics.status_code == 200
    assert 'tito_gateway_requests_total{endpoint="chat",status="200"}' in metrics.text
    assert "tito_gateway_completion_tokens_total" in metrics.text


@pytest.mark.parametrize("extra, param", [
    ({"logit_bias": {"1": 5}}, "logit_bias"),
    ({"no_such_parameter": 1}, "no_such_parameter"),
    ({"stream_options": {"include_usage": True, "continuous_usage_stats": True}, "stream": True},
     "stream_options.continuous_usage_stats"),
])
def test_an_unsupported_parameter_is_a_400_naming_it(client, extra, param):
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       extra_body=extra)
    assert info.value.status_code == 400
    assert info.value.code == "UNSUPPORTED_PARAMETER"
    assert info.value.param == param
    assert param in info.value.message


def test_errors_keep_the_contracts_reason_and_status(client):
    hi = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=hi, temperature=-1)
    assert (info.value.code, info.value.param) == ("INVALID_SAMPLING_PARAMS", "temperature")
    assert info.value.body["type"] == "invalid_request_error"
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hello " * 5000}])
    assert info.value.code == "PROMPT_TOO_LONG"
    with pytest.raises(openai.NotFoundError) as info:
        client.chat.completions.create(model="gpt-4o", messages=hi)
    assert (info.value.status_code, info.value.code, info.value.param) == (404, "MODEL_NOT_FOUND", "model")
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    assert info.value.code == "EMPTY_MESSAGES"
    with pytest.raises(openai.BadRequestError) as info:  # refused before the stream starts: a status
        list(client.chat.completions.create(model=MODEL, messages=hi, temperature=-1, stream=True))
    assert info.value.code == "INVALID_SAMPLING_PARAMS"
    # After every refusal the gateway serves the next request.
    assert client.chat.completions.create(model=MODEL, messages=hi, max_tokens=4).choices[0].finish_reason


def test_unknown_endpoint_is_a_404_in_openais_shape(stack):
    _, base = stack
    reply = httpx.get(f"{base}/v1/embeddings", timeout=10)
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "UNKNOWN_ENDPOINT"
    reply = httpx.get(f"{base}/v1/chat/completions", timeout=10)
    assert reply.status_code == 405
    assert reply.json()["error"]["code"] == "UNKNOWN_ENDPOINT"

