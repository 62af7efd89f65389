"""The vllm backend over real gRPC, side by side with the native backend on the same model.

Both serve `tiny-qwen2-d64` (vLLM's CPU attention refuses head_dim 16) in float32, so greedy
tokens must agree with each other and with Hugging Face `generate`; admission refuses the same
requests with the same code, reason and field; dropped streams free their slots inside vLLM.
`scripts/test.sh` installs vLLM and sets TITO_REQUIRE_VLLM=1, so there these tests never skip.
"""

from __future__ import annotations

import json
import random
import re
import threading
from concurrent.futures import ThreadPoolExecutor

import grpc
import jsonschema
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tito.contract import MAX_LOGIT_BIAS_ENTRIES
from tito.grpc_errors import error_details
from tito.v1 import engine_pb2, engine_pb2_grpc, multimodal_pb2, sampling_pb2
from tito_engine.config import EngineConfig
from tito_engine.server import create_server

from engine_calls import collect, request

pytestmark = pytest.mark.vllm

TIMEOUT = 120
CONTEXT = 512
NEW_TOKENS = 16
VLLM_ARGS = ("--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.05")
BACKENDS = ("native", "vllm")


def prompts(count: int = 32) -> list[list[int]]:
    """Deterministic prompts of 14-208 tokens (ids of the tiny BPE vocabulary)."""
    rng = random.Random(7)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(14, 208))] for _ in range(count)]


@pytest.fixture(scope="module")
def channels(module_aio_server, tiny_text_model_d64):
    """One engine per backend on the same model and limits; the name -> a channel to it."""
    common = dict(model=str(tiny_text_model_d64), max_model_len=CONTEXT, max_running_sequences=64,
                  max_choices_per_request=4)
    configs = {
        "native": EngineConfig(device="cpu", engine_process=False, **common),
        "vllm": EngineConfig(backend="vllm", kv_cache_bytes=32 << 20, vllm_args=VLLM_ARGS, **common),
    }
    return {name: module_aio_server(lambda config=config: create_server(config)).channel()
            for name, config in configs.items()}


@pytest.fixture(scope="module")
def stubs(channels):
    """The name -> the engine's tito.v1 stub."""
    return {name: engine_pb2_grpc.EngineServiceStub(channel) for name, channel in channels.items()}


@pytest.fixture(scope="module")
def hf_greedy(tiny_text_model_d64):
    """HF's greedy tokens for prompts() with no EOS, the reference for ignore_eos (min_new_tokens
    would ban EOS instead). On one intra-op thread: with vLLM imported, two threads took 8-40 s
    for these 32 prompts (a model this small gains nothing from a second thread), one takes 0.6 s."""
    model = AutoModelForCausalLM.from_pretrained(tiny_text_model_d64, dtype=torch.float32).eval()
    model.generation_config.eos_token_id = None
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            return [model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=NEW_TOKENS,
                                   pad_token_id=0)[0, len(p):].tolist() for p in prompts()]
    finally:
        torch.set_num_threads(threads)


def generate(stub, message):
    return collect(stub.Generate(message, timeout=TIMEOUT))


def greedy_tokens(stub, prompt):
    return generate(stub, request(prompt, max_tokens=NEW_TOKENS, ignore_eos=True))[0][0]


def test_model_info_agrees(stubs):
    native, vllm_info = (stubs[name].GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
                         for name in BACKENDS)
    for field in ("vocab_size", "tokenizer_vocab_size", "max_context_length", "eos_token_ids",
                  "model_fingerprint", "dtype", "max_running_requests"):
        assert getattr(vllm_info, field) == getattr(native, field), field
    assert vllm_info.device == "cpu" and vllm_info.vocab_size == 1013
    # How each takes part in prefill/decode: tito's transfers; none without vLLM's --kv-transfer-config.
    assert native.kv_transfer_protocol == engine_pb2.KV_TRANSFER_PROTOCOL_TITO and not native.kv_connector
    assert vllm_info.kv_transfer_protocol == engine_pb2.KV_TRANSFER_PROTOCOL_NONE and not vllm_info.kv_connector


