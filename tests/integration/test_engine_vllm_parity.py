"""Greedy parity of `--backend vllm` as a user starts it: tito's vllm backend == vLLM's own AsyncLLM
== the native engine, on synthetic id sequences (short and >= 512 tokens), alone and at 32 at once.

The tito server here is given no --dtype and no vLLM argument but `--enforce-eager` (both vLLMs
run eager, to keep their start-up short on a small CPU): the defaults are what is under test.
(vLLM's own `auto` computes a float32 checkpoint in bfloat16 on CPU; tito's `auto` keeps
float32 on both backends, and a backend left on vLLM's rule parted from the native engine's
tokens within a few steps on these prompts.) The reference AsyncLLM is vLLM configured by hand
for this checkpoint (float32), built without any tito code.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from tito.v1 import engine_pb2, engine_pb2_grpc
from tito_engine.config import EngineConfig
from tito_engine.server import create_server

from engine_calls import collect, request
from vllm_reference import AsyncLLMReference

pytestmark = pytest.mark.vllm

TIMEOUT = 600  # a vLLM start-up on a busy 2-core machine
NEW_TOKENS = 12
KV_BYTES = 32 << 20
CONCURRENCY = 32


def synthetic(index: int, length: int) -> list[int]:
    """An arithmetic id sequence (no natural text): the shape that exposed the dtype mismatch."""
    return [(7 * index + 3 * j) % 900 + 10 for j in range(length)]


#: 32 prompts: the issue's three short ones, then lengths up to 1,000 tokens, half of them >= 512.
PROMPTS = [synthetic(i, 5 + 11 * i) for i in range(3)] + [
    synthetic(i, 512 + 37 * i if i % 2 else 24 + 13 * i) for i in range(3, CONCURRENCY)]


@pytest.fixture(scope="module")
def stubs(module_aio_server, tiny_text_model_d64):
    configs = {
        "native": EngineConfig(model=str(tiny_text_model_d64), device="cpu", engine_process=False),
        # `tito serve engine --backend vllm --model M --kv-cache-bytes N -- --enforce-eager`: no --dtype.
        "vllm": EngineConfig(model=str(tiny_text_model_d64), backend="vllm", kv_cache_bytes=KV_BYTES,
                             vllm_args=("--enforce-eager",)),
    }
    return {name: engine_pb2_grpc.EngineServiceStub(
        module_aio_server(lambda config=config: create_server(config), timeout=TIMEOUT).channel())
        for name, config in configs.items()}


@pytest.fixture(scope="module")
def asyncllm(tiny_text_model_d64):
    reference = AsyncLLMReference(str(tiny_text_model_d64), TIMEOUT, dtype="float32", kv_cache_memory_bytes=KV_BYTES,
                                  max_num_seqs=64)
    yield reference
    reference.close()


def _greedy(stub, prompt: list[int]) -> list[int]:
    return collect(stub.Generate(request(prompt, max_tokens=NEW_TOKENS, ignore_eos=True), timeout=TIMEOUT))[0][0]


def _alone(stub) -> list[list[int]]:
    return [_greedy(stub, prompt) for prompt in PROMPTS]


def _together(stub) -> list[list[int]]:
    with ThreadPoolExecutor(CONCURRENCY) as pool:
        return list(pool.map(lambda prompt: _greedy(stub, prompt), PROMPTS))


def _first_difference(left: list[list[int]], right: list[list[int]]) -> str:
    for index, (a, b) in enumerate(zip(left, right, strict=True)):
        if a != b:
            step = next(step for step, (x, y) in enumerate(zip(a, b)) if x != y)
            return f"prompt {index} ({len(PROMPTS[index])} tokens) parts at token {step + 1}: {a[step]} vs {b[step]}"
    return "equal"


def test_the_prompts_cover_short_and_long_synthetic_sequences():
    lengths = [len(prompt) for prompt in PROMPTS]
    assert len(PROMPTS) == CONCURRENCY and min(lengths) == 5
    assert sum(length >= 512 for length in lengths) >= 12 and max(lengths) >= 1000


def test_vllm_backend_defaults_compute_what_the_native_engine_computes(stubs):
    infos = {name: stub.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
             for name, stub in stubs.items()}
    assert infos["vllm"].dtype == infos["native"].dtype == "float32"


@pytest.mark.parametrize("concurrency", [1, CONCURRENCY])
def test_greedy_tokens_equal_vllm_s_own_asyncllm_and_the_native_engine(stubs, asyncllm, concurrency):
    run = _alone if concurrency == 1 else _together
    reference = (asyncllm.alone if concurrency == 1 else asyncllm.together)(PROMPTS, NEW_TOKENS, ignore_eos=True)
    native = run(stubs["native"])
    backend = run(stubs["vllm"])
    assert all(len(tokens) == NEW_TOKENS for tokens in reference)
    assert reference == native, f"vLLM's AsyncLLM vs native: {_first_difference(reference, native)}"
    assert backend == reference, f"--backend vllm vs vLLM's AsyncLLM: {_first_difference(backend, reference)}"
