"""SMG's vllm.grpc.engine.VllmEngine on the engine's port, beside tito.v1 (real gRPC, port 0, the
tiny model): every RPC, the same tokens as tito.v1's Generate, stop strings in the engine, and
hostile requests answered with a clean status while the next request still works."""

from __future__ import annotations

import hashlib
import threading
import io
import time
import zipfile

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2
from transformers import AutoTokenizer

from tito.grpc_errors import error_details
from tito.v1 import engine_pb2, engine_pb2_grpc
from tito_engine.config import EngineConfig
from tito_engine.server import SERVICE_NAME, create_server
from tito_engine.smg.servicer import SERVICE_NAME as SMG_SERVICE

from engine_calls import collect, request
from smg_calls import read_stream, smg_request, text_stop

TIMEOUT = 30
CONTEXT = 256
PROMPTS = [[5, 6, 7, 8], [100, 200, 300, 400, 500, 17], [42], list(range(30, 70))]


@pytest.fixture(scope="module")
def server(module_aio_server, tiny_text_model):
    config = EngineConfig(model=str(tiny_text_model), device="cpu", engine_process=False, max_model_len=CONTEXT,
                          block_size=16)
    return module_aio_server(lambda: create_server(config))


@pytest.fixture(scope="module")
def stubs(server):
    channel = server.channel()
    return vllm_engine_pb2_grpc.VllmEngineStub(channel), engine_pb2_grpc.EngineServiceStub(channel), channel


@pytest.fixture(scope="module")
def smg(stubs):
    return stubs[0]


@pytest.fixture(scope="module")
def tito(stubs):
    return stubs[1]


@pytest.fixture(scope="module")
def tokenizer(tiny_text_model):
    return AutoTokenizer.from_pretrained(str(tiny_text_model))


def generate(smg, prompt, **kwargs):
    return read_stream(smg.Generate(smg_request(prompt, **kwargs), timeout=TIMEOUT))


def refusal(call) -> dict:
    with pytest.raises(grpc.RpcError) as caught:
        result = call()
        if not isinstance(result, (vllm_engine_pb2.HealthCheckResponse, common_pb2.ProfileResponse,
                                   vllm_engine_pb2.EmbedResponse)):
            list(result)
    return error_details(caught.value)


def wait_idle(smg, timeout=10.0) -> vllm_engine_pb2.SchedulerLoad:
    deadline = time.monotonic() + timeout
    while True:
        load = smg.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT).loads[0]
        if load.num_running_reqs == load.num_waiting_reqs == 0 or time.monotonic() > deadline:
            return load
        time.sleep(0.02)


def test_health_and_reflection_list_both_faces(stubs):
    smg, _, channel = stubs
    health = health_pb2_grpc.HealthStub(channel)
    for service in ("", SERVICE_NAME, SMG_SERVICE):
        assert health.Check(health_pb2.HealthCheckRequest(service=service), timeout=TIMEOUT).status == \
            health_pb2.HealthCheckResponse.SERVING
    answer = smg.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=TIMEOUT)
    assert answer.healthy
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    reflection = reflection_pb2_grpc.ServerReflectionStub(channel)
    listed = next(reflection.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]),
                                                  timeout=TIMEOUT))
    names = {service.name for service in listed.list_services_response.service}
    assert {SERVICE_NAME, SMG_SERVICE} <= names


@pytest.mark.parametrize("stream", [True, False])
def test_greedy_tokens_equal_tito_v1_generate(smg, tito, stream):
    for prompt in PROMPTS:
        expected, finals = collect(tito.Generate(request(prompt, max_tokens=12), timeout=TIMEOUT))
        got = generate(smg, prompt, max_tokens=12, stream=stream)
        assert got.tokens() == expected[0], prompt
        complete = got.completes[0]
        assert complete.finish_reason == "length" and complete.prompt_tokens == len(prompt)
        if stream:  # chunks first, then the complete repeating the last chunk's tokens
            assert got.kinds[-1] == ("complete", 0) and {kind for kind, _ in got.kinds[:-1]} == {"chunk"}
            assert list(complete.output_ids) == got.tokens()[-len(complete.output_ids):]
        else:
            assert got.kinds == [("complete", 0)] and complete.completion_tokens == 12


