"""The engine over real gRPC (port 0): streams, concurrency, admission errors, cancel, Abort."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from grpc_health.v1 import health_pb2, health_pb2_grpc
from transformers import AutoModelForCausalLM

from tito.grpc_errors import error_details
from tito.v1 import engine_pb2, engine_pb2_grpc, multimodal_pb2
from tito_engine.config import EngineConfig
from tito_engine.server import SERVICE_NAME, create_server

from engine_calls import collect, request

TIMEOUT = 30
CONTEXT = 64
LONG = 2000  # tokens: seconds of work for the tiny model, so a stream is surely still running
PROMPTS = [[5, 6, 7, 8], [100, 200, 300, 400, 500, 17], [42], [9, 8, 7, 6, 5, 4, 3, 2, 1]]


@pytest.fixture(scope="module")
def hf_model(tiny_text_model):
    return AutoModelForCausalLM.from_pretrained(tiny_text_model).eval()


def hf_greedy(model, prompt, max_new_tokens):
    with torch.inference_mode():
        output = model.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=max_new_tokens)
    return output[0, len(prompt):].tolist()


@pytest.fixture
def engine(aio_server, tiny_text_model):
    def start(**overrides):
        overrides.setdefault("max_model_len", CONTEXT)
        # The core on a thread keeps these servers quick to start; the deployed child-process core
        # is exercised by test_engine_batching.py and the dead-process test below.
        overrides.setdefault("engine_process", False)
        config = EngineConfig(model=str(tiny_text_model), device="cpu", **overrides)
        server = aio_server(lambda: create_server(config))
        channel = server.channel()
        return engine_pb2_grpc.EngineServiceStub(channel), channel
    return start


def wait_for(predicate, timeout=10.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_health_and_model_info(engine, tiny_text_model):
    stub, channel = engine()
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME):
        status = health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status
        assert status == health_pb2.HealthCheckResponse.SERVING
    info = stub.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
    assert info.model_id == str(tiny_text_model)
    assert info.vocab_size == info.tokenizer_vocab_size == 1013 and info.max_context_length == CONTEXT
    assert list(info.eos_token_ids) == [1002, 1000]
    assert info.dtype == "float32" and info.device == "cpu"
    assert len(info.model_fingerprint) == 16 and info.max_running_requests == 64
    assert list(info.modalities) == []


def test_greedy_stream_equals_hf_generate_and_concurrent_streams(engine, hf_model):
    stub, _ = engine()
    tokens, finals = collect(stub.Generate(request(PROMPTS[0], max_tokens=16), timeout=TIMEOUT))
    expected = hf_greedy(hf_model, PROMPTS[0], 16)
    assert tokens[0] == expected
    final = finals[0]
    assert final.usage.prompt_tokens == 4 and final.usage.completion_tokens == len(expected)
    assert final.usage.cached_tokens == 0

    results = [None] * len(PROMPTS)

    def worker(i):
        results[i] = collect(stub.Generate(request(PROMPTS[i], max_tokens=12), timeout=TIMEOUT))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(len(PROMPTS))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    for prompt, (tokens, finals) in zip(PROMPTS, results):
        assert tokens[0] == hf_greedy(hf_model, prompt, 12)
        assert finals[0].finish_reason in (engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH)


def test_finish_reasons_stop_tokens_and_choices(engine, hf_model):
    stub, _ = engine()
    expected = hf_greedy(hf_model, PROMPTS[1], 10)
    stop_at = expected[3]
    tokens, finals = collect(stub.Generate(request(PROMPTS[1], max_tokens=10, stop_token_ids=[stop_at]),
                                           timeout=TIMEOUT))
    assert tokens[0] == expected[:expected.index(stop_at) + 1]
    assert finals[0].finish_reason == engine_pb2.FINISH_REASON_STOP
    assert finals[0].HasField("matched_stop_token_id") and finals[0].matched_stop_token_id == stop_at

    tokens, finals = collect(stub.Generate(request(PROMPTS[1], max_tokens=5, ignore_eos=True), timeout=TIMEOUT))
    assert len(tokens[0]) == 5 and finals[0].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert not finals[0].HasField("matched_stop_token_id")

    # No max_tokens: generate up to the context limit.
    tokens, finals = collect(stub.Generate(request(PROMPTS[1], ignore_eos=True), timeout=TIMEOUT))
    assert len(tokens[0]) == CONTEXT - len(PROMPTS[1])

    seeded = request(PROMPTS[2], temperature=1.0, seed=11, n=3, max_tokens=8, ignore_eos=True)
    first, finals = collect(stub.Generate(seeded, timeout=TIMEOUT))
    second, _ = collect(stub.Generate(seeded, timeout=TIMEOUT))
    assert sorted(first) == [0, 1, 2] and sorted(finals) == [0, 1, 2]
    assert first == second and len({tuple(t) for t in first.values()}) > 1
    assert all(final.usage.completion_tokens == 8 for final in finals.values())


def test_logit_bias_bans_and_forces_tokens_while_unbiased_streams_run_beside(engine, hf_model):
    stub, _ = engine()
    expected = hf_greedy(hf_model, PROMPTS[0], 8)
    banned = expected[0]
    forced = next(token for token in range(300, 400) if token not in expected)
    calls = {"plain": request(PROMPTS[0], max_tokens=8),
             "banned": request(PROMPTS[0], max_tokens=8, logit_bias={banned: -100.0}),
             "forced": request(PROMPTS[0], max_tokens=8, ignore_eos=True, logit_bias={forced: 100.0})}
    results = {}

    def worker(name):
        results[name] = collect(stub.Generate(calls[name], timeout=TIMEOUT))[0][0]

    threads = [threading.Thread(target=worker, args=(name,)) for name in calls]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert results["plain"] == expected
    assert results["banned"] and banned not in results["banned"]
    assert results["forced"] == [forced] * 8


def _image_item():
    return multimodal_pb2.MultiModalFeatures(items=[multimodal_pb2.MultiModalItem(
        modality=multimodal_pb2.MODALITY_IMAGE, mm_hash="abc",
        placeholder=multimodal_pb2.PlaceholderRange(offset=0, length=1))])


BAD_REQUESTS = [
    (request([]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    (request([1, 2, 5000]), grpc.StatusCode.INVALID_ARGUMENT, "token_ids[2]"),
    (request([1] * CONTEXT), grpc.StatusCode.INVALID_ARGUMENT, "token_ids"),
    (request([1, 2], max_tokens=CONTEXT), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.max_tokens"),
    (request([1, 2], temperature=-1.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.temperature"),
    (request([1, 2], top_p=0.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_p"),
    (request([1, 2], top_p=1.5), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_p"),
    (request([1, 2], min_p=2.0), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.min_p"),
    (request([1, 2], top_k=-5), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_k"),
    (request([1, 2], n=0), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.n"),
    (request([1, 2], n=1000), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.n"),
    (request([1, 2], top_logprobs=21), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_logprobs"),
    (request([1, 2], repetition_penalty=0.0), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling_params.repetition_penalty"),
    (engine_pb2.GenerateRequest(token_ids=[1, 2], mm_features=_image_item()), grpc.StatusCode.INVALID_ARGUMENT,
     "mm_features.items[0].modality"),
    (request([1, 2], top_logprobs=2), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.top_logprobs"),
    (request([1, 2], logit_bias={5: 1.0, 5000: 1.0}), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling_params.logit_bias[5000]"),
    (request([1, 2], logit_bias={5: 150.0}), grpc.StatusCode.INVALID_ARGUMENT, "sampling_params.logit_bias[5]"),
    (request([1, 2], logit_bias={5: float("nan")}), grpc.StatusCode.INVALID_ARGUMENT,
     "sampling_params.logit_bias[5]"),
    # proto3 keeps enum values it does not know; admission names the field.
    (engine_pb2.GenerateRequest(token_ids=[1, 2], mm_features=multimodal_pb2.MultiModalFeatures(
        items=[multimodal_pb2.MultiModalItem(modality=7)])), grpc.StatusCode.INVALID_ARGUMENT,
     "mm_features.items[0].modality"),
]


def test_admission_errors_name_the_field_and_leave_the_engine_working(engine, hf_model):
    stub, _ = engine()
    good = request(PROMPTS[0], max_tokens=4)
    expected = hf_greedy(hf_model, PROMPTS[0], 4)
    for bad, code, field in BAD_REQUESTS:
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(bad, timeout=TIMEOUT))
        details = error_details(exc.value)
        assert details["code"] == code, (field, details)
        assert details["fields"] == [field], details
        assert collect(stub.Generate(good, timeout=TIMEOUT))[0][0] == expected
    with pytest.raises(grpc.RpcError) as exc:
        stub.Encode(engine_pb2.EncodeRequest(), timeout=TIMEOUT)
    assert error_details(exc.value)["fields"] == ["mm_features.items"]
    assert exc.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    with pytest.raises(grpc.RpcError) as exc:  # a text-only model encodes nothing
        stub.Encode(engine_pb2.EncodeRequest(mm_features=_image_item()), timeout=TIMEOUT)
    assert error_details(exc.value)["fields"] == ["mm_features.items[0].modality"]
    assert collect(stub.Generate(good, timeout=TIMEOUT))[0][0] == expected


def test_duplicate_id_full_queue_and_abort(engine):
    stub, _ = engine(max_running_sequences=1, max_waiting_requests=1, max_choices_per_request=1,
                     max_model_len=None)
    long_one = request(PROMPTS[0], request_id="long", max_tokens=LONG, ignore_eos=True)
    stream = stub.Generate(long_one, timeout=TIMEOUT)
    first = next(stream)
    assert first.index == 0 and len(first.token_ids) == 1
    assert stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).running_requests == 1

    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Generate(request([1, 2], request_id="long"), timeout=TIMEOUT))
    details = error_details(exc.value)
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT
    assert details["reason"] == "DUPLICATE_REQUEST_ID" and details["fields"] == ["request_id"]

    queued = stub.Generate(request([1, 2], request_id="queued", max_tokens=2), timeout=TIMEOUT)
    assert wait_for(lambda: stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).waiting_requests == 1)
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Generate(request([1, 2], max_tokens=2), timeout=TIMEOUT))
    assert error_details(exc.value)["code"] == grpc.StatusCode.RESOURCE_EXHAUSTED

    aborted = stub.Abort(engine_pb2.AbortRequest(request_ids=["long", "unknown"]), timeout=TIMEOUT)
    assert list(aborted.aborted_request_ids) == ["long"]
    _, finals = collect(stream)
    assert finals[0].finish_reason == engine_pb2.FINISH_REASON_ABORT
    assert finals[0].usage.completion_tokens >= 1
    # The waiting request runs once the slot is free.
    tokens, finals = collect(queued)
    assert len(tokens[0]) >= 1 and finals[0].finish_reason != engine_pb2.FINISH_REASON_ABORT
    load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert load.running_requests == 0 and load.waiting_requests == 0 and load.finished_requests == 2


def test_dropping_a_stream_frees_its_slot(engine):
    stub, _ = engine(max_model_len=None)
    call = stub.Generate(request(PROMPTS[0], max_tokens=LONG, ignore_eos=True), timeout=TIMEOUT)
    next(call)
    assert stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).running_requests == 1
    call.cancel()
    # Far sooner than the LONG tokens would take: the engine dropped the request.
    assert wait_for(lambda: stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).running_requests == 0,
                    timeout=2.0)
    load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert load.waiting_requests == 0 and load.finished_requests == 1


def test_a_dead_model_process_fails_its_streams_then_the_engine_recovers_by_itself(engine, hf_model):
    import multiprocessing

    def new_cores():
        return [child for child in multiprocessing.active_children()
                if child.name == "tito-engine-core" and child.pid not in before]

    before = {child.pid for child in multiprocessing.active_children()}
    stub, channel = engine(max_model_len=None, engine_process=True)
    cores = new_cores()
    assert len(cores) == 1
    call = stub.Generate(request(PROMPTS[0], max_tokens=LONG, ignore_eos=True), timeout=TIMEOUT)
    next(call)
    cores[0].kill()
    with pytest.raises(grpc.RpcError) as exc:
        list(call)
    assert exc.value.code() == grpc.StatusCode.UNAVAILABLE  # promptly, not at the deadline
    with pytest.raises(grpc.RpcError) as exc:  # while the new core loads
        list(stub.Generate(request(PROMPTS[0], max_tokens=2), timeout=TIMEOUT))
    assert (exc.value.code(), error_details(exc.value)["reason"]) == (grpc.StatusCode.UNAVAILABLE, "ENGINE_CORE_LOST")
    health = health_pb2_grpc.HealthStub(channel)

    def status():
        return health.Check(health_pb2.HealthCheckRequest(service=SERVICE_NAME), timeout=TIMEOUT).status

    assert wait_for(lambda: status() == health_pb2.HealthCheckResponse.NOT_SERVING)
    # A new core, without restarting the service: SERVING again, and answering as before.
    assert wait_for(lambda: status() == health_pb2.HealthCheckResponse.SERVING, timeout=120)
    assert [core.pid for core in new_cores() if core.is_alive()] != [cores[0].pid]
    tokens, _ = collect(stub.Generate(request(PROMPTS[0], max_tokens=4), timeout=TIMEOUT))
    assert tokens[0] == hf_greedy(hf_model, PROMPTS[0], 4)
    assert stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT).running_requests == 0
