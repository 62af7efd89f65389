"""Qwen3-VL served over real gRPC by the native engine, requests built by render's own domain code
(chat template, image processor, timestamped video spans): greedy tokens equal Hugging Face
`generate` for an image, a video at two frame rates, an image + video chat and a mixed batch
joining at different steps (prefill chunks of 16 tokens, so spans are cut); one video's ids with
another video's features answer like the other video; a METADATA request after a TENSORS one hits
the encoder cache (DeepStack included: the descriptor's shape holds the levels).
"""

from __future__ import annotations

import threading

import pytest
import torch
from transformers import AutoModelForImageTextToText

from tito import signing
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, multimodal_pb2, render_pb2
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_render.media.features import Signer
from tito_render.renderer import Renderer
from tito_render.convert import chat_response

import chat_parts
from chat_parts import image, text
from renderers import load_renderer
from vl_reference import hf_vl_greedy

TIMEOUT = 120
KEY, KEY_ID = b"qwen3-vl-engine-test-key-0123456789", "k1"
TENSORS, METADATA = multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA


def video(frames: int, fps: float, seed: int, width: int = 64, height: int = 64) -> chat_pb2.ContentPart:
    """Qwen3-VL's videos here: 64x64 frames unless told (two merged 32-pixel patches a side)."""
    return chat_parts.video(frames, fps, seed, width, height)


def render(renderer: Renderer, *parts, max_tokens: int = 16, payload: int = TENSORS) -> engine_pb2.GenerateRequest:
    return chat_response(renderer, render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=list(parts))], mm_payload=payload,
        sampling=render_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0))).generate_request


def generate(stub, request) -> list[int]:
    return [token for response in stub.Generate(request, timeout=TIMEOUT) for token in response.token_ids]


@pytest.fixture(scope="module")
def renderer(tiny_qwen3_vl_model) -> Renderer:
    return load_renderer(tiny_qwen3_vl_model, signer=Signer(KEY, KEY_ID))


