"""Fuzzing every RPC of the three services with hostile requests (fuzz_requests.py).

- The sweep, over every RPC the services' descriptors declare (one without a seed request fails,
  so a new RPC cannot go unfuzzed): for each field of each request, at any depth, the seed with
  that field alone cleared, zero or empty, or set to each extreme of its type (`field_sweep`).
  Exhaustive and deterministic: a failing case prints the field and the change. The media
  requests are swept unsigned, signed, and metadata-only with Encode's descriptors.
- Random cases: per service, TITO_FUZZ_CASES cases (default 1000: the sweep has every one-field
  case) spread over its RPCs but the endless streams, half byte-level (mutated serialized
  requests, sent raw) and half several random fields at once, Structs included. A failing case
  prints its method, kind and seed, which reproduce it. More on demand:
  `TITO_FUZZ_CASES=20000 bash scripts/test.sh tests/integration/test_fuzz_rpcs.py`.

Every answer must be OK or a documented caller error: never UNKNOWN or INTERNAL (a bug), never a
hang; afterwards each service answers a good request and the engine holds nothing.
"""

from __future__ import annotations

import base64
import os
import random
from collections import Counter
from collections.abc import Iterator

import grpc
import pytest
from google.protobuf import struct_pb2

from fuzz_requests import SweepCase, byte_cases, field_cases, field_sweep
from images import noise_png
from lora_adapters import q_proj_adapter, write_adapter
from tito.grpc_errors import error_details
from tito.v1 import (chat_pb2, derender_pb2, engine_pb2, engine_pb2_grpc, multimodal_pb2, render_pb2,
                     render_pb2_grpc)
from tito_client import LoraAdapters
from tito_client.kv_protocols import handle_of, prefill_request
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.config import EngineConfig
from tito_engine.server import create_server as create_engine
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

CASES_PER_SERVICE = int(os.environ.get("TITO_FUZZ_CASES", "1000"))
TIMEOUT = 30
BUGS = (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL, grpc.StatusCode.DEADLINE_EXCEEDED)


@pytest.fixture(scope="module")
def servers(module_aio_server, tiny_vl_model, tiny_text_model, tmp_path_factory):
    """Render signs media items and the engine verifies the tags present (unsigned items are
    served too) and shares an encoder store: the fuzz reaches the signature and store checks."""
    model = str(tiny_vl_model)
    key_file = tmp_path_factory.mktemp("fuzz-keys") / "hmac.key"
    key_file.write_bytes(b"fuzz-hmac-key-0123456789abcdef-0123456789\n")
    signing = {"hmac_key_file": str(key_file), "hmac_key_id": "fuzz"}
    store = str(tmp_path_factory.mktemp("fuzz-encoder-store"))
    lora_dir = tmp_path_factory.mktemp("fuzz-lora")  # one adapter, loaded at start as "fuzz"
    write_adapter(lora_dir / "adapter", *q_proj_adapter(64))
    return {
        "render": module_aio_server(lambda: create_render(RenderConfig(model=model, **signing))),
        # A short context keeps every generation the fuzzer starts short.
        "engine": module_aio_server(lambda: create_engine(EngineConfig(model=model, device="cpu", max_model_len=512,
                                                                       engine_process=False, encoder_store_dir=store,
                                                                       lora_dir=str(lora_dir),
                                                                       lora_modules=("fuzz=adapter",), **signing))),
        "derender": module_aio_server(lambda: create_derender(DerenderConfig(model=model))),
        "engine_drained": module_aio_server(lambda: create_engine(EngineConfig(
            model=str(tiny_text_model), device="cpu", max_model_len=512, engine_process=False))),
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
                    url="data:image/png;base64," + base64.b64encode(noise_png(64, 48, seed=0)).decode()))]),
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
def rendered(servers) -> render_pb2.RenderChatResponse:
    """The seed chat rendered, its media items signed."""
    with servers["render"].channel() as channel:
        return render_pb2_grpc.RenderServiceStub(channel).RenderChat(_seed_chat(), timeout=TIMEOUT)