def test_greedy_tokens_equal_across_backends_and_hf_alone_and_at_concurrency_32(stubs, hf_greedy):
    batch, expected = prompts(), hf_greedy
    for name in BACKENDS:
        alone = [greedy_tokens(stubs[name], p) for p in batch]
        with ThreadPoolExecutor(32) as pool:
            together = list(pool.map(lambda p, stub=stubs[name]: greedy_tokens(stub, p), batch))
        assert alone == expected, name
        assert together == expected, name


def test_seeded_sampling_repeats_and_choices_differ(stubs):
    seeded = request(prompts(1)[0], temperature=1.0, top_p=0.9, seed=11, n=3, max_tokens=8, ignore_eos=True)
    first, finals = generate(stubs["vllm"], seeded)
    second, _ = generate(stubs["vllm"], seeded)
    assert sorted(first) == [0, 1, 2] and first == second
    assert len({tuple(tokens) for tokens in first.values()}) > 1
    assert all(final.usage.completion_tokens == 8 and final.usage.prompt_tokens == len(seeded.token_ids)
               for final in finals.values())


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_migrated_choice_continues_on_both_backends(stubs, backend):
    """Request migration: another engine continues a choice from its 7th token (the first 6 at the
    end of the prompt, prior_output_tokens=6, the budget reduced by 6). Greedy: the uninterrupted
    run's tokens on either backend. Seeded: the same on the native backend (draws derive from the
    output position); vLLM's generator restarts from the seed (documented), so only the count holds."""
    stub, prompt = stubs[backend], prompts(1)[0]
    whole = greedy_tokens(stub, prompt)
    tokens, finals = generate(stub, request(prompt + whole[:6], max_tokens=NEW_TOKENS - 6, ignore_eos=True,
                                            prior_output_tokens=6))
    assert tokens[0] == whole[6:] and finals[0].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    seeded = dict(temperature=1.0, top_p=0.9, seed=5, ignore_eos=True)
    sampled = generate(stub, request(prompt, max_tokens=NEW_TOKENS, **seeded))[0][0]
    resumed = generate(stub, request(prompt + sampled[:6], max_tokens=NEW_TOKENS - 6, prior_output_tokens=6,
                                     **seeded))[0][0]
    assert len(resumed) == NEW_TOKENS - 6
    if backend == "native":
        assert resumed == sampled[6:]


def test_greedy_choices_logprobs_and_stop_tokens(stubs):
    prompt = prompts(2)[1]
    native_tokens, _ = generate(stubs["native"], request(prompt, n=2, max_tokens=5, ignore_eos=True))
    tokens, finals = generate(stubs["vllm"], request(prompt, n=2, max_tokens=5, ignore_eos=True))
    assert tokens == native_tokens and tokens[0] == tokens[1]  # greedy choices are identical

    stop = native_tokens[0][2]
    tokens, finals = generate(stubs["vllm"], request(prompt, max_tokens=5, ignore_eos=True, stop_token_ids=[stop]))
    assert tokens[0] == native_tokens[0][:3]
    assert finals[0].finish_reason == engine_pb2.FINISH_REASON_STOP and finals[0].matched_stop_token_id == stop

    by_backend = {}
    for name in BACKENDS:
        responses = list(stubs[name].Generate(request(prompt, max_tokens=3, logprobs=True, top_logprobs=2),
                                              timeout=TIMEOUT))
        by_backend[name] = [position for response in responses for position in response.logprobs]
    for native, vllm_position in zip(by_backend["native"], by_backend["vllm"], strict=True):
        assert vllm_position.sampled.token_id == native.sampled.token_id and vllm_position.sampled.rank == 1
        assert vllm_position.sampled.logprob == pytest.approx(native.sampled.logprob, abs=1e-3)
        assert [t.token_id for t in vllm_position.top] == [t.token_id for t in native.top]
        assert [t.rank for t in vllm_position.top] == [1, 2]


