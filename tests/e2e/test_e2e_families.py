"""End to end on the newer families: `tito serve render|engine|derender` as processes on tiny
Llama, Qwen3, Qwen2.5-VL and Qwen3-VL models. A chat (with an image, or a video, for the VL models) goes
through ChatPipeline; the engine's tokens are HF `generate`'s greedy tokens for the rendered request and
the streamed text is their decoding."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForImageTextToText, AutoTokenizer

from tito import tensors
from tito_client.pipeline import ChatPipeline, Endpoints
from tito.v1 import chat_pb2, derender_pb2, multimodal_pb2, render_pb2

from chat_checks import assert_chat_is_hf_greedy
from images import noise_data_url as data_url
from service_processes import running_services, signed_media_args

pytestmark = pytest.mark.e2e

MAX_TOKENS = 24


@pytest.mark.parametrize("model_fixture", ["tiny_llama_model", "tiny_qwen3_model"])
def test_text_chat_is_hf_greedy(request, tmp_path, model_fixture):
    model_dir = request.getfixturevalue(model_fixture)
    with running_services(model_dir, tmp_path) as (addresses, _):
        assert_chat_is_hf_greedy(addresses, model_dir, [
            chat_pb2.ChatMessage(role="system", content="You are terse."),
            chat_pb2.ChatMessage(role="user", content="Hello! Tell me about the sea and the sky.")])


@pytest.fixture(scope="module")
def vl_services(tiny_qwen2_5_vl_model, tmp_path_factory):
    """Render signs media items, the engine requires signed features."""
    directory = tmp_path_factory.mktemp("qwen2_5_vl-e2e")
    with running_services(tiny_qwen2_5_vl_model, directory, "auto", signed_media_args(directory)) as (addresses, _):
        yield addresses


def hf_greedy(model, generate_request) -> list[int]:
    ids = torch.tensor([list(generate_request.token_ids)])
    types = torch.zeros_like(ids)
    inputs: dict = {}
    for item in generate_request.mm_features.items:
        span = slice(item.placeholder.offset, item.placeholder.offset + item.placeholder.length)
        if item.modality == multimodal_pb2.MODALITY_VIDEO:
            types[0, span] = 2
            inputs.update(pixel_values_videos=tensors.to_torch(item.kwargs["pixel_values_videos"]),
                          video_grid_thw=tensors.to_torch(item.metadata["video_grid_thw"]).reshape(-1, 3),
                          second_per_grid_ts=tensors.to_torch(item.metadata["second_per_grid_ts"]))
        else:
            types[0, span] = 1
            inputs.update(pixel_values=tensors.to_torch(item.kwargs["pixel_values"]),
                          image_grid_thw=tensors.to_torch(item.metadata["image_grid_thw"]).reshape(-1, 3))
    with torch.inference_mode():
        output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                                do_sample=False, max_new_tokens=MAX_TOKENS, **inputs)
    return output[0, ids.shape[1]:].tolist()


VIDEO = chat_pb2.ContentPart(video=chat_pb2.VideoFrames(
    frames=[chat_pb2.ImageSource(url=data_url(84, 56, seed=10 + k)) for k in range(4)], fps=1.0))
IMAGE = chat_pb2.ContentPart(image=chat_pb2.ImageSource(url=data_url(112, 84, seed=3)))


@pytest.mark.parametrize("media", [IMAGE, VIDEO], ids=["image", "video"])
def test_media_chat_streams_the_text_of_hf_greedy_tokens(vl_services, tiny_qwen2_5_vl_model, media):
    request = render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=[chat_pb2.ContentPart(text="What is this?"), media])],
        sampling=render_pb2.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0))
    with ChatPipeline(Endpoints(**vl_services), timeout=120) as pipeline:
        rendered = pipeline.render.RenderChat(request, timeout=60)
        (item,) = rendered.generate_request.mm_features.items
        assert item.auth_tag and item.kwargs  # signed, with tensors
        responses = list(pipeline.engine.Generate(rendered.generate_request, timeout=120))
        chunks = [r.chunk for r in pipeline.derender.Derender(
            iter([derender_pb2.DerenderRequest(context=rendered.derender_context)]
                 + [derender_pb2.DerenderRequest(generate_response=r) for r in responses]), timeout=60)]
    engine_tokens = [t for r in responses for t in r.token_ids]
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_5_vl_model, dtype=torch.float32).eval()
    assert engine_tokens == hf_greedy(model, rendered.generate_request)
    assert len(set(engine_tokens)) > 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen2_5_vl_model)
    assert "".join(c.content for c in chunks) == tokenizer.decode(engine_tokens, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(engine_tokens)
    assert chunks[-1].usage.prompt_tokens == len(rendered.generate_request.token_ids)


# --------------------------------------------------------------------------- Qwen3-VL


@pytest.fixture(scope="module")
def qwen3_vl_services(tiny_qwen3_vl_model, tmp_path_factory):
    """Render signs media items, the engine requires signed features."""
    directory = tmp_path_factory.mktemp("qwen3_vl-e2e")
    with running_services(tiny_qwen3_vl_model, directory, "auto", signed_media_args(directory)) as (addresses, _):
        yield addresses


def qwen3_vl_hf_greedy(model, generate_request) -> list[int]:
    """mm_token_type_ids at exactly the is_embed positions (a video span's timestamps are text)."""
    ids = torch.tensor([list(generate_request.token_ids)])
    types = torch.zeros_like(ids)
    inputs: dict = {}
    for item in generate_request.mm_features.items:
        mask = list(item.placeholder.is_embed) or [True] * item.placeholder.length
        video = item.modality == multimodal_pb2.MODALITY_VIDEO
        for k, on in enumerate(mask):
            types[0, item.placeholder.offset + k] = (2 if video else 1) if on else 0
        if video:
            inputs.update(pixel_values_videos=tensors.to_torch(item.kwargs["pixel_values_videos"]),
                          video_grid_thw=tensors.to_torch(item.metadata["video_grid_thw"]).reshape(-1, 3))
        else:
            inputs.update(pixel_values=tensors.to_torch(item.kwargs["pixel_values"]),
                          image_grid_thw=tensors.to_torch(item.metadata["image_grid_thw"]).reshape(-1, 3))
    with torch.inference_mode():
        output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), mm_token_type_ids=types,
                                do_sample=False, max_new_tokens=MAX_TOKENS, **inputs)
    return output[0, ids.shape[1]:].tolist()


