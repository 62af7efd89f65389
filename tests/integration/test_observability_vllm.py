"""The engine's series with `--backend vllm`: the same request-level histograms and counters as the
native backend (measured in tito's engine service), queue time from vLLM's RequestStateStats, and
the load gauges from vLLM's scheduler statistics."""

from __future__ import annotations

import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tito.v1 import engine_pb2_grpc
from tito_engine.config import EngineConfig
from tito_engine.server import create_server

from engine_calls import collect, request

pytestmark = pytest.mark.vllm

TIMEOUT = 120
VLLM_ARGS = ("--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.05")


def test_vllm_backend_feeds_the_engine_series(aio_server, tiny_text_model_d64):
    server = aio_server(lambda: create_server(EngineConfig(
        model=str(tiny_text_model_d64), backend="vllm", kv_cache_bytes=32 << 20, vllm_args=VLLM_ARGS,
        max_model_len=512, metrics_port=0)))
    stub = engine_pb2_grpc.EngineServiceStub(server.channel())
    prompt = [(7 * i) % 990 + 3 for i in range(200)]  # a repeat reuses at least one full KV block
    for _ in range(2):
        collect(stub.Generate(request(prompt, max_tokens=4, ignore_eos=True), timeout=TIMEOUT))
    generated = ("tito_grpc_requests_total", (("code", "OK"), ("method", "/tito.v1.EngineService/Generate")))
    deadline = time.monotonic() + 10
    while True:  # the server records a call a moment after the client has its last message
        with urllib.request.urlopen(f"http://{server.running.metrics.address}/metrics", timeout=10) as reply:
            samples = {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
                       for family in text_string_to_metric_families(reply.read().decode()) for sample in family.samples}
        if samples.get(generated, 0) >= 2 or time.monotonic() > deadline:
            break
        time.sleep(0.02)
    for histogram in ("queue_time", "time_to_first_token", "time_per_output_token", "e2e_request_latency"):
        assert samples[(f"tito_engine_{histogram}_seconds_count", ())] == 2, histogram
    assert samples[("tito_engine_generation_tokens_total", ())] == 8
    assert samples[("tito_engine_prompt_tokens_total", ())] == 400
    assert samples[("tito_engine_prefix_cache_hits_total", ())] > 0
    assert samples[("tito_engine_kv_blocks_total", ())] > 0
    assert samples[("tito_engine_requests_running", ())] == 0
    assert samples[("tito_grpc_requests_total", (("code", "OK"), ("method", "/tito.v1.EngineService/Generate")))] == 2
