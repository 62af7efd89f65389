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

from images import png_data_url
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
    # As OpenAI's and vLLM's streams begin: the role alone (content ""), sent on the engine's first
    # token; the text follows in chunks without a role.
    assert (chunks[0].choices[0].delta.role, chunks[0].choices[0].delta.content) == ("assistant", "")
    assert all(c.choices[0].delta.role is None for c in chunks[1:] if c.choices)
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
    ({"no_such_parameter": 1}, "no_such_parameter"),
    ({"stream_options": {"include_usage": True, "include_obfuscation": True}, "stream": True},
     "stream_options.include_obfuscation"),
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
    with pytest.raises(openai.NotFoundError) as info:  # spelled as OpenAI spells it
        client.chat.completions.create(model="gpt-4o", messages=hi)
    assert (info.value.status_code, info.value.code, info.value.param) == (404, "model_not_found", None)
    assert info.value.body["message"] == "The model `gpt-4o` does not exist or you do not have access to it."
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[])
    assert info.value.code == "EMPTY_MESSAGES"
    with pytest.raises(openai.BadRequestError) as info:  # refused before the stream starts: a status
        list(client.chat.completions.create(model=MODEL, messages=hi, temperature=-1, stream=True))
    assert info.value.code == "INVALID_SAMPLING_PARAMS"
    # After every refusal the gateway serves the next request.
    assert client.chat.completions.create(model=MODEL, messages=hi, max_tokens=4).choices[0].finish_reason


def test_what_sdks_send_beyond_the_answer_is_served(client):
    """A `developer` message (the demo template has no such role: it is the system prompt, as vLLM
    makes it), and the SDK's account parameters, which change nothing in the answer."""
    def answer(role: str, **extra):
        return client.chat.completions.create(
            model=MODEL, messages=[{"role": role, "content": "You are tito."},
                                   {"role": "user", "content": "Hello! What can you do?"}],
            max_tokens=8, temperature=0, extra_body=NO_THINKING, **extra)
    as_system = answer("system")
    as_developer = answer("developer", metadata={"team": "docs"}, store=True, service_tier="auto", user="u-1")
    assert as_developer.choices[0].message.content == as_system.choices[0].message.content
    assert as_developer.usage.prompt_tokens == as_system.usage.prompt_tokens


def test_unknown_endpoint_is_a_404_in_openais_shape(stack):
    _, base = stack
    reply = httpx.get(f"{base}/v1/embeddings", timeout=10)
    assert reply.status_code == 404
    assert reply.json()["error"]["code"] == "UNKNOWN_ENDPOINT"
    reply = httpx.get(f"{base}/v1/chat/completions", timeout=10)
    assert reply.status_code == 405
    assert reply.json()["error"]["code"] == "UNKNOWN_ENDPOINT"



# -- every parameter ------------------------------------------------------------------------------

def _png_data_url(colour: str) -> str:
    from tito_models import demo

    return png_data_url(demo.colour_image(colour, 90, 110, seed=7))


def test_images_as_data_urls_and_reasoning_in_its_field(client):
    # `detail` is accepted and left to the model's processor, as vLLM does.
    question = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": _png_data_url("blue"),
                                                                                "detail": "low"}},
                                             {"type": "text", "text": "What colour is this?"}]}]
    whole = client.chat.completions.create(model=MODEL, messages=question, max_tokens=80, temperature=0)
    message = whole.choices[0].message
    assert message.content.strip() == "The image is blue."
    assert message.reasoning.strip() == "The image is mostly blue."  # vLLM 0.32's field name
    streamed = list(client.chat.completions.create(model=MODEL, messages=question, max_tokens=80, temperature=0,
                                                   stream=True))
    deltas = [c.choices[0].delta for c in streamed if c.choices]
    assert "".join(getattr(d, "reasoning", None) or "" for d in deltas) == message.reasoning
    assert "".join(d.content or "" for d in deltas) == message.content
    # The older `reasoning_content` of an earlier assistant turn is accepted on input.
    follow = question + [{"role": "assistant", "content": message.content,
                          "reasoning_content": message.reasoning},
                         {"role": "user", "content": "Hello! What can you do?"}]
    assert client.chat.completions.create(model=MODEL, messages=follow, max_tokens=8).choices[0].finish_reason


