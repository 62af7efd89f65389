"""Llama, Qwen3 and Qwen2.5-VL served over real gRPC by the native engine: greedy tokens equal
Hugging Face `generate`, for one request alone and for many of different lengths batched
continuously (each request starts once the previous one streams, so they join at different steps).

Qwen2.5-VL requests are built by render's own domain code (chat template, image processor, video
frames with their fps -> second_per_grid_ts); the reference is `generate` on the same ids,
pixel values, grids, mm_token_type_ids and second_per_grid_ts.
"""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from tito import tensors
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, render_pb2, sampling_pb2
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_render.renderer import Renderer
from tito_render.convert import chat_response

from chat_parts import image, text, video
from renderers import load_renderer
import vl_reference

TIMEOUT = 120


def start_engine(module_aio_server, model_dir):
    config = EngineConfig(model=str(model_dir), device="cpu", engine_process=False, kv_blocks=400, block_size=16)
    server = module_aio_server(lambda: create_server(config))
    return engine_pb2_grpc.EngineServiceStub(server.channel())


def generate(stub, request) -> list[int]:
    return [token for response in stub.Generate(request, timeout=TIMEOUT) for token in response.token_ids]


def generate_staggered(stub, requests) -> tuple[list, int]:
    """Each request starts once the previous one streams its first token; (results, how many
    requests were still streaming when the next one started)."""
    results: list = [None] * len(requests)
    spans: list = [None] * len(requests)
    threads = []

    def run(index: int, started: threading.Event) -> None:
        tokens, first = [], None
        try:
            for response in stub.Generate(requests[index], timeout=TIMEOUT):
                tokens.extend(response.token_ids)
                first = first or time.monotonic()
                started.set()
            spans[index] = (first, time.monotonic())
            results[index] = tokens
        except BaseException as exc:  # noqa: BLE001 - compared below
            results[index] = exc
        finally:
            started.set()

    for index in range(len(requests)):
        started = threading.Event()
        thread = threading.Thread(target=run, args=(index, started))
        thread.start()
        threads.append(thread)
        started.wait(TIMEOUT)
    for thread in threads:
        thread.join(TIMEOUT)
    overlapping = sum(1 for k in range(1, len(spans))
                      if spans[k] and spans[k - 1] and spans[k][0] < spans[k - 1][1])
    return results, overlapping


# --------------------------------------------------------------------------- text families


TEXT_FAMILIES = ["tiny_llama_model", "tiny_qwen3_model"]


@pytest.fixture(scope="module", params=TEXT_FAMILIES)
def text_family(request, module_aio_server):
    model_dir = request.getfixturevalue(request.param)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return start_engine(module_aio_server, model_dir), model


def text_request(prompt: list[int], max_tokens: int) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(token_ids=prompt, sampling_params=sampling_pb2.SamplingParams(
        temperature=0.0, max_tokens=max_tokens))


def hf_text_greedy(model, request: engine_pb2.GenerateRequest) -> list[int]:
    """generate stops after the model's EOS ids (generation_config), as the engine does."""
    ids = torch.tensor([list(request.token_ids)])
    with torch.inference_mode():
        output = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=request.sampling_params.max_tokens)
    return output[0, ids.shape[1]:].tolist()


def test_text_prompt_alone_equals_hf_generate(text_family):
    stub, model = text_family
    request = text_request([(13 * j + 5) % 1000 for j in range(23)], 24)
    tokens = generate(stub, request)
    assert tokens == hf_text_greedy(model, request) and len(set(tokens)) > 3


def test_twelve_prompts_of_different_lengths_batched_equal_hf(text_family):
    stub, model = text_family
    rng = np.random.RandomState(5)
    requests = [text_request(rng.randint(0, 1000, size=int(rng.randint(1, 60))).tolist(), int(rng.randint(8, 32)))
                for _ in range(12)]
    expected = [hf_text_greedy(model, request) for request in requests]
    results, overlapping = generate_staggered(stub, requests)
    assert results == expected
    assert overlapping >= len(requests) // 2  # they really ran batched together
    load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert load.running_requests == 0 and load.kv_blocks_used == 0


# --------------------------------------------------------------------------- Qwen2.5-VL




def render(renderer: Renderer, *parts, max_tokens: int = 16) -> engine_pb2.GenerateRequest:
    return chat_response(renderer, render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=list(parts))],
        sampling=render_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0))).generate_request


def hf_vl_greedy(model, request: engine_pb2.GenerateRequest) -> list[int]:
    """Qwen2.5-VL's HF reference: videos carry their time axis (second_per_grid_ts)."""
    return vl_reference.hf_vl_greedy(model, request, video_seconds=True)


@pytest.fixture(scope="module")
def vl_renderer(tiny_qwen2_5_vl_model) -> Renderer:
    return load_renderer(tiny_qwen2_5_vl_model)


@pytest.fixture(scope="module")
def vl_model(tiny_qwen2_5_vl_model):
    return AutoModelForImageTextToText.from_pretrained(tiny_qwen2_5_vl_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def vl_engine(module_aio_server, tiny_qwen2_5_vl_model):
    return start_engine(module_aio_server, tiny_qwen2_5_vl_model)


def test_image_alone_equals_hf_generate(vl_engine, vl_renderer, vl_model):
    # 140 x 84 pixels: a 10 x 6 patch grid, several of the vision tower's 4 x 4-patch windows.
    request = render(vl_renderer, text("Describe:"), image(140, 84, seed=1), text("Briefly."), max_tokens=24)
    assert request.mm_features.items[0].metadata["image_grid_thw"]
    tokens = generate(vl_engine, request)
    assert tokens == hf_vl_greedy(vl_model, request) and len(set(tokens)) > 3


@pytest.mark.parametrize("fps", [2.0, 0.5, 0.0])
def test_video_alone_equals_hf_generate(vl_engine, vl_renderer, vl_model, fps):
    # 6 frames -> 3 time steps; at fps 0.5 each spans 4 s: the time axis steps by 8 positions and
    # reaches past the text after the video, which decoding must continue after as generate does.
    request = render(vl_renderer, text("Clip:"), video(6, fps, seed=20), text("What moves?"), max_tokens=20)
    (item,) = request.mm_features.items
    seconds = tensors.to_torch(item.metadata["second_per_grid_ts"])
    assert seconds.dtype == torch.float32 and seconds.tolist() == [np.float32(2 / (fps or 24))]
    tokens = generate(vl_engine, request)
    assert tokens == hf_vl_greedy(vl_model, request) and len(set(tokens)) > 3


def test_mixed_media_and_text_requests_batched_equal_hf(vl_engine, vl_renderer, vl_model):
    requests = []
    for k in range(10):
        words = " ".join(["sea", "sky", "stone", "leaf", "wind"][: 1 + k % 5])
        if k % 3 == 0:
            requests.append(render(vl_renderer, text(f"Plain {k}: {words}"), max_tokens=12 + k))
        elif k % 3 == 1:
            requests.append(render(vl_renderer, image(56 + 28 * (k % 4), 84, seed=40 + k), text(words),
                                   max_tokens=12 + k))
        else:
            requests.append(render(vl_renderer, video(2 + k % 4, 1.0 + k % 3, seed=60 + k), text(words),
                                   image(56, 56, seed=80 + k), max_tokens=12 + k))
    expected = [hf_vl_greedy(vl_model, request) for request in requests]
    results, overlapping = generate_staggered(vl_engine, requests)
    assert results == expected
    assert overlapping >= len(requests) // 2
