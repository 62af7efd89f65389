"""Qwen3-VL through `--backend vllm`: the items render makes (images; videos whose span interleaves
timestamp text with the frames) become vLLM's pre-processed Qwen3-VL input, and vLLM's greedy
tokens equal the native engine's for the same rendered requests (image, video, image + video);
one video's ids with another video's features answer like the other video on both backends; a
METADATA request after a TENSORS one is served from vLLM's multimodal cache (render signs the items,
so the engine trusts their hashes).
"""

from __future__ import annotations


import pytest

from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, multimodal_pb2, render_pb2
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_render.media.features import Signer
from tito_render.renderer import Renderer
from tito_render.convert import chat_response

import chat_parts
from chat_parts import image, text
from renderers import load_renderer

pytestmark = pytest.mark.vllm

TIMEOUT = 180
KEY, KEY_ID = b"qwen3-vl-vllm-test-key-0123456789", "k1"
VLLM_ARGS = ("--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.05")


def video(frames: int, fps: float, seed: int, width: int = 64, height: int = 64) -> chat_pb2.ContentPart:
    """Qwen3-VL's videos here: 64x64 frames unless told (two merged 32-pixel patches a side)."""
    return chat_parts.video(frames, fps, seed, width, height)


@pytest.fixture(scope="module")
def renderer(tiny_qwen3_vl_model) -> Renderer:
    return load_renderer(tiny_qwen3_vl_model, signer=Signer(KEY, KEY_ID))


def render(renderer: Renderer, *parts, max_tokens: int = 16,
           payload: int = multimodal_pb2.MM_PAYLOAD_TENSORS) -> engine_pb2.GenerateRequest:
    return chat_response(renderer, render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=list(parts))], mm_payload=payload,
        sampling=render_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0))).generate_request


@pytest.fixture(scope="module")
def stubs(module_aio_server, tiny_qwen3_vl_model, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "hmac.key"
    key_file.write_bytes(KEY + b"\n")
    common = dict(model=str(tiny_qwen3_vl_model), max_model_len=1024, hmac_key_file=str(key_file), hmac_key_id=KEY_ID)
    configs = {
        "native": EngineConfig(device="cpu", engine_process=False, **common),
        "vllm": EngineConfig(backend="vllm", kv_cache_bytes=32 << 20, vllm_args=VLLM_ARGS, **common),
    }
    return {name: engine_pb2_grpc.EngineServiceStub(
        module_aio_server(lambda config=config: create_server(config)).channel()) for name, config in configs.items()}


def generate(stub, request) -> list[int]:
    return [token for response in stub.Generate(request, timeout=TIMEOUT) for token in response.token_ids]


def requests(renderer: Renderer) -> dict[str, engine_pb2.GenerateRequest]:
    return {
        "text": render(renderer, text("Tell me about the sea and the sky."), max_tokens=16),
        "image": render(renderer, text("Describe:"), image(100, 70, seed=1), max_tokens=16),
        "video": render(renderer, text("Clip:"), video(5, 2.0, seed=20), text("What moves?"), max_tokens=16),
        "video_slow": render(renderer, text("Clip:"), video(5, 0.5, seed=20), text("What moves?"), max_tokens=16),
        "mixed": render(renderer, video(4, 2.0, seed=30, width=96), text("then"), image(64, 64, seed=35),
                        max_tokens=16),
    }


@pytest.mark.parametrize("name", ["text", "image", "video", "video_slow", "mixed"])
def test_vllm_greedy_equals_native(stubs, renderer, name):
    request = requests(renderer)[name]
    native = generate(stubs["native"], request)
    assert len(set(native)) > 3
    assert generate(stubs["vllm"], request) == native


def test_another_videos_features_answer_like_that_video_on_both_backends(stubs, renderer):
    a = render(renderer, text("Which clip?"), video(4, 2.0, seed=101), max_tokens=12)
    b = render(renderer, text("Which clip?"), video(4, 2.0, seed=202), max_tokens=12)
    assert list(a.token_ids) == list(b.token_ids)
    swapped = engine_pb2.GenerateRequest()
    swapped.CopyFrom(a)
    swapped.mm_features.CopyFrom(b.mm_features)
    for backend in ("native", "vllm"):
        expected_a, expected_b = generate(stubs[backend], a), generate(stubs[backend], b)
        assert expected_a != expected_b
        assert generate(stubs[backend], swapped) == expected_b


def test_metadata_after_tensors_is_served_from_vllms_cache(stubs, renderer):
    parts = (text("Seen before:"), video(3, 2.0, seed=303), image(64, 96, seed=304), text("Again."))
    with_tensors = render(renderer, *parts, max_tokens=12)
    expected = generate(stubs["native"], with_tensors)
    assert generate(stubs["vllm"], with_tensors) == expected
    metadata_only = render(renderer, *parts, max_tokens=12, payload=multimodal_pb2.MM_PAYLOAD_METADATA)
    assert all(not item.kwargs for item in metadata_only.mm_features.items)
    before = stubs["vllm"].GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert generate(stubs["vllm"], metadata_only) == expected
    after = stubs["vllm"].GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert after.encoder_cache_hits - before.encoder_cache_hits == 2
    assert after.encoder_cache_misses == before.encoder_cache_misses
