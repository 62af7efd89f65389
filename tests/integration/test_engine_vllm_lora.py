"""LoRA adapters on the vllm backend (vLLM's own LoRA support behind tito's RPCs and lora_name) on
tiny-qwen2-d64 and tiny-llama-d64 (Llama 3.1's rotary scaling) in float32, with three PEFT adapters
each (rank 8 and 16; attention, MLP, every projection with rslora; one loaded at start, two at run
time): greedy tokens under each adapter and the base model, alone and all four in flight at once,
equal vLLM's own AsyncLLM generating with `LoRARequest` (configured by hand, no tito code), HF +
PEFT's and the native engine's; the refusals are the native engine's. The Llama is the head_dim 64
one: vLLM's CPU attention kernels have no head_dim 16, so vLLM cannot serve tiny-llama at all.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import grpc
import pytest

from engine_calls import collect, request
from lora_adapters import ADAPTERS, PeftReference, make_adapter
from tito.grpc_errors import error_details
from tito.v1 import engine_pb2_grpc
from tito_client import LoraAdapters
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from vllm_reference import AsyncLLMReference

pytestmark = pytest.mark.vllm

TIMEOUT = 120
KV_BYTES = 32 << 20
VLLM_ARGS = ("--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.05")
NAMES = [spec.name for spec in ADAPTERS]
FIRST, *LATER = NAMES
CASES = (None, *NAMES)  # None: the base model
# One LoRA slot more than adapters, on both vLLMs: vLLM 0.32's CPU LoRA ops read a base row's slot
# index -1 as the last slot (vllm-project/vllm PR 48421, open), so with every slot filled the base
# rows of a mixed batch get the last slot's adapter; an empty last slot holds zeros.
VLLM_LORA_SLOTS = len(NAMES) + 1
PROMPT = [17, 230, 5, 981, 44, 12, 600, 7, 333]
MAX_TOKENS = 8
#: The base models both backends load (head_dim 64), by the conftest fixture that builds each.
FAMILIES = {"qwen2": "tiny_text_model_d64", "llama": "tiny_llama_model_d64"}


@pytest.fixture(scope="module", params=list(FAMILIES))
def base_model(request) -> Path:
    """Each family's base model in turn; every fixture below is built once per family."""
    return request.getfixturevalue(FAMILIES[request.param])


@pytest.fixture(scope="module")
def adapters(base_model, tmp_path_factory):
    # Scale 0.1: enough to move d64's greedy tokens, small enough that float32 kernels agree.
    root = tmp_path_factory.mktemp(f"vllm-lora-{base_model.name}")
    return root, {spec.name: make_adapter(base_model, spec, root / spec.name, scale=0.1) for spec in ADAPTERS}


@pytest.fixture(scope="module")
def engines(module_aio_server, base_model, adapters):
    """Both backends, the first adapter loaded at start; name -> (stub, LoraAdapters)."""
    root, _ = adapters
    common = dict(model=str(base_model), max_model_len=256, lora_dir=str(root),
                  lora_modules=(f"{FIRST}={FIRST}",))
    configs = {"native": EngineConfig(device="cpu", engine_process=False, max_loras=len(NAMES), **common),
               "vllm": EngineConfig(backend="vllm", kv_cache_bytes=KV_BYTES, vllm_args=VLLM_ARGS,
                                    max_loras=VLLM_LORA_SLOTS, **common)}
    started = {}
    for name, config in configs.items():
        channel = module_aio_server(lambda config=config: create_server(config), timeout=600).channel()
        started[name] = (engine_pb2_grpc.EngineServiceStub(channel), LoraAdapters(channel, timeout=TIMEOUT))
    return started


@pytest.fixture(scope="module")
def loaded(engines):
    """Both backends holding all three adapters, the other two loaded at run time."""
    for _, lora in engines.values():
        for name in LATER:
            lora.load(name, name)
    return engines