@pytest.fixture(scope="module")
def hf_model(tiny_qwen3_vl_model):
    return AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine(module_aio_server, tiny_qwen3_vl_model, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "hmac.key"
    key_file.write_bytes(KEY + b"\n")
    config = EngineConfig(model=str(tiny_qwen3_vl_model), device="cpu", engine_process=False, kv_blocks=400,
                          block_size=16, max_prefill_tokens_per_step=16, hmac_key_file=str(key_file),
                          hmac_key_id=KEY_ID)
    server = module_aio_server(lambda: create_server(config))
    return engine_pb2_grpc.EngineServiceStub(server.channel())


def test_model_info_lists_image_and_video(engine):
    info = engine.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
    assert {m.modality: m.placeholder_token for m in info.modalities} == {
        multimodal_pb2.MODALITY_IMAGE: "<|image_pad|>", multimodal_pb2.MODALITY_VIDEO: "<|video_pad|>"}


def test_image_chat_equals_hf_generate(engine, renderer, hf_model):
    request = render(renderer, text("Describe:"), image(100, 70, seed=1), text("Briefly."), max_tokens=20)
    tokens = generate(engine, request)
    assert tokens == hf_vl_greedy(hf_model, request) and len(set(tokens)) > 3


@pytest.mark.parametrize("fps", [2.0, 0.5])
def test_video_chat_equals_hf_generate(engine, renderer, hf_model, fps):
    request = render(renderer, text("Clip:"), video(5, fps, seed=20), text("What moves?"), max_tokens=20)
    (item,) = request.mm_features.items
    assert len(item.placeholder.is_embed) == item.placeholder.length > sum(item.placeholder.is_embed)
    tokens = generate(engine, request)
    assert tokens == hf_vl_greedy(hf_model, request) and len(set(tokens)) > 3


def test_image_and_video_chat_equals_hf_generate(engine, renderer, hf_model):
    request = render(renderer, video(4, 2.0, seed=30, width=96), text("then"), image(64, 64, seed=35),
                     text("same scene?"), max_tokens=20)
    assert generate(engine, request) == hf_vl_greedy(hf_model, request)


def test_mixed_batch_joining_at_different_steps_equals_hf(engine, renderer, hf_model):
    requests = []
    for k in range(8):
        words = " ".join(["sea", "sky", "stone", "leaf"][: 1 + k % 4])
        if k % 4 == 0:
            requests.append(render(renderer, text(f"Plain {k}: {words}"), max_tokens=10 + k))
        elif k % 4 == 1:
            requests.append(render(renderer, image(64 + 32 * (k % 3), 64, seed=40 + k), text(words),
                                   max_tokens=10 + k))
        else:
            requests.append(render(renderer, video(2 + k % 3, 1.0 + k % 2, seed=60 + k), text(words),
                                   image(64, 64, seed=80 + k), max_tokens=10 + k))
    expected = [hf_vl_greedy(hf_model, request) for request in requests]
    results: list = [None] * len(requests)

    def run(index: int, started: threading.Event) -> None:
        tokens = []
        try:
            for response in engine.Generate(requests[index], timeout=TIMEOUT):
                tokens.extend(response.token_ids)
                started.set()
            results[index] = tokens
        except BaseException as exc:  # noqa: BLE001 - compared below
            results[index] = exc
        finally:
            started.set()

    threads = []
    for index in range(len(requests)):
        started = threading.Event()
        thread = threading.Thread(target=run, args=(index, started))
        thread.start()
        threads.append(thread)
        started.wait(TIMEOUT)
    for thread in threads:
        thread.join(TIMEOUT)
    assert results == expected


def test_another_videos_features_answer_like_that_video(engine, renderer, hf_model):
    a = render(renderer, text("Which clip?"), video(4, 2.0, seed=101), max_tokens=16)
    b = render(renderer, text("Which clip?"), video(4, 2.0, seed=202), max_tokens=16)
    assert list(a.token_ids) == list(b.token_ids)  # same frames, size and rate: the same span
    expected_a, expected_b = hf_vl_greedy(hf_model, a), hf_vl_greedy(hf_model, b)
    assert expected_a != expected_b
    swapped = engine_pb2.GenerateRequest()
    swapped.CopyFrom(a)
    swapped.mm_features.CopyFrom(b.mm_features)
    assert generate(engine, swapped) == expected_b
    assert generate(engine, a) == expected_a


def test_metadata_after_tensors_hits_the_encoder_cache(engine, renderer, hf_model):
    parts = (text("Seen before:"), video(3, 2.0, seed=303), image(64, 96, seed=304), text("Again."))
    with_tensors = render(renderer, *parts, max_tokens=14)
    expected = hf_vl_greedy(hf_model, with_tensors)
    assert generate(engine, with_tensors) == expected
    metadata_only = render(renderer, *parts, max_tokens=14, payload=METADATA)
    assert all(not item.kwargs and item.metadata for item in metadata_only.mm_features.items)
    before = engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert generate(engine, metadata_only) == expected
    after = engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert after.encoder_cache_hits - before.encoder_cache_hits == 2
    assert after.encoder_cache_misses == before.encoder_cache_misses


def test_encode_descriptor_holds_the_deepstack_levels(engine, renderer, hf_model):
    with_tensors = render(renderer, image(64, 64, seed=404), text("Encoded."), max_tokens=8)
    encoded = engine.Encode(engine_pb2.EncodeRequest(mm_features=with_tensors.mm_features), timeout=TIMEOUT)
    (descriptor,) = encoded.descriptors
    hidden, levels = hf_model.config.text_config.hidden_size, len(
        hf_model.config.vision_config.deepstack_visual_indexes)
    assert list(descriptor.shape) == [with_tensors.mm_features.items[0].placeholder.length, hidden * (1 + levels)]
    metadata_only = render(renderer, image(64, 64, seed=404), text("Encoded."), max_tokens=8, payload=METADATA)
    metadata_only.mm_features.items[0].ec_descriptor.CopyFrom(descriptor)
    signing.sign_item(metadata_only.mm_features.items[0], KEY, KEY_ID)  # the tag covers the descriptor
    assert generate(engine, metadata_only) == hf_vl_greedy(hf_model, with_tensors)
