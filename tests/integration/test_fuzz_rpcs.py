"""Fuzzing every RPC of the three services with hostile requests (fuzz_requests.py).

Per service, TITO_FUZZ_CASES cases (default 2000) spread over its RPCs, half byte-level (mutated
serialized requests, sent raw) and half field-level (boundary and hostile values in any field,
Structs included). Every answer must be OK or a documented caller error: never UNKNOWN or
INTERNAL (a bug), never a hang; afterwards each service answers a good request and the engine
holds nothing. More on demand: `TITO_FUZZ_CASES=20000 bash scripts/test.sh tests/integration/test_fuzz_rpcs.py`.
A failing case prints its method, kind and seed, which reproduce it.
"""

from __future__ import annotations

import base64
import os
import random
from collections import Counter

import grpc
import pytest
from google.protobuf import struct_pb2

from fuzz_requests import byte_cases, field_cases
from images import solid_png
from tito.grpc_errors import error_details
from tito.v1 import (chat_pb2, derender_pb2, engine_pb2, engine_pb2_grpc, render_pb2,
                     render_pb2_grpc)
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.config import EngineConfig
from tito_engine.server import create_server as create_engine
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

CASES_PER_SERVICE = int(os.environ.get("TITO_FUZZ_CASES", "2000"))
TIMEOUT = 30
BUGS = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)


@pytest.fixture(scope="module")
def servers(module_aio_server, tiny_vl_model):
    model = str(tiny_vl_model)
    return {
        "render": module_aio_server(lambda: create_render(RenderConfig(model=model))),
        # A short context keeps every generation the fuzzer starts short.
        "engine": module_aio_server(lambda: create_engine(EngineConfig(model=model, device="cpu", max_model_len=512,
                                                                       engine_process=False))),
        "derender": module_aio_server(lambda: create_derender(DerenderConfig(model=model))),
    }


def _seed_chat() -> render_pb2.RenderChatRequest:
    arguments = struct_pb2.Struct()
    arguments.update({"city": "Paris"})
    parameters = struct_pb2.Struct()
    parameters.update({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]})
    kwargs = struct_pb2.Struct()
    kwargs.update({"enable_thinking": False})
    return render_pb2.RenderChatRequest(
        request_id="fuzz",
        messages=[
            chat_pb2.ChatMessage(role="system", content="Be brief."),
            chat_pb2.ChatMessage(role="user", content_parts=[
                chat_pb2.ContentPart(text="What colour, and the weather in Paris?"),
                chat_pb2.ContentPart(image=chat_pb2.ImageSource(
                    url="data:image/png;base64," + base64.b64encode(solid_png(64, 48, (200, 30, 30))).decode()))]),
            chat_pb2.ChatMessage(role="assistant", tool_calls=[chat_pb2.ToolCall(
                id="call_1", type="function",
                function=chat_pb2.FunctionCall(name="get_weather", arguments_object=arguments))]),
            chat_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="sunny"),
        ],
        tools=[chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
            name="get_weather", description="Weather in a city", parameters=parameters))],
        tool_choice=chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_AUTO),
        chat_template_kwargs=kwargs,
        sampling=render_pb2.SamplingOptions(max_tokens=6, temperature=0.7, stop=["\n"], seed=3),
    )


@pytest.fixture(scope="module")
def seeds(servers):
    """One valid request per RPC, built from real answers (features and streams included)."""
    with servers["render"].channel() as channel:
        rendered = render_pb2_grpc.RenderServiceStub(channel).RenderChat(_seed_chat(), timeout=TIMEOUT)
    with servers["engine"].channel() as channel:
        generate = engine_pb2.GenerateRequest()
        generate.CopyFrom(rendered.generate_request)
        responses = list(engine_pb2_grpc.EngineServiceStub(channel).Generate(generate, timeout=TIMEOUT))
    stream = [derender_pb2.DerenderRequest(context=rendered.derender_context)] + \
        [derender_pb2.DerenderRequest(generate_response=r) for r in responses]
    # Two requests' streams over one DerenderBatch call, a message per engine step.
    entry = derender_pb2.DerenderBatchEntry
    batch = [derender_pb2.DerenderBatchRequest(entries=[entry(stream_id=sid, context=rendered.derender_context)
                                                        for sid in (1, 2)])] + \
        [derender_pb2.DerenderBatchRequest(entries=[entry(stream_id=sid, generate_response=r) for sid in (1, 2)])
         for r in responses]
    return {
        "/tito.v1.RenderService/RenderChat": _seed_chat(),
        "/tito.v1.RenderService/RenderCompletion": render_pb2.RenderCompletionRequest(
            prompt="Hello there", sampling=render_pb2.SamplingOptions(max_tokens=4)),
        "/tito.v1.RenderService/Tokenize": render_pb2.TokenizeRequest(text="Hello world", return_token_strings=True),
        "/tito.v1.RenderService/GetModelInfo": render_pb2.RenderServiceGetModelInfoRequest(),
        "/tito.v1.EngineService/Generate": generate,
        "/tito.v1.EngineService/Encode": engine_pb2.EncodeRequest(mm_features=generate.mm_features),
        "/tito.v1.EngineService/Abort": engine_pb2.AbortRequest(request_ids=["fuzz", "other"]),
        "/tito.v1.EngineService/GetModelInfo": engine_pb2.EngineServiceGetModelInfoRequest(),
        "/tito.v1.EngineService/GetLoad": engine_pb2.GetLoadRequest(),
        "/tito.v1.DerenderService/Derender": stream,
        "/tito.v1.DerenderService/DerenderBatch": batch,
        "/tito.v1.DerenderService/DerenderFull": derender_pb2.DerenderFullRequest(
            context=rendered.derender_context, responses=responses),
        "/tito.v1.DerenderService/Detokenize": derender_pb2.DetokenizeRequest(token_ids=list(generate.token_ids[:20])),
    }