def test_logit_bias_bans_and_forces_tokens_alike_on_both_backends(stubs):
    prompt = prompts(3)[2]
    expected = greedy_tokens(stubs["native"], prompt)
    forced = next(token for token in range(300, 400) if token not in expected)
    banned = request(prompt, max_tokens=NEW_TOKENS, ignore_eos=True, logit_bias={expected[0]: -100.0})
    forcing = request(prompt, max_tokens=NEW_TOKENS, ignore_eos=True, logit_bias={forced: 100.0})
    answers = {name: (generate(stubs[name], banned)[0][0], generate(stubs[name], forcing)[0][0]) for name in BACKENDS}
    assert answers["vllm"] == answers["native"]
    without_best, all_forced = answers["vllm"]
    assert expected[0] not in without_best and without_best != expected
    assert all_forced == [forced] * NEW_TOKENS


def _image_item():
    return multimodal_pb2.MultiModalFeatures(items=[multimodal_pb2.MultiModalItem(
        modality=multimodal_pb2.MODALITY_IMAGE, mm_hash="abc",
        placeholder=multimodal_pb2.PlaceholderRange(offset=0, length=1))])


ADMISSION_CASES = {
    "empty prompt": request([]),
    "token out of range": request([1, 2, 5000]),
    "prompt fills the context": request([1] * CONTEXT),
    "max_tokens past the context": request([1, 2], max_tokens=CONTEXT),
    "negative temperature": request([1, 2], temperature=-1.0),
    "top_p zero": request([1, 2], top_p=0.0),
    "min_p above one": request([1, 2], min_p=2.0),
    "top_k below -1": request([1, 2], top_k=-5),
    "n zero": request([1, 2], n=0),
    "n above the limit": request([1, 2], n=1000),
    "top_logprobs above 20": request([1, 2], top_logprobs=21),
    "top_logprobs without logprobs": request([1, 2], top_logprobs=2),
    "repetition_penalty zero": request([1, 2], repetition_penalty=0.0),
    "presence_penalty out of range": request([1, 2], presence_penalty=3.0),
    "stop token out of range": request([1, 2], stop_token_ids=[5000]),
    "min_tokens above max_tokens": request([1, 2], max_tokens=2, min_tokens=3),
    "logit_bias id out of range": request([1, 2], logit_bias={5: 1.0, 5000: 1.0}),
    "logit_bias above 100": request([1, 2], logit_bias={5: 100.5}),
    "logit_bias not a number": request([1, 2], logit_bias={5: float("nan")}),
    "logit_bias too many entries": request([1, 2], logit_bias=dict.fromkeys(range(MAX_LOGIT_BIAS_ENTRIES + 1), 1.0)),
    "media on a text model": engine_pb2.GenerateRequest(token_ids=[1, 2], mm_features=_image_item()),
    "unknown modality enum value": engine_pb2.GenerateRequest(token_ids=[1, 2], mm_features=(
        multimodal_pb2.MultiModalFeatures(items=[multimodal_pb2.MultiModalItem(modality=7)]))),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ADMISSION_CASES, ids=list(ADMISSION_CASES))
def test_admission_is_the_same_for_both_backends(stubs, backend, case):
    """Each backend refuses exactly as the native one does (code, reason, fields)."""
    answers = {}
    for name in ("native", backend):
        with pytest.raises(grpc.RpcError) as exc:
            list(stubs[name].Generate(ADMISSION_CASES[case], timeout=TIMEOUT))
        details = error_details(exc.value)
        answers[name] = (details["code"], details["reason"], details["fields"])
    assert answers[backend] == answers["native"]
    assert answers[backend][0] in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED)
    assert greedy_tokens(stubs[backend], [5, 6, 7])  # the engine still answers