def test_tools_and_tool_choice_whole_and_streamed(client):
    from tito_models import demo

    question = [{"role": "user", "content": "What is the weather in Tokyo?"}]
    whole = client.chat.completions.create(model=MODEL, messages=question, tools=[demo.WEATHER_TOOL],
                                           tool_choice="auto", parallel_tool_calls=True, max_tokens=80, temperature=0)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls"
    [call] = choice.message.tool_calls
    assert call.type == "function" and call.id and call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Tokyo"}
    stream = list(client.chat.completions.create(model=MODEL, messages=question, tools=[demo.WEATHER_TOOL],
                                                 max_tokens=80, temperature=0, stream=True))
    pieces = [tc for c in stream if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert pieces[0].function.name == "get_weather" and pieces[0].id
    assert json.loads("".join(p.function.arguments or "" for p in pieces)) == {"city": "Tokyo"}
    # The tool's result goes back as a tool message; the answer reads it.
    # The SDK's own message object goes back as is (its null refusal, audio, annotations...), less
    # the reasoning, which the demo model was trained to see dropped from earlier turns.
    echoed = whole.choices[0].message.model_dump()
    echoed.pop("reasoning", None)
    history = question + [echoed,
                          {"role": "tool", "tool_call_id": call.id,
                           "content": demo.weather_result("Tokyo", 17, "rainy")}]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[demo.WEATHER_TOOL], max_tokens=80,
                                            temperature=0)
    assert answer.choices[0].message.content.strip() == "It is rainy in Tokyo."
    # A named function forces the call.
    named = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], tools=[demo.WEATHER_TOOL], max_tokens=60,
        tool_choice={"type": "function", "function": {"name": "get_weather"}}, extra_body=NO_THINKING)
    assert named.choices[0].message.tool_calls[0].function.name == "get_weather"
    assert named.choices[0].finish_reason == "stop"  # OpenAI's and vLLM's rule for a named function
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=question, tools=[demo.WEATHER_TOOL],
                                       tool_choice={"type": "function", "function": {"name": "nope"}})
    assert info.value.code == "UNKNOWN_TOOL"


def test_response_format_json_schema_and_json_object(client):
    import jsonschema

    schema = {"type": "object", "properties": {"colour": {"type": "string", "enum": ["red", "blue"]}},
              "required": ["colour"], "additionalProperties": False}
    answer = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hello!"}], max_tokens=40, extra_body=NO_THINKING,
        response_format={"type": "json_schema", "json_schema": {"name": "c", "schema": schema, "strict": True}})
    jsonschema.validate(json.loads(answer.choices[0].message.content), schema)
    answer = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=60,
                                            response_format={"type": "json_object"}, extra_body=NO_THINKING)
    if answer.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(answer.choices[0].message.content), dict)
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                       response_format={"type": "yaml"})
    assert info.value.code == "INVALID_RESPONSE_FORMAT"


def test_n_choices_seed_and_logprobs(client):
    hi = [{"role": "user", "content": "Hi"}]
    many = client.chat.completions.create(model=MODEL, messages=hi, n=3, temperature=1.0, seed=5, max_tokens=12,
                                          logprobs=True, top_logprobs=2, extra_body=NO_THINKING)
    assert sorted(choice.index for choice in many.choices) == [0, 1, 2]
    for choice in many.choices:
        entries = choice.logprobs.content
        assert entries and all(len(entry.top_logprobs) == 2 and entry.logprob <= 0 for entry in entries)
        assert "".join(entry.token for entry in entries) == choice.message.content
    assert many.usage.completion_tokens == sum(len(choice.logprobs.content) for choice in many.choices)
    again = client.chat.completions.create(model=MODEL, messages=hi, n=3, temperature=1.0, seed=5, max_tokens=12,
                                           extra_body=NO_THINKING)
    assert [c.message.content for c in again.choices] == [c.message.content for c in many.choices]
    stream = list(client.chat.completions.create(model=MODEL, messages=hi, n=2, temperature=1.0, seed=5,
                                                 max_tokens=12, logprobs=True, stream=True,
                                                 stream_options={"include_usage": True}, extra_body=NO_THINKING))
    assert [(c.choices[0].index, c.choices[0].delta.role) for c in stream[:2]] == [(0, "assistant"), (1, "assistant")]
    texts = {0: "", 1: ""}
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.delta.content or ""
            if choice.delta.content:
                assert choice.logprobs.content
    assert texts == {c.index: c.message.content for c in many.choices[:2]}
    assert stream[-1].usage.completion_tokens == sum(len(c.logprobs.content) for c in many.choices[:2])


