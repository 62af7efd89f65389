"""GetServerInfo on the SMG face of a vision engine whose KV cache is smaller than its context:
`mm_encoder_budget` (what SMG holds each preprocessed media item to) is the largest item the
engine admits, here the KV cache's tokens less one, beside the media limits SMG reads."""

from __future__ import annotations

from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

from tito_engine.config import EngineConfig
from tito_engine.server import create_server

TIMEOUT = 60
CONTEXT = 1024


def test_the_encoder_budget_is_the_largest_item_the_engine_admits(module_aio_server, tiny_vl_model):
    config = EngineConfig(model=str(tiny_vl_model), device="cpu", engine_process=False, max_model_len=CONTEXT,
                          kv_cache_bytes=1 << 18, max_mm_items=3)
    smg = vllm_engine_pb2_grpc.VllmEngineStub(module_aio_server(lambda: create_server(config)).channel())
    load = smg.GetLoads(vllm_engine_pb2.GetLoadsRequest(), timeout=TIMEOUT).loads[0]
    kv_tokens = load.max_total_num_tokens
    assert 0 < kv_tokens < CONTEXT  # the KV cache binds here, not the context
    server = smg.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=TIMEOUT)
    assert server.mm_encoder_budget == kv_tokens - 1
    assert server.mm_item_limits == "image=3,video=3"
    assert server.block_size and kv_tokens % server.block_size == 0