def test_seeded_samples_and_logprobs_equal_tito_v1(smg, tito):
    prompt = PROMPTS[1]
    tokens, finals = collect(tito.Generate(request(prompt, max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=True,
                                                   top_logprobs=3), timeout=TIMEOUT))
    got = generate(smg, prompt, max_tokens=8, temperature=1.0, seed=7, n=2, logprobs=3, stream=False)
    assert set(got.completes) == {0, 1}
    for index in (0, 1):
        complete = got.completes[index]
        assert list(complete.output_ids) == tokens[index] and complete.index == index
        logprobs = complete.output_logprobs
        assert list(logprobs.token_ids) == tokens[index] and len(logprobs.top_logprobs) == len(tokens[index])
        assert all(len(top.token_ids) == 3 and top.values[0] >= top.values[-1] for top in logprobs.top_logprobs)
    assert tokens[0] != tokens[1]  # the seed differs per choice, as on tito.v1


def test_truncate_prompt_tokens_keeps_the_prompts_last_tokens(smg, tito):
    prompt = PROMPTS[3]
    expected, _ = collect(tito.Generate(request(prompt[-4:], max_tokens=6), timeout=TIMEOUT))
    got = generate(smg, prompt, max_tokens=6, truncate_prompt_tokens=4, stream=False)
    assert got.tokens() == expected[0] and got.completes[0].prompt_tokens == 4
    whole = generate(smg, prompt, max_tokens=6, truncate_prompt_tokens=-1, stream=False)  # -1: the context
    assert whole.completes[0].prompt_tokens == len(prompt)


def test_max_tokens_unset_runs_to_the_context_limit(smg):
    prompt = PROMPTS[3]
    got = generate(smg, prompt, ignore_eos=True, stream=False)
    complete = got.completes[0]
    assert complete.finish_reason == "length" and len(complete.output_ids) == CONTEXT - len(prompt)


def test_a_stop_string_ends_the_choice_in_the_engine(smg, tito, tokenizer):
    prompt = PROMPTS[0]
    expected, _ = collect(tito.Generate(request(prompt, max_tokens=20, ignore_eos=True), timeout=TIMEOUT))
    tokens = expected[0]
    stop = text_stop(tokenizer, tokens, 6)
    end = next(i for i in range(len(tokens)) if stop in tokenizer.decode(tokens[:i + 1]))
    for stream in (True, False):
        got = generate(smg, prompt, max_tokens=20, ignore_eos=True, stop=["never there", stop], stream=stream)
        complete = got.completes[0]
        assert complete.finish_reason == "stop" and complete.matched_stop_str == stop
        assert got.tokens() == tokens[:end + 1]
    # Not matched within the first min_tokens tokens.
    late = generate(smg, prompt, max_tokens=20, ignore_eos=True, stop=[stop], min_tokens=end + 1, stream=False)
    assert len(late.tokens()) > end + 1 or late.completes[0].finish_reason == "length"
    # The stream ended after the engine let the request go: its id is free, the load is 0 at once.
    load = smg.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT).loads[0]
    assert load.num_running_reqs == load.num_waiting_reqs == 0