def test_duplicate_ids_and_abort(stubs):
    stub = stubs["vllm"]
    long = request([5, 6, 7], request_id="live", max_tokens=CONTEXT - 3, ignore_eos=True)
    stream = stub.Generate(long, timeout=TIMEOUT)
    first = next(stream)
    assert first.token_ids
    with pytest.raises(grpc.RpcError) as exc:
        list(stub.Generate(request([1, 2], request_id="live"), timeout=TIMEOUT))
    assert error_details(exc.value)["reason"] == "DUPLICATE_REQUEST_ID"
    assert list(stub.Abort(engine_pb2.AbortRequest(request_ids=["live", "unknown"]), timeout=TIMEOUT)
                .aborted_request_ids) == ["live"]
    rest = list(stream)
    assert rest[-1].finish_reason == engine_pb2.FINISH_REASON_ABORT
    assert sum(len(r.token_ids) for r in [first, *rest]) < CONTEXT - 3


def test_encode_is_refused_with_a_reason(stubs):
    with pytest.raises(grpc.RpcError) as exc:
        stubs["vllm"].Encode(engine_pb2.EncodeRequest(mm_features=_image_item()), timeout=TIMEOUT)
    # Admission first: a text-only model encodes nothing, on both backends alike.
    assert error_details(exc.value)["fields"] == ["mm_features.items[0].modality"]


def test_hundred_streams_with_fifty_dropped(stubs):
    """50 of 100 concurrent streams are cancelled at random points; the other 50 equal their solo
    runs and vLLM reports nothing running afterwards."""
    stub = stubs["vllm"]
    batch = [p[:40] for p in prompts(100)]
    solo = {k: greedy_tokens(stub, batch[k]) for k in range(0, 100, 2)}
    rng = random.Random(3)
    drop_after = {k: rng.randint(0, NEW_TOKENS - 2) for k in range(1, 100, 2)}
    results: dict[int, list[int]] = {}
    start = threading.Barrier(100)

    def run(k):
        call = stub.Generate(request(batch[k], max_tokens=NEW_TOKENS, ignore_eos=True), timeout=TIMEOUT)
        start.wait()
        tokens = []
        for response in call:
            tokens.extend(response.token_ids)
            if k in drop_after and len(tokens) > drop_after[k]:
                call.cancel()
                return
        results[k] = tokens

    with ThreadPoolExecutor(100) as pool:
        list(pool.map(run, range(100)))
    assert results == solo
    load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert (load.running_requests, load.waiting_requests, load.kv_blocks_used) == (0, 0, 0)
    assert load.kv_blocks_total > 0 and load.kv_block_size > 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_repeated_prompt_reports_its_cached_tokens(stubs, backend):
    prompt = [(7 * i) % 990 + 3 for i in range(200)]  # at least one full KV block on either backend
    first = generate(stubs[backend], request(prompt, max_tokens=2))[1][0]
    second = generate(stubs[backend], request(prompt, max_tokens=2))[1][0]
    assert first.usage.cached_tokens == 0 and 0 < second.usage.cached_tokens < len(prompt)
    load = stubs[backend].GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert load.prefix_cache_hit_tokens >= second.usage.cached_tokens


STRUCTURED_SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                                      "n": {"type": "integer", "minimum": 0, "maximum": 99},
                                                      "kind": {"enum": ["a", "b"]}},
                     "required": ["name", "n", "kind"], "additionalProperties": False}


