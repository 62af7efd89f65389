"""The processed-image cache: a repeated image skips decoding and processing and gives exactly
the same items; tensors are never served from an entry made without them; bounded by bytes."""

from __future__ import annotations

import numpy as np
import pytest

from tito.v1 import chat_pb2, multimodal_pb2, render_pb2
from tito_render.config import RenderConfig
from tito_render.media.cache import CachedImage, ProcessedImageCache
from tito_render.media.processors import ProcessedImage
from tito_render.model import load_render_model
from tito_render.renderer import Renderer, RenderLimits
from tito_render.convert import chat_response

from images import noise_png as png


def chat(data: bytes, **fields) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(request_id="r", messages=[chat_pb2.ChatMessage(role="user", content_parts=[
        chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=data))])], **fields)


@pytest.fixture(scope="module")
def model(tiny_vl_model):
    return load_render_model(RenderConfig(model=str(tiny_vl_model)))


def test_repeated_image_is_served_from_cache_identically(model):
    cached = Renderer(model, RenderLimits(media_cache_bytes=64 * 1024 * 1024))
    uncached = Renderer(model)
    data = png(640, 480)
    first = chat_response(cached, chat(data))
    assert (cached.image_cache.hits, cached.image_cache.misses) == (0, 1)
    second = chat_response(cached, chat(data))
    assert cached.image_cache.hits == 1
    assert first == second == chat_response(uncached, chat(data))


def test_metadata_entry_does_not_serve_tensors(model):
    renderer = Renderer(model, RenderLimits(media_cache_bytes=64 * 1024 * 1024))
    data = png(300, 200)
    light = chat_response(renderer, chat(data, mm_payload=multimodal_pb2.MM_PAYLOAD_METADATA))
    full = chat_response(renderer, chat(data))
    assert renderer.image_cache.hits == 0 and len(full.generate_request.mm_features.items[0].kwargs) == 1
    again = chat_response(renderer, chat(data, mm_payload=multimodal_pb2.MM_PAYLOAD_METADATA))
    assert renderer.image_cache.hits == 1 and again == light  # a TENSORS entry serves METADATA


def test_settings_are_part_of_the_key(model):
    renderer = Renderer(model, RenderLimits(media_cache_bytes=64 * 1024 * 1024))
    data = png(1280, 720)
    default = chat_response(renderer, chat(data)).generate_request.mm_features.items[0]
    small = chat(data)
    small.media_options.max_pixels = 28 * 28 * 8
    item = chat_response(renderer, small).generate_request.mm_features.items[0]
    assert renderer.image_cache.hits == 0 and item.placeholder.length < default.placeholder.length


def test_cache_is_bounded_by_bytes():
    def entry(rows: int) -> CachedImage:
        return CachedImage("h", ProcessedImage("x", (1,), None, kwargs={"p": np.zeros((rows, 256), np.float32)}))
    cache = ProcessedImageCache(max_bytes=3 * 1024 * 1024)
    for i in range(10):
        cache.put(bytes([i]), entry(1024))  # ~1 MiB each
    assert len(cache) == 2 and cache.get(bytes([9]), True) is not None and cache.get(bytes([0]), True) is None
    cache.put(b"huge", entry(4096))  # larger than the whole cache: not kept
    assert cache.get(b"huge", True) is None
    assert ProcessedImageCache(0).get(b"any", False) is None