def test_a_choice_a_stop_string_ends_reports_the_prompts_cached_tokens(smg, tito, tokenizer):
    """The backend's usage (with its prefix-cache hit) comes with a choice's last output, which a
    choice the face ends on a stop string never sees: its complete reports the hit all the same."""
    prompt = PROMPTS[3]  # 40 tokens: two whole 16-token blocks to find in the cache
    expected, _ = collect(tito.Generate(request(prompt, max_tokens=20, ignore_eos=True), timeout=TIMEOUT))
    stop = text_stop(tokenizer, expected[0], 6)
    plain = generate(smg, prompt, max_tokens=20, ignore_eos=True, stream=False).completes[0]
    assert plain.cached_tokens == len(prompt) // 16 * 16  # the prompt's whole blocks, cached by the first run
    for stream in (True, False):
        for n in (1, 2):
            got = generate(smg, prompt, max_tokens=20, ignore_eos=True, stop=[stop], stream=stream, n=n)
            for complete in got.completes.values():
                assert complete.matched_stop_str == stop, (stream, n)
                assert complete.cached_tokens == plain.cached_tokens, (stream, n)


def test_stop_token_ids_report_matched_token_id(smg, tito):
    prompt = PROMPTS[1]
    expected, _ = collect(tito.Generate(request(prompt, max_tokens=10, ignore_eos=True), timeout=TIMEOUT))
    stop_id = expected[0][3]
    end = expected[0].index(stop_id)
    got = generate(smg, prompt, max_tokens=10, ignore_eos=True, stop_token_ids=[stop_id], stream=False)
    complete = got.completes[0]
    assert complete.finish_reason == "stop" and complete.WhichOneof("matched_stop") == "matched_token_id"
    assert complete.matched_token_id == stop_id and list(complete.output_ids) == expected[0][:end + 1]


def test_constraints_are_tito_structured_outputs(smg, tokenizer):
    got = generate(smg, PROMPTS[0], max_tokens=20, stream=False,
                   choice=vllm_engine_pb2.ChoiceConstraint(choices=["yes", "no"]))
    assert tokenizer.decode(got.tokens(), skip_special_tokens=True) in ("yes", "no")
    got = generate(smg, PROMPTS[0], max_tokens=10, stream=False, regex="[0-9]{3}")
    assert tokenizer.decode(got.tokens(), skip_special_tokens=True)[:3].isdigit()


def test_abort_and_a_dropped_stream_free_the_request(smg):
    responses = smg.Generate(smg_request(PROMPTS[0], request_id="to-abort", max_tokens=200, ignore_eos=True),
                             timeout=TIMEOUT)
    first = next(responses)
    assert first.WhichOneof("response") == "chunk"
    smg.Abort(vllm_engine_pb2.AbortRequest(request_ids=["to-abort"]), timeout=TIMEOUT)
    rest = read_stream(responses)
    assert rest.completes[0].finish_reason == "abort"
    assert wait_idle(smg).num_running_reqs == 0

    for attempt in range(3):  # on a fast, quiet machine the 200 tokens can be done before the load is read
        responses = smg.Generate(smg_request(PROMPTS[0], request_id=f"dropped-{attempt}", max_tokens=200,
                                             ignore_eos=True), timeout=TIMEOUT)
        next(responses)
        if smg.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT).loads[0].num_running_reqs == 1:
            break
        read_stream(responses)
    else:
        pytest.fail("the request finished before its stream could be dropped, three times")
    responses.cancel()
    load = wait_idle(smg)
    assert load.num_running_reqs == load.num_waiting_reqs == 0


def test_model_server_and_load_facts(smg, tiny_text_model):
    info = smg.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.model_path == info.tokenizer_path == str(tiny_text_model) == info.served_model_name
    assert info.is_generation and not info.supports_vision
    assert info.max_context_length == CONTEXT and info.vocab_size == 1013
    assert info.model_type == "qwen2" and list(info.architectures) == ["Qwen2ForCausalLM"]
    assert list(info.eos_token_ids) == [1002, 1000]
    assert info.default_sampling_params_json == '{"temperature":0.0}'  # the tiny model's do_sample: false
    server = smg.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=TIMEOUT)
    assert server.server_type == "vllm-grpc" and server.max_num_seqs == 64 and server.block_size == 16
    assert server.model_dtype == "torch.float32" and server.constrained_decoding_start == "first_token"
    assert server.mm_item_limits == "" and server.mm_encoder_budget == 0  # a text model: SMG keeps its own caps
    loads = smg.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT)
    assert loads.dp_rank_count == 1 and len(loads.loads) == 1
    load = loads.loads[0]
    assert load.max_running_requests == 64 and load.max_total_num_tokens > 0 and 0 <= load.token_usage < 1