def test_completions_of_text_and_token_id_prompts(stack, client):
    whole = client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, logprobs=2)
    [choice] = whole.choices
    assert whole.object == "text_completion" and choice.finish_reason in ("length", "stop")
    assert "".join(choice.logprobs.tokens) == choice.text and len(choice.logprobs.top_logprobs[0]) == 2
    streamed = list(client.completions.create(model=MODEL, prompt="Hello", max_tokens=8, temperature=0, stream=True,
                                              stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in streamed if c.choices) == choice.text
    assert streamed[-1].usage.completion_tokens == whole.usage.completion_tokens
    ids = client.completions.create(model=MODEL, prompt=[1, 2, 3, 4], max_tokens=4, temperature=0)
    assert ids.usage.prompt_tokens == 4 and ids.choices[0].finish_reason


def test_several_prompts_with_n_choices_each_and_echo(stack, client):
    """As vLLM answers it: one choice list, prompt 0's n choices first; echo puts each prompt's
    text (a token-id prompt decoded, special tokens kept) before its choices' texts."""
    addresses, _ = stack
    prompts, n = ["Hello", [1, 2, 3, 4]], 2
    alone = [client.completions.create(model=MODEL, prompt=prompt, max_tokens=6, temperature=0) for prompt in prompts]
    both = client.completions.create(model=MODEL, prompt=prompts, n=n, max_tokens=6, temperature=0, echo=True)
    decoded = _detokenized(addresses, prompts[1])
    echoed = [prompts[0] + alone[0].choices[0].text] * n + [decoded + alone[1].choices[0].text] * n
    assert [choice.index for choice in both.choices] == [0, 1, 2, 3]
    assert [choice.text for choice in both.choices] == echoed
    assert both.usage.prompt_tokens == sum(answer.usage.prompt_tokens for answer in alone)
    assert both.usage.completion_tokens == n * sum(answer.usage.completion_tokens for answer in alone)
    streamed = list(client.completions.create(model=MODEL, prompt=prompts, n=n, max_tokens=6, temperature=0,
                                              echo=True, stream=True, stream_options={"include_usage": True}))
    texts = {index: "" for index in range(4)}
    for chunk in streamed:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert [texts[index] for index in range(4)] == echoed
    assert streamed[-1].usage.total_tokens == both.usage.total_tokens


def test_continuous_usage_stats_put_usage_on_every_chunk(client):
    """vLLM's stream_options.continuous_usage_stats: each chunk counts the prompt and its choice's
    tokens so far; the role chunks come first (no token yet), the usage chunk last."""
    options = {"include_usage": True, "continuous_usage_stats": True}
    hi = [{"role": "user", "content": "Hello! What can you do?"}]
    chat = list(client.chat.completions.create(model=MODEL, messages=hi, n=2, max_tokens=12, temperature=0,
                                               stream=True, stream_options=options, extra_body=NO_THINKING))
    assert all(chunk.usage is not None for chunk in chat)
    *chunks, last = chat
    assert [(c.choices[0].delta.role, c.usage.completion_tokens) for c in chunks[:2]] == [("assistant", 0)] * 2
    per_choice = {0: 0, 1: 0}
    for chunk in chunks:
        assert chunk.usage.prompt_tokens == last.usage.prompt_tokens
        assert chunk.usage.completion_tokens >= per_choice[chunk.choices[0].index]  # counts only grow
        per_choice[chunk.choices[0].index] = chunk.usage.completion_tokens
    assert last.choices == [] and sum(per_choice.values()) == last.usage.completion_tokens
    prompts = list(client.completions.create(model=MODEL, prompt=["Hello", "Hi there"], max_tokens=4, temperature=0,
                                             stream=True, stream_options=options))
    finals = {c.choices[0].index: c.usage for c in prompts if c.choices and c.choices[0].finish_reason}
    assert sorted(finals) == [0, 1] and finals[0].prompt_tokens != finals[1].prompt_tokens  # each prompt's own
    assert sum(u.prompt_tokens for u in finals.values()) == prompts[-1].usage.prompt_tokens


def _detokenized(addresses, token_ids: list[int]) -> str:
    import grpc

    from tito.v1 import derender_pb2, derender_pb2_grpc

    with grpc.insecure_channel(addresses["derender"]) as channel:
        return derender_pb2_grpc.DerenderServiceStub(channel).Detokenize(derender_pb2.DetokenizeRequest(
            token_ids=token_ids, skip_special_tokens=False), timeout=10).text


def test_logit_bias_forces_a_token_on_chats_and_completions_and_out_of_vocabulary_is_a_400(client, demo_model):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_model)
    forced = tokenizer.encode(" Paris", add_special_tokens=False)[0]
    expected = tokenizer.decode([forced] * 4)
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                          temperature=0, logit_bias={str(forced): 100}, extra_body=NO_THINKING)
    assert chat.choices[0].message.content == expected and chat.choices[0].finish_reason == "length"
    completion = client.completions.create(model=MODEL, prompt="Hello", max_tokens=4, temperature=0,
                                           logit_bias={str(forced): 100})
    assert completion.choices[0].text == expected
    with pytest.raises(openai.BadRequestError) as info:
        client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                       logit_bias={"1000000000": 5})
    assert (info.value.code, info.value.param) == ("INVALID_SAMPLING_PARAMS", "logit_bias[1000000000]")