SERVICES = {
    "render": ["/tito.v1.RenderService/RenderChat", "/tito.v1.RenderService/RenderCompletion",
               "/tito.v1.RenderService/Tokenize", "/tito.v1.RenderService/GetModelInfo"],
    "engine": ["/tito.v1.EngineService/Generate", "/tito.v1.EngineService/Encode", "/tito.v1.EngineService/Abort",
               "/tito.v1.EngineService/GetModelInfo", "/tito.v1.EngineService/GetLoad"],
    "derender": ["/tito.v1.DerenderService/Derender", "/tito.v1.DerenderService/DerenderFull",
                 "/tito.v1.DerenderService/Detokenize", "/tito.v1.DerenderService/DerenderBatch"],
}
STREAMING_RESPONSE = {"/tito.v1.EngineService/Generate"}
BIDI = {"/tito.v1.DerenderService/Derender", "/tito.v1.DerenderService/DerenderBatch"}
#: Calls whose streams end by error inside the responses (a status per stream), not the call's.
BATCH = "/tito.v1.DerenderService/DerenderBatch"
BUG_CODES = {code.value[0] for code in BUGS}  # as google.rpc.Status numbers them


def _call(channel: grpc.Channel, method: str, payload) -> grpc.StatusCode:
    """Send raw request bytes (a list of them for the bidi stream); the status code answered."""
    try:
        if method == BATCH:
            for raw in channel.stream_stream(method)(iter(payload), timeout=TIMEOUT):
                for result in derender_pb2.DerenderBatchResponse.FromString(raw).results:
                    if result.HasField("error") and result.error.code in BUG_CODES:
                        raise AssertionError(f"stream {result.stream_id}: {result.error}")
        elif method in BIDI:
            list(channel.stream_stream(method)(iter(payload), timeout=TIMEOUT))
        elif method in STREAMING_RESPONSE:
            list(channel.unary_stream(method)(payload, timeout=TIMEOUT))
        else:
            channel.unary_unary(method)(payload, timeout=TIMEOUT)
    except grpc.RpcError as exc:
        if exc.code() in BUGS:
            raise AssertionError(f"{exc.code()}: {error_details(exc)}") from exc
        return exc.code()
    return grpc.StatusCode.OK


def _case(seed, kind: str, rng: random.Random):
    """The bytes to send for one case (for the bidi stream: one mutated message among them)."""
    if isinstance(seed, list):
        messages = [m.SerializeToString() for m in seed]
        position = rng.randrange(len(seed))
        messages[position] = byte_cases(messages[position], rng) if kind == "bytes" else \
            field_cases(seed[position], rng).SerializeToString()
        return messages
    return byte_cases(seed.SerializeToString(), rng) if kind == "bytes" else field_cases(seed, rng).SerializeToString()


@pytest.mark.parametrize("service", SERVICES)
def test_fuzzed_requests_never_break_a_service(servers, seeds, service):
    methods = SERVICES[service]
    outcomes: Counter = Counter()
    with servers[service].channel() as channel:
        for case in range(CASES_PER_SERVICE):
            method = methods[case % len(methods)]
            kind = "bytes" if (case // len(methods)) % 2 else "fields"
            rng = random.Random(f"{service}-{case}")
            payload = _case(seeds[method], kind, rng)
            try:
                code = _call(channel, method, payload)
            except AssertionError as exc:
                raise AssertionError(f"case {case} ({method}, {kind}, seed '{service}-{case}'): {exc}") from None
            outcomes[(method.rsplit("/", 1)[1], kind, code.name)] += 1
        print(f"\n{service}: {CASES_PER_SERVICE} fuzz cases: " +
              ", ".join(f"{m} {k} {c}={n}" for (m, k, c), n in sorted(outcomes.items())))
        # Still fully working, and nothing left behind.
        assert _call(channel, methods[0], _good(seeds, methods[0])) == grpc.StatusCode.OK
        if service == "engine":
            load = engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
            assert (load.running_requests, load.waiting_requests) == (0, 0)


def _good(seeds, method):
    seed = seeds[method]
    return [m.SerializeToString() for m in seed] if isinstance(seed, list) else seed.SerializeToString()