def test_get_tokenizer_streams_the_model_files_with_their_checksum(smg, tiny_text_model):
    chunks = list(smg.GetTokenizer(common_pb2.GetTokenizerRequest(), timeout=TIMEOUT))
    data = b"".join(chunk.data for chunk in chunks)
    assert [bool(chunk.sha256) for chunk in chunks] == [False] * (len(chunks) - 1) + [True]
    assert chunks[-1].sha256 == hashlib.sha256(data).hexdigest()
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        assert archive.read("tokenizer.json") == (tiny_text_model / "tokenizer.json").read_bytes()
        assert {"config.json", "tokenizer_config.json"} <= set(archive.namelist())


def _to_int64(digest: bytes) -> int:
    value = int.from_bytes(digest[-8:], "big")
    return value - (1 << 64) if value >= 1 << 63 else value


def _batch_storing(batches, first_tokens, sequence_of):
    """The first batch of `batches` (a replay: already buffered, so this never waits) storing a block
    that starts with `first_tokens`."""
    for batch in batches:
        for event in batch.events:
            kind = event.WhichOneof("event") if hasattr(event, "block_stored") else event.WhichOneof("data")
            stored = event.block_stored if kind == "block_stored" else event.stored if kind == "stored" else None
            if stored is None:
                continue
            tokens = stored.token_ids if hasattr(stored, "block_size") else stored.blocks[0].token_ids
            if list(tokens[:len(first_tokens)]) == first_tokens:
                return batch, sequence_of(batch)
    raise AssertionError("no such batch")


def test_kv_events_are_tito_v1_events_in_smg_shapes_with_replay(smg, tito):
    prompt = [(7 * i + 3) % 997 for i in range(40)]  # two full blocks of 16
    generate(smg, prompt, max_tokens=2, stream=False)
    reference = tito.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(start_sequence=0), timeout=TIMEOUT)
    tito_batch, sequence = _batch_storing(reference, prompt[:16], lambda batch: batch.sequence)
    reference.cancel()
    stored_tito = next(event.block_stored for event in tito_batch.events if event.WhichOneof("event") == "block_stored")
    # 0 replays the engine's whole log (it still holds its first batch): the same batch, in SMG's shapes.
    replay = smg.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=0), timeout=TIMEOUT)
    batch, smg_sequence = _batch_storing(replay, prompt[:16], lambda batch: batch.sequence_number)
    replay.cancel()
    assert smg_sequence == sequence
    blocks = [block for event in batch.events if event.WhichOneof("data") == "stored" for block in event.stored.blocks]
    assert [list(block.token_ids) for block in blocks[:2]] == [prompt[:16], prompt[16:32]]
    assert [block.block_hash for block in blocks[:2]] == [_to_int64(digest) for digest in stored_tito.block_hashes[:2]]
    assert all(block.block_size == 16 for block in blocks)
    # A cursor resumes at that batch; one past the engine's next batch is OUT_OF_RANGE.
    resumed = smg.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(start_sequence_number=sequence),
                                    timeout=TIMEOUT)
    assert next(resumed).sequence_number == sequence
    resumed.cancel()
    ahead = refusal(lambda: smg.SubscribeKvEvents(
        common_pb2.SubscribeKvEventsRequest(start_sequence_number=10**9), timeout=TIMEOUT))
    assert ahead["code"] == grpc.StatusCode.OUT_OF_RANGE
    # FlushCache empties the prefix cache, and a live subscriber hears it.
    live = tito.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT)
    flushed = smg.FlushCache(common_pb2.FlushCacheRequest(), timeout=TIMEOUT)
    assert flushed.success
    assert any(event.WhichOneof("event") == "all_blocks_cleared" for event in next(live).events)
    live.cancel()


