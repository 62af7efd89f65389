"""Render's shortcuts give exactly what the general paths give: the Rust tokenizer called directly
vs the Hugging Face call, the direct Struct walk vs json_format.MessageToDict, the image packed
once for the hash and the processor vs the PIL path, and no cache key without a cache."""

from __future__ import annotations

import math

import numpy as np
import pytest
from google.protobuf import json_format, struct_pb2
from hypothesis import given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

from tito.v1 import chat_pb2, render_pb2
from tito_render.chat_template import _plain_backend, encode_prompt_text
from tito_render.media.cache import ProcessedImageCache
from tito_render.media.hashing import image_hash, rgb_pixels
from tito_render.media.loader import to_rgb
from tito_render.messages import struct_to_dict as template_dict
from tito_render.renderer import RenderLimits
from tito_render.convert import chat_response, media_options_from_proto, struct_from_proto

from images import noise_image, noise_png
from renderers import load_renderer


@pytest.fixture(scope="module")
def tokenizer(tiny_text_model):
    return AutoTokenizer.from_pretrained(str(tiny_text_model))


def hf_ids(tokenizer, text: str, add_special_tokens: bool) -> list[int]:
    return [int(i) for i in tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]]


TEXTS = ["", "hello", " leading and trailing  ", "<|im_start|>user\nhi<|im_end|>\n<think>\n\n</think>\n",
         "日本語 émoji 🎉\n\n\n", "<tool_call>\n{\"a\": 1}\n</tool_call>", "<|endoftext|>" * 3]


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("add_special_tokens", [False, True])
def test_direct_backend_encode_equals_tokenizer_call(tokenizer, text, add_special_tokens):
    assert _plain_backend(tokenizer) is not None  # the shortcut is taken for this tokenizer
    assert encode_prompt_text(tokenizer, text, add_special_tokens) == hf_ids(tokenizer, text, add_special_tokens)


@settings(max_examples=60, deadline=None)
@given(st.text(max_size=80))
def test_direct_backend_encode_equals_tokenizer_call_on_any_text(tokenizer, text):
    assert encode_prompt_text(tokenizer, text, False) == hf_ids(tokenizer, text, False)


def test_backend_state_the_call_would_reset_takes_the_hugging_face_call(tiny_text_model):
    # Truncation left on the Rust tokenizer: tokenizer(text) turns it off before encoding, so the
    # shortcut (which would truncate) must not be taken.
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_text_model))
    text = "a fairly long sentence that encodes to more than four tokens for sure"
    expected = hf_ids(tokenizer, text, False)
    tokenizer.backend_tokenizer.enable_truncation(max_length=4)
    assert len(expected) > 4
    assert encode_prompt_text(tokenizer, text, False) == expected


def test_split_special_tokens_is_honoured(tiny_text_model):
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_text_model))
    tokenizer.split_special_tokens = True
    text = "<|im_start|>user"
    assert encode_prompt_text(tokenizer, text, False) == hf_ids(tokenizer, text, False)


json_values = st.recursive(
    st.none() | st.booleans() | st.text(max_size=5)
    | st.floats(allow_nan=False, allow_infinity=False) | st.integers(-2**60, 2**60).map(float),
    lambda children: st.lists(children, max_size=3) | st.dictionaries(st.text(max_size=3), children, max_size=3),
    max_leaves=12)


def struct_to_dict(struct: struct_pb2.Struct):
    """Render's conversion of `struct`: the servicer's (convert.py), then the template's (messages.py)."""
    return template_dict(struct_from_proto(struct))


def reference_struct_to_dict(struct: struct_pb2.Struct):
    """The definition: MessageToDict, integral doubles (below 2**53) back to ints, keys sorted."""
    def normalise(value):
        if isinstance(value, float) and math.isfinite(value) and value.is_integer() and abs(value) < 2**53:
            return int(value)
        if isinstance(value, dict):
            return {k: normalise(value[k]) for k in sorted(value)}
        if isinstance(value, list):
            return [normalise(v) for v in value]
        return value
    return normalise(json_format.MessageToDict(struct))


@settings(max_examples=200, deadline=None)
@given(st.dictionaries(st.text(max_size=4), json_values, max_size=4))
def test_struct_to_dict_equals_message_to_dict(obj):
    struct = struct_pb2.Struct()
    struct.update(obj)
    result = struct_to_dict(struct)
    assert repr(result) == repr(reference_struct_to_dict(struct))  # repr: 1 and 1.0 differ


@pytest.mark.parametrize("bad", [math.inf, -math.inf, math.nan])
def test_struct_to_dict_refuses_what_message_to_dict_refuses(bad):
    struct = struct_pb2.Struct()
    struct.update({"x": [bad]})
    with pytest.raises(ValueError) as reference:
        json_format.MessageToDict(struct)
    with pytest.raises(ValueError) as ours:
        struct_to_dict(struct)
    assert str(ours.value) == str(reference.value)


@pytest.mark.parametrize("mode,size", [("RGB", (300, 200)), ("RGBA", (64, 97)), ("RGB", (3, 3)), ("L", (50, 40))])
def test_processor_on_packed_pixels_equals_pil_path(qwen, mode, size):
    media = qwen.model.media
    image = to_rgb(noise_image(*size, mode=mode))
    pixels = rgb_pixels(image)
    assert pixels.tobytes() == image.tobytes()
    kwargs = media.call_kwargs(media_options_from_proto(render_pb2.MediaOptions()), 64_000_000)
    via_pil = media.run_processor(image, kwargs)
    via_pixels = media.run_processor(image, kwargs, pixels)
    assert via_pil.keys() == via_pixels.keys()
    for name in via_pil:
        assert via_pil[name].dtype == via_pixels[name].dtype
        np.testing.assert_array_equal(via_pil[name], via_pixels[name])
    options = media.effective_options(kwargs)
    assert image_hash(image, media.family, options, pixels) == image_hash(image, media.family, options)


def test_no_cache_key_without_a_cache(tiny_vl_model, monkeypatch):
    renderer = load_renderer(tiny_vl_model, RenderLimits(media_cache_bytes=0))
    request = render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content_parts=[
        chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=noise_png(40, 30)))])])
    expected = chat_response(renderer, request, "r")

    def refuse(*args, **kwargs):
        raise AssertionError("the cache key was computed with the cache off")

    monkeypatch.setattr(ProcessedImageCache, "key", staticmethod(refuse))
    assert chat_response(renderer, request, "r") == expected