@pytest.fixture(scope="module")
def seeds(servers, rendered):
    """One valid request per RPC, built from real answers (features and streams included). Its
    media items are unsigned: a changed field of a signed one fails its tag before the checks
    after it (`signed_seeds` has those)."""
    generate = _unsigned(rendered.generate_request)
    with servers["engine"].channel() as channel:
        engine = engine_pb2_grpc.EngineServiceStub(channel)
        responses = list(engine.Generate(generate, timeout=TIMEOUT))
        pull = _pull_request(engine, generate)
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
        "/tito.v1.EngineService/Encode": _encode_request(generate),
        "/tito.v1.EngineService/Abort": engine_pb2.AbortRequest(request_ids=["fuzz", "other"]),
        "/tito.v1.EngineService/GetModelInfo": engine_pb2.EngineServiceGetModelInfoRequest(),
        "/tito.v1.EngineService/GetLoad": engine_pb2.GetLoadRequest(),
        "/tito.v1.EngineService/SubscribeKvEvents": engine_pb2.SubscribeKvEventsRequest(start_sequence=0),
        "/tito.v1.EngineService/ResetPrefixCache": engine_pb2.ResetPrefixCacheRequest(),
        "/tito.v1.EngineService/Drain": engine_pb2.DrainRequest(grace_seconds=5.0),
        "/tito.v1.EngineService/LoadLoraAdapter": engine_pb2.LoadLoraAdapterRequest(lora_name="fuzz-2",
                                                                                     lora_path="adapter"),
        "/tito.v1.EngineService/UnloadLoraAdapter": engine_pb2.UnloadLoraAdapterRequest(lora_name="fuzz-2"),
        "/tito.v1.EngineService/ListLoraAdapters": engine_pb2.ListLoraAdaptersRequest(),
        "/tito.v1.EngineService/PullKvBlocks": pull,
        "/tito.v1.DerenderService/Derender": stream,
        "/tito.v1.DerenderService/DerenderBatch": batch,
        "/tito.v1.DerenderService/DerenderFull": derender_pb2.DerenderFullRequest(
            context=rendered.derender_context, responses=responses),
        "/tito.v1.DerenderService/Detokenize": derender_pb2.DetokenizeRequest(token_ids=list(generate.token_ids[:20])),
    }


@pytest.fixture(scope="module")
def signed_seeds(servers, rendered):
    """More seeds for the sweep: Generate and Encode with the media items render signed, and a
    metadata-only Generate carrying the descriptors Encode answered (the descriptor checks)."""
    chat = _seed_chat()
    chat.mm_payload = multimodal_pb2.MM_PAYLOAD_METADATA
    with servers["render"].channel() as channel:
        metadata_only = render_pb2_grpc.RenderServiceStub(channel).RenderChat(chat, timeout=TIMEOUT).generate_request
    with servers["engine"].channel() as channel:
        encoded = engine_pb2_grpc.EngineServiceStub(channel).Encode(_encode_request(rendered.generate_request),
                                                                   timeout=TIMEOUT)
    for item, descriptor in zip(metadata_only.mm_features.items, encoded.descriptors, strict=True):
        item.ec_descriptor.CopyFrom(descriptor)
    return {
        "/tito.v1.EngineService/Generate": [rendered.generate_request, metadata_only],
        "/tito.v1.EngineService/Encode": [_encode_request(rendered.generate_request)],
    }


def _pull_request(engine, generate: engine_pb2.GenerateRequest) -> engine_pb2.PullKvBlocksRequest:
    """A pull with a real handle: the prefill part of `generate` run now (its blocks stay pinned
    for the engine's --kv-pin-seconds). A handle is single-use: after one good pull, the same
    request is refused."""
    return engine_pb2.PullKvBlocksRequest(
        handle=handle_of(list(engine.Generate(prefill_request(generate), timeout=TIMEOUT))))


def _unsigned(generate: engine_pb2.GenerateRequest) -> engine_pb2.GenerateRequest:
    unsigned = engine_pb2.GenerateRequest()
    unsigned.CopyFrom(generate)
    for item in unsigned.mm_features.items:
        item.ClearField("auth_tag")
        item.ClearField("auth_key_id")
    return unsigned


def _encode_request(generate: engine_pb2.GenerateRequest) -> engine_pb2.EncodeRequest:
    return engine_pb2.EncodeRequest(mm_features=generate.mm_features)


SERVICE_DESCRIPTORS = {
    "render": render_pb2.DESCRIPTOR.services_by_name["RenderService"],
    "engine": engine_pb2.DESCRIPTOR.services_by_name["EngineService"],
    "derender": derender_pb2.DESCRIPTOR.services_by_name["DerenderService"],
}
#: RPCs that change their server for good (a drained engine admits nothing more): fuzzed on a
#: server of their own, so the other RPCs' fuzz still finds a working one.
ONE_WAY = {"/tito.v1.EngineService/Drain": "engine_drained"}
#: Every RPC of every service, as the descriptors declare them: path -> (server, method descriptor).
RPCS = {f"/{descriptor.full_name}/{method.name}": (ONE_WAY.get(f"/{descriptor.full_name}/{method.name}", service),
                                                   method)
        for service, descriptor in SERVICE_DESCRIPTORS.items() for method in descriptor.methods}
SERVICES = {service: [path for path, (owner, _) in RPCS.items() if owner == service]
            for service in (*SERVICE_DESCRIPTORS, *ONE_WAY.values())}