HOSTILE = [
    ("text input", vllm_engine_pb2.GenerateRequest(request_id="h", text="hello"), "TOKENIZED_INPUT_REQUIRED", "text"),
    ("id outside the vocabulary", smg_request([5, 6, 5000], request_id="h"), "TOKEN_ID_OUT_OF_RANGE",
     "tokenized.input_ids[2]"),
    ("huge n", smg_request([5], request_id="h", n=10**6), "INVALID_SAMPLING_PARAMS", "sampling_params.n"),
    ("10^5 stop strings", smg_request([5], request_id="h", stop=["x"] * 10**5), "STOP_STRINGS_TOO_LARGE",
     "sampling_params.stop"),
    ("a grammar that does not compile", smg_request([5], request_id="h", grammar="root ::= ("),
     "INVALID_STRUCTURED_OUTPUT", "sampling_params.grammar"),
    ("a schema that is not JSON", smg_request([5], request_id="h", json_schema="{"), "INVALID_STRUCTURED_OUTPUT",
     "sampling_params.json_schema"),
    ("too many logprobs", smg_request([5], request_id="h", logprobs=50), "INVALID_SAMPLING_PARAMS",
     "sampling_params.logprobs"),
    ("every logprob", smg_request([5], request_id="h", logprobs=-1), "UNSUPPORTED_FIELD", "sampling_params.logprobs"),
    ("prompt logprobs", smg_request([5], request_id="h", prompt_logprobs=1), "UNSUPPORTED_FIELD",
     "sampling_params.prompt_logprobs"),
    # (On a vision model: tests/integration/test_engine_smg_media.py.)
    ("an image to a text model, its placeholder past the prompt", vllm_engine_pb2.GenerateRequest(
        request_id="h", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6]),
        mm_inputs=vllm_engine_pb2.MultimodalInputs(
            mm_hashes=["h"], mm_placeholders=[vllm_engine_pb2.PlaceholderRange(offset=9, length=4)])),
     "UNSUPPORTED_MODALITY", "mm_inputs.items[0].modality"),
    ("a media batch without hashes", vllm_engine_pb2.GenerateRequest(
        request_id="h", tokenized=vllm_engine_pb2.TokenizedInput(input_ids=[5, 6]),
        mm_inputs=vllm_engine_pb2.MultimodalInputs(mm_placeholders=[vllm_engine_pb2.PlaceholderRange(offset=0,
                                                                                                     length=1)])),
     "INVALID_MM_PAYLOAD", "mm_inputs.mm_hashes"),
    ("max_tokens past the context", smg_request([5], request_id="h", max_tokens=10**6), "INVALID_SAMPLING_PARAMS",
     "sampling_params.max_tokens"),
    ("an empty prompt", smg_request([], request_id="h"), "EMPTY_PROMPT", "tokenized.input_ids"),
    ("a negative temperature", smg_request([5], request_id="h", temperature=-1.0), "INVALID_SAMPLING_PARAMS",
     "sampling_params.temperature"),
]


@pytest.mark.parametrize("name, message, reason, field", HOSTILE, ids=[case[0] for case in HOSTILE])
def test_hostile_requests_get_a_clean_status_and_the_next_request_works(smg, name, message, reason, field):
    details = refusal(lambda: smg.Generate(message, timeout=TIMEOUT))
    assert details["code"] in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED), details
    assert details["reason"] == reason and details["fields"][0] == field, details
    assert generate(smg, PROMPTS[0], max_tokens=2).completes[0].finish_reason == "length"