QWEN3_VL_VIDEO = chat_pb2.ContentPart(video=chat_pb2.VideoFrames(
    frames=[chat_pb2.ImageSource(url=data_url(80, 64, seed=30 + k)) for k in range(5)], fps=2.0))
QWEN3_VL_IMAGE = chat_pb2.ContentPart(image=chat_pb2.ImageSource(url=data_url(100, 70, seed=4)))


@pytest.mark.parametrize("media", [QWEN3_VL_IMAGE, QWEN3_VL_VIDEO], ids=["image", "video"])
def test_qwen3_vl_chat_through_the_three_services_is_hf_greedy(qwen3_vl_services, tiny_qwen3_vl_model, media):
    request = render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=[chat_pb2.ContentPart(text="What is this?"), media])],
        sampling=render_pb2.SamplingOptions(max_tokens=MAX_TOKENS, temperature=0.0))
    with ChatPipeline(Endpoints(**qwen3_vl_services), timeout=120) as pipeline:
        rendered = pipeline.render.RenderChat(request, timeout=60)
        (item,) = rendered.generate_request.mm_features.items
        assert item.auth_tag and item.kwargs  # signed, with tensors
        if item.modality == multimodal_pb2.MODALITY_VIDEO:  # timestamps inside the span
            assert sum(item.placeholder.is_embed) < len(item.placeholder.is_embed) == item.placeholder.length
        chunks = list(pipeline.stream_chat(request))
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen3_vl_model, dtype=torch.float32).eval()
    expected = qwen3_vl_hf_greedy(model, rendered.generate_request)
    assert len(set(expected)) > 1
    tokenizer = AutoTokenizer.from_pretrained(tiny_qwen3_vl_model)
    assert "".join(c.content for c in chunks) == tokenizer.decode(expected, skip_special_tokens=True)
    assert chunks[-1].usage.completion_tokens == len(expected)
    assert chunks[-1].usage.prompt_tokens == len(rendered.generate_request.token_ids)