def _engine_load(addresses) -> engine_pb2.GetLoadResponse:
    import grpc

    from tito.v1 import engine_pb2_grpc

    with grpc.insecure_channel(addresses["engine"]) as channel:
        return engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)


def _wait_for_idle_engine(addresses, timeout: float = 60.0) -> engine_pb2.GetLoadResponse:
    import time

    deadline = time.monotonic() + timeout
    load = _engine_load(addresses)
    while (load.running_requests or load.waiting_requests) and time.monotonic() < deadline:
        time.sleep(0.1)
        load = _engine_load(addresses)
    return load


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_that_disconnects_aborts_the_engine_request(stack, stream):
    addresses, base = stack
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1500,
            "ignore_eos": True, "stream": stream}
    with httpx.Client(base_url=base, timeout=60) as http:
        if stream:
            with http.stream("POST", "/v1/chat/completions", json=body) as reply:
                assert reply.status_code == 200
                lines = reply.iter_lines()
                assert next(line for line in lines if line.startswith("data: "))
                assert _engine_load(addresses).running_requests == 1  # still generating
        else:
            import threading
            thread = threading.Thread(target=lambda: _post_and_drop(base, body), daemon=True)
            thread.start()
            thread.join(timeout=60)
    load = _wait_for_idle_engine(addresses)
    assert (load.running_requests, load.waiting_requests) == (0, 0)


def _post_and_drop(base: str, body: dict) -> None:
    """POST `body`, wait until the engine runs it, then close the connection without reading."""
    import socket
    import time
    from urllib.parse import urlsplit

    url = urlsplit(base)
    payload = json.dumps(body).encode()
    with socket.create_connection((url.hostname, url.port)) as sock:
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(payload) + payload)
        time.sleep(1.0)