def test_wrong_types_on_the_wire_are_malformed_requests(stubs):
    _, _, channel = stubs
    cases = [
        (b"\xff\xff\xff", "MALFORMED_REQUEST"),  # no message at all
        (b"\x12\x04\x12\x02\xff\xff", "MALFORMED_REQUEST"),  # input_ids: a packed varint cut short
        # Field 2 (`tokenized`, a message) sent as a varint: protobuf keeps it as an unknown field.
        (b"\x10\x05", "TOKENIZED_INPUT_REQUIRED"),
    ]
    call = channel.unary_stream("/vllm.grpc.engine.VllmEngine/Generate", request_serializer=lambda raw: raw,
                                response_deserializer=vllm_engine_pb2.GenerateResponse.FromString)
    for payload, reason in cases:
        details = refusal(lambda: call(payload, timeout=TIMEOUT))
        assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT and details["reason"] == reason, payload
    assert generate(stubs[0], PROMPTS[0], max_tokens=2).completes[0].finish_reason == "length"


def test_embed_and_the_profiler_are_unimplemented_with_a_reason(smg):
    for call in (lambda: smg.Embed(vllm_engine_pb2.EmbedRequest(), timeout=TIMEOUT),
                 lambda: smg.StartProfile(common_pb2.StartProfileRequest(), timeout=TIMEOUT),
                 lambda: smg.StopProfile(common_pb2.StopProfileRequest(), timeout=TIMEOUT)):
        details = refusal(call)
        assert details["code"] == grpc.StatusCode.UNIMPLEMENTED and details["reason"] == "RPC_UNIMPLEMENTED"


def test_a_kv_event_subscription_answers_at_once_on_an_idle_engine(smg):
    """SMG takes a subscription that stays silent for seconds for a dead worker: the headers come
    before any batch."""
    live = smg.SubscribeKvEvents(common_pb2.SubscribeKvEventsRequest(), timeout=TIMEOUT)
    done = []
    waiter = threading.Thread(target=lambda: done.append(live.initial_metadata()))
    waiter.start()
    waiter.join(5)
    live.cancel()
    assert done, "no headers within 5 s"


def test_a_draining_engine_refuses_new_streams_on_smgs_face_and_ends_the_rest_as_gone(aio_server, tiny_text_model):
    """Drain (tito.v1's RPC, or SIGTERM) covers both faces: SMG's health turns unhealthy, a new
    Generate is UNAVAILABLE ENGINE_DRAINING, and a stream the grace period outlives ends with the
    same status (so SMG retries it elsewhere) rather than as a finished choice."""
    # The tiny model's whole context: CONTEXT's 250 tokens took less than the grace period on a fast
    # machine, and the stream then ended as finished before the drain could end it.
    long_context = 2048
    config = EngineConfig(model=str(tiny_text_model), device="cpu", engine_process=False,
                          max_model_len=long_context, block_size=16)
    channel = aio_server(lambda: create_server(config)).channel()
    smg_stub, tito_stub = vllm_engine_pb2_grpc.VllmEngineStub(channel), engine_pb2_grpc.EngineServiceStub(channel)
    running = smg_stub.Generate(smg_request(PROMPTS[0], request_id="outlives-grace", max_tokens=long_context - 8,
                                            ignore_eos=True), timeout=TIMEOUT)
    assert next(running).WhichOneof("response") == "chunk"

    drained = tito_stub.Drain(engine_pb2.DrainRequest(grace_seconds=0.2), timeout=TIMEOUT)
    assert drained.in_flight_requests == 1

    assert not smg_stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=TIMEOUT).healthy
    refused = refusal(lambda: smg_stub.Generate(smg_request(PROMPTS[1], max_tokens=4), timeout=TIMEOUT))
    assert (refused["code"], refused["reason"]) == (grpc.StatusCode.UNAVAILABLE, "ENGINE_DRAINING")
    ended = refusal(lambda: read_stream(running))
    assert (ended["code"], ended["reason"]) == (grpc.StatusCode.UNAVAILABLE, "ENGINE_DRAINING")
