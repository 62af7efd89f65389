"""LoRA adapters on the vllm backend (vLLM's own LoRA support behind tito's RPCs and lora_name),
side by side with the native backend on tiny-qwen2-d64 in float32: greedy tokens under each of two
PEFT adapters (one loaded at start, one at run time) equal HF + PEFT's and the native engine's,
and the refusals are the native engine's."""

from __future__ import annotations

import grpc
import pytest

from engine_calls import collect, request
from lora_adapters import AdapterSpec, PeftReference, make_adapter
from tito.grpc_errors import error_details
from tito.v1 import engine_pb2_grpc
from tito_client import LoraAdapters
from tito_engine.config import EngineConfig
from tito_engine.server import create_server

pytestmark = pytest.mark.vllm

TIMEOUT = 120
VLLM_ARGS = ("--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.05")
SPECS = (AdapterSpec("attn", 8, ("q_proj", "v_proj"), seed=21),
         AdapterSpec("every", 16, ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"),
                     seed=22, rslora=True))
PROMPT = [17, 230, 5, 981, 44, 12, 600, 7, 333]


@pytest.fixture(scope="module")
def adapters(tiny_text_model_d64, tmp_path_factory):
    root = tmp_path_factory.mktemp("vllm-lora")
    return root, {spec.name: make_adapter(tiny_text_model_d64, spec, root / spec.name, scale=0.1) for spec in SPECS}


@pytest.fixture(scope="module")
def engines(module_aio_server, tiny_text_model_d64, adapters):
    """Both backends, "attn" loaded at start; name -> (stub, LoraAdapters)."""
    root, _ = adapters
    common = dict(model=str(tiny_text_model_d64), max_model_len=256, lora_dir=str(root), lora_modules=("attn=attn",),
                  max_loras=2)
    configs = {"native": EngineConfig(device="cpu", engine_process=False, **common),
               "vllm": EngineConfig(backend="vllm", kv_cache_bytes=32 << 20, vllm_args=VLLM_ARGS, **common)}
    started = {}
    for name, config in configs.items():
        channel = module_aio_server(lambda config=config: create_server(config), timeout=600).channel()
        started[name] = (engine_pb2_grpc.EngineServiceStub(channel), LoraAdapters(channel, timeout=TIMEOUT))
    return started


def _tokens(stub, lora_name="", max_tokens=8):
    message = request(PROMPT, max_tokens=max_tokens)
    message.lora_name = lora_name
    return collect(stub.Generate(message, timeout=TIMEOUT))[0][0]


def test_adapters_give_peft_s_tokens_on_both_backends(engines, adapters, tiny_text_model_d64):
    _, directories = adapters
    reference = PeftReference(tiny_text_model_d64, directories)
    engines["vllm"][1].load("every", "every")
    engines["native"][1].load("every", "every")
    for name in (None, "attn", "every"):
        expected = reference.generate(name, PROMPT, 8)
        for backend, (stub, _) in engines.items():
            assert _tokens(stub, name or "") == expected, (backend, name)
    assert [adapter.name for adapter in engines["vllm"][1].list()] == ["attn", "every"]


def test_the_vllm_backend_refuses_as_the_native_engine_does(engines):
    for backend, (stub, adapters) in engines.items():
        with pytest.raises(grpc.RpcError) as unknown:
            _tokens(stub, "nowhere")
        with pytest.raises(grpc.RpcError) as outside:
            adapters.load("x", "../elsewhere")
        with pytest.raises(grpc.RpcError) as twice:
            adapters.load("attn", "attn")
        got = [(error_details(e.value)["code"], error_details(e.value)["reason"]) for e in (unknown, outside, twice)]
        assert got == [(grpc.StatusCode.NOT_FOUND, "LORA_ADAPTER_NOT_FOUND"),
                       (grpc.StatusCode.INVALID_ARGUMENT, "LORA_PATH_NOT_ALLOWED"),
                       (grpc.StatusCode.ALREADY_EXISTS, "LORA_ADAPTER_EXISTS")], backend
        assert adapters.unload("attn") == 0
        with pytest.raises(grpc.RpcError) as gone:
            _tokens(stub, "attn")
        assert error_details(gone.value)["reason"] == "LORA_ADAPTER_NOT_FOUND", backend
        adapters.load("attn", "attn")