STREAMING_RESPONSE = {path for path, (_, method) in RPCS.items() if method.server_streaming}
BIDI = {path for path, (_, method) in RPCS.items() if method.client_streaming}
#: Streams that only end when the caller leaves: called with a short deadline, at which a stream
#: that was accepted is still open (OK), where a refused one has already ended with its status.
ENDLESS = {"/tito.v1.EngineService/SubscribeKvEvents"}
ENDLESS_DEADLINE = 0.2
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
        elif method in ENDLESS:
            try:
                list(channel.unary_stream(method)(payload, timeout=ENDLESS_DEADLINE))
            except grpc.RpcError as exc:
                if exc.code() != grpc.StatusCode.DEADLINE_EXCEEDED:
                    raise
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
    # Not the endless streams: each open one costs its deadline, and the sweep covers their
    # requests (one optional field) whole.
    methods = [method for method in SERVICES[service] if method not in ENDLESS]
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


#: The RPC whose seed is spent by its first good call (a KV transfer handle): renewed before the last check.
SINGLE_USE = "/tito.v1.EngineService/PullKvBlocks"
#: RPCs that change what the engine holds: their seed answers OK only from the state it expects.
ADAPTER_CHANGES = ("/tito.v1.EngineService/LoadLoraAdapter", "/tito.v1.EngineService/UnloadLoraAdapter")


def _hold_only_the_seed_adapter(channel, loaded: bool) -> None:
    """Unload every adapter the fuzz loaded; hold the seeds' "fuzz-2" when `loaded` (for Unload's seed)."""
    adapters = LoraAdapters(channel, timeout=TIMEOUT)
    for adapter in adapters.list():
        if adapter.name != "fuzz":
            adapters.unload(adapter.name)
    if loaded:
        adapters.load("fuzz-2", "adapter")


def _good(seeds, method):
    seed = seeds[method]
    return [m.SerializeToString() for m in seed] if isinstance(seed, list) else seed.SerializeToString()


def _sweep_positions(seed) -> Iterator[tuple[int | None, object]]:
    """(stream position or None, message) for each request message to sweep: a unary request,
    or each message of a stream whose fields differ from every earlier one's (a derender stream's
    context, its first response, its last)."""
    if not isinstance(seed, list):
        yield None, seed
        return
    shapes = set()
    for position, message in enumerate(seed):
        shape = frozenset(_field_paths(message))
        if shape not in shapes:
            shapes.add(shape)
            yield position, message


def _field_paths(message, prefix: str = "") -> Iterator[str]:
    for field, value in message.ListFields():
        path = f"{prefix}.{field.name}"
        yield path
        if field.message_type is not None and not field.message_type.GetOptions().map_entry:
            for element in (value if field.is_repeated else [value]):
                yield from _field_paths(element, path)


def _sweep_payload(seed, position: int | None, case: SweepCase):
    if position is None:
        return case.payload
    return [case.payload if index == position else m.SerializeToString() for index, m in enumerate(seed)]


@pytest.mark.parametrize("method", RPCS)
def test_every_field_of_every_rpc_alone_never_breaks_a_service(servers, seeds, signed_seeds, method):
    assert method in seeds, f"{method} has no seed request, so no field-level fuzz: add one to `seeds`"
    service, _ = RPCS[method]
    outcomes: Counter = Counter()
    bugs: list[str] = []  # every failing case, not just the first: a fix can be checked against them all
    with servers[service].channel() as channel:
        for number, seed in enumerate([seeds[method], *signed_seeds.get(method, ())]):
            for position, message in _sweep_positions(seed):
                where = f"seed {number}, " + ("" if position is None else f"stream message {position}, ")
                for case in field_sweep(message):
                    try:
                        outcomes[_call(channel, method, _sweep_payload(seed, position, case)).name] += 1
                    except AssertionError as exc:
                        bugs.append(f"{where}{case}: {exc}")
        print(f"\n{method}: {sum(outcomes.values()) + len(bugs)} field cases: " +
              ", ".join(f"{code}={count}" for code, count in sorted(outcomes.items())))
        assert not bugs, f"{method}: {len(bugs)} cases answered as bugs:\n" + "\n".join(bugs)
        # Still fully working, and nothing left behind.
        if method in ADAPTER_CHANGES:
            _hold_only_the_seed_adapter(channel, loaded=method.endswith("/UnloadLoraAdapter"))
        if method == SINGLE_USE:
            seeds[method] = _pull_request(engine_pb2_grpc.EngineServiceStub(channel),
                                          seeds["/tito.v1.EngineService/Generate"])
        assert _call(channel, method, _good(seeds, method)) == grpc.StatusCode.OK
        if service == "engine":
            load = engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
            assert (load.running_requests, load.waiting_requests) == (0, 0)