@pytest.mark.parametrize("backend", BACKENDS)
def test_structured_outputs_parse_on_both_backends(stubs, backend, tiny_text_model_d64):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_text_model_d64))
    schema = sampling_pb2.StructuredOutput(json_schema=json.dumps(STRUCTURED_SCHEMA))
    choice = sampling_pb2.StructuredOutput(choice=sampling_pb2.ChoiceConstraint(choices=["yes", "no"]))
    regex = sampling_pb2.StructuredOutput(regex=r"[a-z]{3}-\d{2}")
    calls = [(schema, 0.0), (schema, 1.0), (choice, 1.0), (regex, 1.0)]
    with ThreadPoolExecutor(len(calls)) as pool:
        results = list(pool.map(lambda call: generate(stubs[backend], request(
            prompts(1)[0], max_tokens=128, temperature=call[1], seed=3, structured_output=call[0])), calls))
    texts = []
    for tokens, finals in results:
        assert finals[0].finish_reason == engine_pb2.FINISH_REASON_STOP
        texts.append(tokenizer.decode(tokens[0], skip_special_tokens=True))
    for text in texts[:2]:
        jsonschema.validate(json.loads(text), STRUCTURED_SCHEMA)
    assert texts[2] in ("yes", "no")
    assert re.fullmatch(r"[a-z]{3}-\d{2}", texts[3])
    with pytest.raises(grpc.RpcError) as caught:
        generate(stubs[backend], request(prompts(1)[0], max_tokens=8,
                                         structured_output=sampling_pb2.StructuredOutput(regex="a(b")))
    details = error_details(caught.value)
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT and details["reason"] == "INVALID_STRUCTURED_OUTPUT"
    assert details["fields"] == ["sampling_params.structured_output.regex"]


def test_smg_face_serves_the_vllm_backend_as_the_native_one(channels, stubs, tiny_text_model_d64):
    """SMG's vllm.grpc.engine.VllmEngine on both backends: the same greedy tokens as tito.v1's
    Generate, a stop token and a stop string ending the choice (the latter with the prompt's
    prefix-cache hit in its usage, as the same request without it reports), the same refusal with
    SMG's field names."""
    from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

    from smg_calls import read_stream, smg_request, text_stop

    tokenizer = AutoTokenizer.from_pretrained(tiny_text_model_d64)

    prompt = prompts(1)[0]
    expected, _ = collect(stubs["native"].Generate(request(prompt, max_tokens=NEW_TOKENS, ignore_eos=True),
                                                   timeout=TIMEOUT))
    for name, channel in channels.items():
        smg = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        for stream in (True, False):
            got = read_stream(smg.Generate(smg_request(prompt, request_id=f"{name}-{stream}", max_tokens=NEW_TOKENS,
                                                       ignore_eos=True, stream=stream), timeout=TIMEOUT))
            assert got.tokens() == expected[0], (name, stream)
            assert got.completes[0].finish_reason == "length"
        stopped = read_stream(smg.Generate(smg_request(prompt, request_id=f"{name}-stop", max_tokens=NEW_TOKENS,
                                                       ignore_eos=True, stop_token_ids=[expected[0][4]]),
                                           timeout=TIMEOUT))
        assert stopped.completes[0].matched_token_id == expected[0][4]
        assert stopped.tokens() == expected[0][:expected[0].index(expected[0][4]) + 1]
        # The longest prompt: more than one of vLLM's 128-token CPU blocks, so a second run finds one cached.
        long_prompt = max(prompts(), key=len)
        plain = [read_stream(smg.Generate(smg_request(long_prompt, request_id=f"{name}-plain-{run}",
                                                      max_tokens=NEW_TOKENS, ignore_eos=True, stream=False),
                                          timeout=TIMEOUT)) for run in range(2)][1]
        assert plain.completes[0].cached_tokens > 0, name  # the first run left the prompt's blocks cached
        stop = text_stop(tokenizer, plain.tokens(), 6)
        for stream in (True, False):
            ended = read_stream(smg.Generate(smg_request(long_prompt, request_id=f"{name}-text-stop-{stream}",
                                                         max_tokens=NEW_TOKENS, ignore_eos=True, stop=[stop],
                                                         stream=stream), timeout=TIMEOUT)).completes[0]
            assert ended.matched_stop_str == stop, (name, stream)
            assert ended.cached_tokens == plain.completes[0].cached_tokens, (name, stream)
        with pytest.raises(grpc.RpcError) as caught:
            list(smg.Generate(smg_request([5, 5000], request_id=f"{name}-bad"), timeout=TIMEOUT))
        details = error_details(caught.value)
        assert details["reason"] == "TOKEN_ID_OUT_OF_RANGE" and details["fields"] == ["tokenized.input_ids[1]"]
        load = smg.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT).loads[0]
        assert load.num_running_reqs == 0 and load.max_running_requests == 64
