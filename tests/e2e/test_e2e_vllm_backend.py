"""End to end on the vllm backend: render -> `tito serve engine --backend vllm` -> derender as processes.

A text chat's greedy answer must be HF's, token for token and as text, and so must a chat with an
image on the tiny Qwen2-VL (`tiny-qwen2-vl-d64`), render signing its items and the vLLM engine
requiring signed features (on CPU, vLLM's Qwen2-VL needs the torchvision of the vLLM install:
tito/torchvision_cpu.py).
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from tito_cli.main import SERVICES, stop_all
from tito_client.pipeline import ChatPipeline, Endpoints
from tito_models.tiny import VL_MODEL_D64, ensure_model
from tito.v1 import chat_pb2

from chat_checks import assert_chat_is_hf_greedy
from images import noise_data_url as data_url
from service_processes import running_services, signed_media_args
from test_e2e_multimodal import chat_request, hf_greedy
from vllm_serve import TITO_VLLM_BACKEND_ARGS

pytestmark = [pytest.mark.e2e, pytest.mark.vllm]

VLLM_ENGINE_ARGS = ["--max-model-len", "1024", *TITO_VLLM_BACKEND_ARGS]


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


@pytest.fixture(scope="module")
def vl_services(model_cache, tmp_path_factory):
    model = ensure_model(VL_MODEL_D64, model_cache)
    directory = tmp_path_factory.mktemp("vllm-vl-sockets")
    extra = signed_media_args(directory, key="e2e-vllm-shared-key-0123456789abcdef", engine_args=VLLM_ENGINE_ARGS)
    with running_services(model, directory, extra_args=extra) as (addresses, _):
        yield model, addresses


def test_an_image_chat_streams_hf_greedy_text_through_the_vllm_backend(vl_services):
    model_dir, addresses = vl_services
    request = chat_request(data_url(84, 56, seed=3))
    with ChatPipeline(Endpoints(**addresses), timeout=180) as pipeline:
        rendered = pipeline.render.RenderChat(request, timeout=60)
        item = rendered.generate_request.mm_features.items[0]
        assert item.auth_tag and item.kwargs["pixel_values"].data  # signed, with tensors
        chunks = list(pipeline.stream_chat(request))
    model = AutoModelForImageTextToText.from_pretrained(model_dir, dtype=torch.float32).eval()
    expected = hf_greedy(model, rendered.generate_request)
    assert len(set(expected)) > 1
    content = "".join(chunk.content for chunk in chunks)
    assert content == AutoTokenizer.from_pretrained(model_dir).decode(expected, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(expected)
