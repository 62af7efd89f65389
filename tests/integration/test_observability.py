"""Metrics and tracing through the three real servers: one image chat through render, engine and
derender (ChatPipeline), then each server's /metrics over HTTP, and the spans of that chat; a
gateway's chats, whichever path vLLM's extras send them down (echo, forwarded prompt ids, a
prefill/decode part), each one trace under the span a plain chat has.

Tracing is on for this module with an in-memory exporter (tito.tracing.use_provider); each server
serves /metrics on a free port (metrics_port=0).
"""

from __future__ import annotations

import time

import grpc
import httpx
import pytest
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from transformers import AutoTokenizer

from tito import tracing
from tito_client.pipeline import ChatPipeline, Endpoints
from tito.v1 import chat_pb2, derender_pb2, derender_pb2_grpc, engine_pb2, render_pb2, render_pb2_grpc
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.config import EngineConfig
from tito_engine.server import create_server as create_engine
from tito_gateway.config import GatewayConfig
from tito_gateway.server import create_server as create_gateway
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

from gateway_servers import StoppableGateway
from images import noise_png
from metrics_scrape import scrape

TIMEOUT = 60


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracing.use_provider(provider)
    yield exporter
    tracing.shutdown()
    provider.shutdown()


@pytest.fixture(scope="module")
def servers(spans, tiny_vl_model, module_aio_server):
    model = str(tiny_vl_model)
    render = module_aio_server(lambda: create_render(RenderConfig(address="127.0.0.1:0", model=model,
                                                                  metrics_port=0)))
    engine = module_aio_server(lambda: create_engine(EngineConfig(
        address="127.0.0.1:0", model=model, device="cpu", engine_process=False, kv_blocks=64, metrics_port=0)))
    derender = module_aio_server(lambda: create_derender(DerenderConfig(address="127.0.0.1:0", model=model,
                                                                        metrics_port=0)))
    return {"render": render, "engine": engine, "derender": derender}


@pytest.fixture(scope="module")
def one_chat(servers, spans):
    """One chat with an image, streamed through the three services; returns its chunks."""
    request = render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=[
            chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=noise_png(32, 32))),
            chat_pb2.ContentPart(text="What is in this picture?")])],
        sampling=render_pb2.SamplingOptions(max_tokens=6, min_tokens=6, temperature=0.0))
    endpoints = Endpoints(servers["render"].address, servers["engine"].address, servers["derender"].address)
    with ChatPipeline(endpoints, timeout=TIMEOUT) as pipeline:
        return list(pipeline.stream_chat(request))


def scrape_after(server, method: str, code: str = "OK", count: int = 1) -> dict[tuple[str, tuple], float]:
    """Scrape once the server has counted `count` calls of `method` ending with `code`. A client
    has its status a moment before the server's interceptor records it (the last thing recorded
    for a call, after the service's own series), so a scrape right after a call may miss it."""
    key = ("tito_grpc_requests_total", (("code", code), ("method", method)))
    deadline = time.monotonic() + 10
    while True:
        samples = scrape(server)
        if samples.get(key, 0) >= count or time.monotonic() > deadline:
            return samples
        time.sleep(0.02)


def value(samples, name: str, **labels) -> float:
    key = (name, tuple(sorted(labels.items())))
    assert key in samples, f"{name}{labels} missing; have {sorted(k for k in samples if k[0].startswith(name))}"
    return samples[key]


