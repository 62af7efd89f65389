"""GetServerInfo on the SMG face of the vllm backend: `mm_encoder_budget` is vLLM's own encoder
budget (what its MultiModalBudget helper gives for the engine's config) where that is smaller than
what admission takes (the context, the KV cache), as here with a 256-token prefill budget."""

from __future__ import annotations

import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_engine.vllm.args import build_engine_args
from tito_models.tiny import VL_MODEL_D64, ensure_model

pytestmark = pytest.mark.vllm

TIMEOUT = 180
CONTEXT = 1024


def test_the_encoder_budget_is_vllms_own_when_smaller(module_aio_server, model_cache):
    from vllm.multimodal import MULTIMODAL_REGISTRY
    from vllm.multimodal.encoder_budget import MultiModalBudget

    model = ensure_model(VL_MODEL_D64, model_cache)  # head_dim 64: vLLM's CPU attention refuses 16
    config = EngineConfig(model=str(model), backend="vllm", max_model_len=CONTEXT, kv_cache_bytes=64 << 20,
                          max_prefill_tokens_per_step=256, vllm_args=("--dtype", "float32", "--enforce-eager"))
    vllm_budget = MultiModalBudget(build_engine_args(config, str(model)).create_engine_config(), MULTIMODAL_REGISTRY,
                                   enable_cache=False).get_encoder_budget()
    smg = vllm_engine_pb2_grpc.VllmEngineStub(module_aio_server(lambda: create_server(config)).channel())
    kv_tokens = smg.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT).loads[0].max_total_num_tokens
    assert 0 < vllm_budget < min(CONTEXT, kv_tokens) - 1  # vLLM's budget binds here
    server = smg.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=TIMEOUT)
    assert server.mm_encoder_budget == vllm_budget