@pytest.fixture(scope="module")
def peft_tokens(adapters, base_model) -> dict:
    reference = PeftReference(base_model, adapters[1])
    return {name: reference.generate(name, PROMPT, MAX_TOKENS) for name in CASES}


@pytest.fixture(scope="module")
def vllm_own(base_model, adapters):
    """vLLM's own engine with LoRA enabled by hand, and a LoRARequest per adapter; shut down when
    its family's tests end (its processes and memory)."""
    from vllm.lora.request import LoRARequest

    reference = AsyncLLMReference(str(base_model), 600, dtype="float32", kv_cache_memory_bytes=KV_BYTES,
                                  enable_lora=True, max_loras=VLLM_LORA_SLOTS, max_lora_rank=16)
    requests = {name: LoRARequest(name, lora_id, str(directory))
                for lora_id, (name, directory) in enumerate(adapters[1].items(), start=1)}
    yield reference, requests
    reference.close()


def _tokens(stub, lora_name="", max_tokens=MAX_TOKENS):
    message = request(PROMPT, max_tokens=max_tokens)
    message.lora_name = lora_name
    return collect(stub.Generate(message, timeout=TIMEOUT))[0][0]


def _alone(stub) -> list[list[int]]:
    return [_tokens(stub, name or "") for name in CASES]


def _together(stub) -> list[list[int]]:
    """Every case's Generate in flight at once (the engines batch them, adapters mixed)."""
    with ThreadPoolExecutor(len(CASES)) as pool:
        return list(pool.map(lambda name: _tokens(stub, name or ""), CASES))


def test_each_adapter_moves_peft_s_tokens(peft_tokens):
    # Otherwise an engine that ignored lora_name would pass the equalities below.
    assert len({tuple(tokens) for tokens in peft_tokens.values()}) == len(CASES), peft_tokens


@pytest.mark.parametrize("mode", ["alone", "together"])
def test_vllm_backend_equals_vllm_s_own_lora_requests_and_peft(loaded, vllm_own, peft_tokens, mode):
    reference, requests = vllm_own
    loras = [requests.get(name) for name in CASES]
    own = getattr(reference, mode)([PROMPT] * len(CASES), MAX_TOKENS, loras=loras)
    run = _alone if mode == "alone" else _together
    got = {backend: run(stub) for backend, (stub, _) in loaded.items()}
    expected = [peft_tokens[name] for name in CASES]
    assert dict(zip(CASES, got["vllm"])) == dict(zip(CASES, own)), "--backend vllm vs vLLM's own LoRARequest"
    assert dict(zip(CASES, got["vllm"])) == dict(zip(CASES, expected)), "--backend vllm vs HF + PEFT"
    assert dict(zip(CASES, got["native"])) == dict(zip(CASES, expected)), "native vs HF + PEFT"
    assert sorted(adapter.name for adapter in loaded["vllm"][1].list()) == sorted(NAMES)


def test_the_vllm_backend_refuses_as_the_native_engine_does(engines):
    for backend, (stub, adapters) in engines.items():
        with pytest.raises(grpc.RpcError) as unknown:
            _tokens(stub, "nowhere")
        with pytest.raises(grpc.RpcError) as outside:
            adapters.load("x", "../elsewhere")
        with pytest.raises(grpc.RpcError) as twice:
            adapters.load(FIRST, FIRST)
        got = [(error_details(e.value)["code"], error_details(e.value)["reason"]) for e in (unknown, outside, twice)]
        assert got == [(grpc.StatusCode.NOT_FOUND, "LORA_ADAPTER_NOT_FOUND"),
                       (grpc.StatusCode.INVALID_ARGUMENT, "LORA_PATH_NOT_ALLOWED"),
                       (grpc.StatusCode.ALREADY_EXISTS, "LORA_ADAPTER_EXISTS")], backend
        assert adapters.unload(FIRST) == 0
        with pytest.raises(grpc.RpcError) as gone:
            _tokens(stub, FIRST)
        assert error_details(gone.value)["reason"] == "LORA_ADAPTER_NOT_FOUND", backend
        adapters.load(FIRST, FIRST)