def test_the_request_id_reaches_the_engine(stack):
    """The x-request-id header is the id render, engine and derender see: aborting it at the engine by
    that id ends the stream with finish_reason "abort"."""
    import grpc

    from tito.v1 import engine_pb2_grpc

    addresses, base = stack
    body = {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1500,
            "ignore_eos": True, "stream": True}
    with httpx.Client(base_url=base, timeout=60) as http:
        with http.stream("POST", "/v1/chat/completions", json=body, headers={"x-request-id": "gw-test-42"}) as reply:
            assert reply.headers["x-request-id"] == "gw-test-42"
            lines = reply.iter_lines()
            first = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert first["id"] == "chatcmpl-gw-test-42"
            again = http.post("/v1/chat/completions", json={**body, "stream": False},
                              headers={"x-request-id": "gw-test-42"})  # the id is in use: a conflict
            assert again.status_code == 409, again.text
            assert (again.json()["error"]["code"], again.json()["error"]["param"]) == ("DUPLICATE_REQUEST_ID",
                                                                                       "x-request-id")
            with grpc.insecure_channel(addresses["engine"]) as channel:
                aborted = engine_pb2_grpc.EngineServiceStub(channel).Abort(
                    engine_pb2.AbortRequest(request_ids=["gw-test-42"]), timeout=10)
            assert list(aborted.aborted_request_ids) == ["gw-test-42"]
            events = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
    assert events[-1]["choices"][0]["finish_reason"] == "abort"
    with httpx.Client(base_url=base, timeout=60) as http:
        reply = http.post("/v1/chat/completions", json=body, headers={"x-request-id": "not valid!"})
    assert reply.status_code == 400 and reply.json()["error"]["param"] == "x-request-id"


# -- a secured gateway: TLS, a bearer token, a small body bound -------------------------------------

TOKEN = "gateway-test-token-0123456789"


def _self_signed(root) -> tuple[str, str]:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(__import__("ipaddress").ip_address("127.0.0.1"))]),
                           critical=False)
            .sign(key, hashes.SHA256()))
    (root / "cert.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    (root / "key.pem").write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                     serialization.NoEncryption()))
    return str(root / "cert.pem"), str(root / "key.pem")


@pytest.fixture(scope="module")
def secured(stack, tmp_path_factory):
    addresses, _ = stack
    root = tmp_path_factory.mktemp("gateway-tls")
    cert, key = _self_signed(root)
    (root / "token").write_text(TOKEN + "\n")
    args = ["--served-model-name", MODEL, "--tls-cert-file", cert, "--tls-key-file", key,
            "--auth-token-file", str(root / "token"), "--max-body-bytes", "65536"]
    with running_gateway(addresses, args, scheme="https", verify=cert) as (base, _):
        yield base, cert


def test_tls_and_the_bearer_token(secured):
    base, cert = secured
    hi = [{"role": "user", "content": "Hi"}]
    with openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0,
                       http_client=httpx.Client(verify=cert)) as sdk:
        assert sdk.chat.completions.create(model=MODEL, messages=hi, max_tokens=4).choices[0].finish_reason
    for key, code in (("wrong-token-wrong-token", "AUTH_TOKEN_INVALID"),):
        with openai.OpenAI(base_url=f"{base}/v1", api_key=key, max_retries=0,
                           http_client=httpx.Client(verify=cert)) as sdk:
            with pytest.raises(openai.AuthenticationError) as info:
                sdk.chat.completions.create(model=MODEL, messages=hi, max_tokens=4)
            assert info.value.status_code == 401 and info.value.code == code
    missing = httpx.post(f"{base}/v1/chat/completions", json={"model": MODEL, "messages": hi}, verify=cert)
    assert missing.status_code == 401 and missing.json()["error"]["code"] == "AUTH_TOKEN_MISSING"
    assert httpx.get(f"{base}/health", verify=cert).status_code == 200  # probes need no token
    with pytest.raises((httpx.ConnectError, httpx.RemoteProtocolError)):  # TLS only
        httpx.get(base.replace("https:", "http:") + "/health", timeout=5)


def test_a_body_over_the_bound_is_a_413(secured):
    base, cert = secured
    with openai.OpenAI(base_url=f"{base}/v1", api_key=TOKEN, max_retries=0,
                       http_client=httpx.Client(verify=cert)) as sdk:
        with pytest.raises(openai.APIStatusError) as info:
            sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x" * 70000}])
        assert info.value.status_code == 413 and info.value.code == "REQUEST_BODY_TOO_LARGE"
        assert sdk.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}],
                                           max_tokens=4).choices[0].finish_reason