def test_each_service_exposes_its_series_after_one_chat(servers, one_chat, tiny_vl_model):
    assert one_chat[-1].finish_reason
    # A scripted engine output through derender, as a stream and as one DerenderFull call: reasoning,
    # one tool call, one malformed call.
    tokenizer = AutoTokenizer.from_pretrained(tiny_vl_model)
    reply = ('<think>\nchecking\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
             '\n</tool_call>\n<tool_call>\n{"name": broken</tool_call>')
    ids = tokenizer.encode(reply, add_special_tokens=False)
    tool = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(name="get_weather"))
    context = derender_pb2.DerenderContext(request_id="scripted", tool_parser="hermes", reasoning_parser="qwen3",
                                           thinking_enabled=True, n=1, tools=[tool],
                                           tool_choice=chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_AUTO))
    requests = [derender_pb2.DerenderRequest(context=context),
                derender_pb2.DerenderRequest(generate_response=engine_pb2.GenerateResponse(
                    token_ids=ids, finish_reason=engine_pb2.FINISH_REASON_STOP))]
    with servers["derender"].channel() as channel:
        stub = derender_pb2_grpc.DerenderServiceStub(channel)
        list(stub.Derender(iter(requests), timeout=TIMEOUT))
        full = stub.DerenderFull(derender_pb2.DerenderFullRequest(
            context=context, responses=[requests[1].generate_response]), timeout=TIMEOUT)
    assert full.choices[0].message.tool_calls and full.choices[0].message.reasoning_content

    render = scrape_after(servers["render"], "/tito.v1.RenderService/RenderChat")
    assert value(render, "tito_grpc_requests_total", method="/tito.v1.RenderService/RenderChat", code="OK") == 1
    assert value(render, "tito_render_duration_seconds_count", kind="chat") == 1
    assert value(render, "tito_render_duration_seconds_count", kind="tokenize") == 0
    assert value(render, "tito_render_prompt_tokens_total", kind="chat") > 0
    assert value(render, "tito_render_media_processing_seconds_count", modality="image") == 1
    assert value(render, "tito_render_media_items_total", modality="image") == 1

    engine = scrape_after(servers["engine"], "/tito.v1.EngineService/Generate")
    assert value(engine, "tito_grpc_requests_total", method="/tito.v1.EngineService/Generate", code="OK") == 1
    for histogram in ("queue_time", "time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert value(engine, f"tito_engine_{histogram}_seconds_count") == 1, histogram
    assert value(engine, "tito_engine_prompt_tokens_total") > 0
    assert value(engine, "tito_engine_generation_tokens_total") == 6
    assert value(engine, "tito_engine_requests_finished_total", finish_reason="length") == 1
    assert value(engine, "tito_engine_prefix_cache_queries_total") > 0
    assert value(engine, "tito_engine_prefix_cache_hits_total") == 0
    assert value(engine, "tito_engine_kv_blocks_total") == 64
    assert value(engine, "tito_engine_kv_blocks_used") == 0  # idle again
    assert value(engine, "tito_engine_requests_running") == 0
    assert value(engine, "tito_engine_requests_waiting") == 0
    assert value(engine, "tito_engine_encoder_cache_misses_total") == 1
    assert value(engine, "tito_engine_encoder_cache_hits_total") == 0

    scrape_after(servers["derender"], "/tito.v1.DerenderService/Derender", count=2)
    derender = scrape_after(servers["derender"], "/tito.v1.DerenderService/DerenderFull")
    assert value(derender, "tito_grpc_requests_total", method="/tito.v1.DerenderService/Derender", code="OK") == 2
    assert value(derender, "tito_derender_streams_total") == 2
    assert value(derender, "tito_derender_chunks_total") >= len(one_chat) + 1
    assert value(derender, "tito_derender_completion_tokens_total") == 6 + 2 * len(ids)
    assert value(derender, "tito_derender_choices_finished_total", finish_reason="length") == 1
    assert value(derender, "tito_derender_streams_active") == 0
    for outcome, parser in (("tool_call", "hermes"), ("malformed_to_content", "hermes"), ("reasoning_split", "qwen3")):
        assert value(derender, "tito_derender_parser_outcomes_total", parser=parser, outcome=outcome) == 2, outcome


def test_health_checks_are_counted_but_not_traced(servers, spans):
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    with servers["engine"].channel() as channel:
        reply = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert reply.status == health_pb2.HealthCheckResponse.SERVING
    assert value(scrape_after(servers["engine"], "/grpc.health.v1.Health/Check"), "tito_grpc_requests_total",
                 method="/grpc.health.v1.Health/Check", code="OK") >= 1
    assert not [span for span in spans.get_finished_spans() if "Health" in span.name]


def test_refused_calls_are_counted_by_status_code(servers):
    with servers["render"].channel() as channel:
        with pytest.raises(grpc.RpcError) as refused:
            render_pb2_grpc.RenderServiceStub(channel).RenderChat(render_pb2.RenderChatRequest(), timeout=TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    render = scrape_after(servers["render"], "/tito.v1.RenderService/RenderChat", "INVALID_ARGUMENT")
    assert value(render, "tito_grpc_requests_total", method="/tito.v1.RenderService/RenderChat",
                 code="INVALID_ARGUMENT") == 1
    assert value(render, "tito_grpc_request_duration_seconds_count",
                 method="/tito.v1.RenderService/RenderChat") >= 2


def _wait_for(spans, names: set[str], trace_id: int) -> list:
    deadline = time.monotonic() + 10
    while True:  # servers end their spans just after the client has its last message
        found = [span for span in spans.get_finished_spans() if span.context.trace_id == trace_id]
        if names <= {span.name for span in found} or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def test_one_chat_is_one_trace_across_the_three_services(spans, one_chat):
    chat = [span for span in spans.get_finished_spans() if span.name == "chat"]
    assert len(chat) == 1
    expected = {"chat", "tito.v1.RenderService/RenderChat", "render.template", "render.media", "render.tokenize",
                "tito.v1.EngineService/Generate", "engine.queue", "engine.prefill", "engine.decode",
                "tito.v1.DerenderService/Derender"}
    found = _wait_for(spans, expected, chat[0].context.trace_id)
    by_name = {span.name: span for span in found}
    assert expected <= set(by_name), sorted(by_name)
    root = chat[0].context.span_id
    for rpc in ("RenderService/RenderChat", "EngineService/Generate", "DerenderService/Derender"):
        assert by_name[f"tito.v1.{rpc}"].parent.span_id == root, rpc
    render_rpc = by_name["tito.v1.RenderService/RenderChat"].context.span_id
    assert {by_name[name].parent.span_id for name in ("render.template", "render.media", "render.tokenize")} == {
        render_rpc}
    generate = by_name["tito.v1.EngineService/Generate"]
    phases = [by_name[name] for name in ("engine.queue", "engine.prefill", "engine.decode")]
    assert {span.parent.span_id for span in phases} == {generate.context.span_id}
    assert phases[0].end_time <= phases[1].start_time + 1_000 and phases[1].end_time <= phases[2].start_time + 1_000
    assert generate.start_time <= phases[0].start_time + 5_000_000  # within 5 ms: the same clock
    assert generate.attributes["rpc.grpc.status_code"] == "OK"


def test_a_refused_token_is_counted_and_later_calls_still_are(aio_server, tiny_text_model, tmp_path):
    """Authentication refuses before the handler runs; the interceptor still sees UNAUTHENTICATED,
    and the calls that follow (another handler object for the same method) are counted too."""
    token = tmp_path / "token"
    token.write_text("a-token-long-enough-for-tito-0123456789\n")
    server = aio_server(lambda: create_derender(DerenderConfig(
        address="127.0.0.1:0", model=str(tiny_text_model), auth_token_file=str(token), metrics_port=0)))
    detokenize = derender_pb2.DetokenizeRequest(token_ids=[5, 6])
    with server.channel() as channel:
        stub = derender_pb2_grpc.DerenderServiceStub(channel)
        with pytest.raises(grpc.RpcError) as refused:
            stub.Detokenize(detokenize, timeout=TIMEOUT)
        assert refused.value.code() == grpc.StatusCode.UNAUTHENTICATED
        bearer = (("authorization", "Bearer a-token-long-enough-for-tito-0123456789"),)
        for _ in range(2):
            stub.Detokenize(detokenize, timeout=TIMEOUT, metadata=bearer)
        with pytest.raises(grpc.RpcError):
            stub.Detokenize(detokenize, timeout=TIMEOUT)
    method = "/tito.v1.DerenderService/Detokenize"
    scrape_after(server, method, "OK", 2)
    samples = scrape_after(server, method, "UNAUTHENTICATED", 2)
    assert value(samples, "tito_grpc_requests_total", method=method, code="UNAUTHENTICATED") == 2
    assert value(samples, "tito_grpc_requests_total", method=method, code="OK") == 2


# -- the gateway: vLLM's chat extras take their own path to the engine, traced as a plain chat --

GATEWAY_CHAT = {"model": "tiny", "max_tokens": 2, "temperature": 0,
                "messages": [{"role": "user", "content": "Hello there"}]}
#: llm-d's prefill call (the prefill/decode keys of `kv_transfer_params`).
PREFILL_PARAMS = {"do_remote_decode": True, "do_remote_prefill": False, "remote_engine_id": None,
                  "remote_block_ids": None, "remote_host": None, "remote_port": None}
#: A chat's own calls (the gateway's derender calls carry many chats at once: DerenderBatch).
RPCS = ("tito.v1.RenderService/RenderChat", "tito.v1.EngineService/Generate")


@pytest.fixture(scope="module")
def gateway(servers, module_aio_server) -> str:
    async def start():
        return StoppableGateway(await create_gateway(GatewayConfig(
            address="127.0.0.1:0", render_address=servers["render"].address, engine_address=servers["engine"].address,
            derender_address=servers["derender"].address, served_model_name="tiny")))

    return f"http://{module_aio_server(start).address}"


def _chat_trace(spans, gateway: str, body: dict, request_id: str, path: str = "chat/completions",
                span_name: str = "chat") -> tuple:
    """The one `span_name` span of the request `body` sent to `path` as `request_id`, and its
    trace's spans by name."""
    reply = httpx.post(f"{gateway}/v1/{path}", json=body, headers={"x-request-id": request_id}, timeout=TIMEOUT)
    assert reply.status_code == 200 and "error" not in reply.text, reply.text
    deadline = time.monotonic() + 10
    while not (chats := [span for span in spans.get_finished_spans() if span.name == span_name
                         and span.attributes.get("tito.request_id") == request_id]) and time.monotonic() < deadline:
        time.sleep(0.05)  # a stream's span ends just after its last event is sent
    assert len(chats) == 1, [span.name for span in spans.get_finished_spans()]
    found = _wait_for(spans, set(RPCS[1:]), chats[0].context.trace_id)
    return chats[0], {span.name: span for span in found}


@pytest.mark.parametrize("stream", [False, True])
def test_a_gateway_chat_is_one_trace_on_every_path_vllms_extras_take(gateway, spans, stream):
    plain, plain_spans = _chat_trace(spans, gateway, {**GATEWAY_CHAT, "stream": stream}, f"plain-{stream}")
    assert set(RPCS) <= set(plain_spans)
    rendered = httpx.post(f"{gateway}/v1/chat/completions/render", json=GATEWAY_CHAT, timeout=TIMEOUT).json()
    paths = {
        "echo": ({**GATEWAY_CHAT, "echo": True, "messages": [*GATEWAY_CHAT["messages"],
                                                            {"role": "assistant", "content": "Hi"}]}, RPCS),
        # the render endpoint's answer is kept: no render call
        "reuse": ({**GATEWAY_CHAT, "kv_transfer_params": {"prompt_token_ids": rendered["token_ids"]}}, RPCS[1:]),
        "prefill": ({**GATEWAY_CHAT, "max_tokens": 1, "kv_transfer_params": PREFILL_PARAMS}, RPCS),
    }
    for name, (body, rpcs) in paths.items():
        request_id = f"{name}-{stream}"
        chat, by_name = _chat_trace(spans, gateway, {**body, "stream": stream}, request_id)
        assert chat.kind == plain.kind and dict(chat.attributes) == {"tito.request_id": request_id}, name
        assert set(plain.attributes) == set(chat.attributes)
        assert {rpc for rpc in RPCS if rpc in by_name} == set(rpcs), (name, sorted(by_name))
        for rpc in rpcs:
            assert by_name[rpc].parent.span_id == chat.context.span_id, (name, rpc)


def test_a_prefill_completion_is_traced_as_a_plain_completion(gateway, spans):
    body = {"model": "tiny", "prompt": "Hello there", "max_tokens": 1, "temperature": 0}
    plain, _ = _chat_trace(spans, gateway, body, "completion-plain", "completions", "completion")
    part, by_name = _chat_trace(spans, gateway, {**body, "kv_transfer_params": PREFILL_PARAMS}, "completion-prefill",
                                "completions", "completion")
    assert set(part.attributes) == set(plain.attributes) and part.attributes["tito.request_id"] == "completion-prefill"
    for rpc in ("tito.v1.RenderService/RenderCompletion", "tito.v1.EngineService/Generate"):
        assert by_name[rpc].parent.span_id == part.context.span_id, rpc
