"""Image rendering equals the Hugging Face processor path: ids, pixel values, placeholder spans,
is_embed; payload modes; content hashes; signing."""

from __future__ import annotations

import base64

import numpy as np
import pytest
from PIL import Image

from tito import signing
from tito.tensors import to_numpy
from interleaved_spans import interleaved_image_span
from tito_models.tiny import INTERLEAVED_VL_MODEL, ensure_model
from tito.v1 import chat_pb2, multimodal_pb2, render_pb2
from tito_render.media.features import Signer
from tito_render.renderer import Renderer
from tito_render.convert import chat_response, media_options_from_proto, model_info_to_proto

from images import encoded as encode, noise_image as picture
from renderers import load_renderer

TENSORS, METADATA, NONE = (multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA,
                           multimodal_pb2.MM_PAYLOAD_NONE)


def image_part(data: bytes) -> chat_pb2.ContentPart:
    return chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=data))


def text_part(text: str) -> chat_pb2.ContentPart:
    return chat_pb2.ContentPart(text=text)


def chat(*parts: chat_pb2.ContentPart, **fields) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content_parts=list(parts))],
                                        **fields)


@pytest.fixture(scope="module")
def gemma_model(model_cache):
    return ensure_model(INTERLEAVED_VL_MODEL, model_cache)


@pytest.fixture(scope="module")
def gemma(gemma_model) -> Renderer:
    return load_renderer(gemma_model)


def hf_qwen_path(renderer: Renderer, dict_messages: list[dict], images: list[Image.Image]):
    """What Qwen2VLProcessor does (AutoProcessor needs torchvision here): template text, image
    processor on all images, each <|image_pad|> expanded to grid.prod() // merge**2 pads, tokenize."""
    tokenizer = renderer.model.tokenizer
    processor = renderer.model.media.image_processor
    text = tokenizer.apply_chat_template(dict_messages, tokenize=False, add_generation_prompt=True)
    out = processor(images=images, return_tensors="np")
    merge = processor.merge_size ** 2
    pieces = text.split("<|image_pad|>")
    expanded = pieces[0]
    for grid, piece in zip(out["image_grid_thw"], pieces[1:]):
        expanded += "<|placeholder|>" * (int(np.prod(grid)) // merge) + piece
    expanded = expanded.replace("<|placeholder|>", "<|image_pad|>")
    return tokenizer(expanded)["input_ids"], out["pixel_values"], out["image_grid_thw"]


# --------------------------------------------------------------------------- Qwen2-VL


@pytest.mark.parametrize("sizes", [[(32, 32)], [(100, 60)], [(224, 224)], [(640, 480)], [(1920, 1080)],
                                   [(300, 200), (57, 311)]])
def test_qwen_ids_and_pixels_equal_hf_processor(qwen, sizes):
    images = [picture(w, h, seed=i) for i, (w, h) in enumerate(sizes)]
    parts = [text_part("Compare:")]
    dict_parts = [{"type": "text", "text": "Compare:"}]
    for image in images:
        parts += [image_part(encode(image)), text_part(" and")]
        dict_parts += [{"type": "image"}, {"type": "text", "text": " and"}]
    response = chat_response(qwen, chat(*parts))
    ids, pixel_values, grids = hf_qwen_path(qwen, [{"role": "user", "content": dict_parts}], images)

    token_ids = list(response.generate_request.token_ids)
    assert token_ids == list(ids)
    items = response.generate_request.mm_features.items
    assert len(items) == len(images)
    rows = [to_numpy(item.kwargs["pixel_values"]) for item in items]
    assert np.concatenate(rows).tobytes() == pixel_values.tobytes()  # bit-identical
    pad = qwen.model.media.image_token_id
    for item, grid, item_rows in zip(items, grids, rows):
        assert item.modality == multimodal_pb2.MODALITY_IMAGE
        assert to_numpy(item.metadata["image_grid_thw"]).tolist() == [grid.tolist()]
        assert item_rows.shape[0] == int(np.prod(grid))  # this item's patches only
        offset, length = item.placeholder.offset, item.placeholder.length
        assert length == int(np.prod(grid)) // 4 and len(item.placeholder.is_embed) == 0
        assert set(token_ids[offset:offset + length]) == {pad}
        assert token_ids[offset - 1] == 1003 and token_ids[offset + length] == 1004  # vision start / end
    assert sum(t == pad for t in token_ids) == sum(item.placeholder.length for item in items)


def test_qwen_multi_turn_chat_with_images_and_tools_equals_hf(qwen):
    from google.protobuf import struct_pb2

    first, second = picture(200, 120, seed=5), picture(90, 300, seed=6)
    params = {"properties": {"city": {"type": "string"}}, "required": ["city"], "type": "object"}
    tool = {"type": "function", "function": {"name": "find_city", "description": "Locate a photo",
                                             "parameters": params}}
    dicts = [
        {"role": "system", "content": "You look at photos."},
        {"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "Where is this?"}]},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "find_city", "arguments": '{"city": "Oslo"}'}}]},
        {"role": "tool", "content": "Oslo, Norway", "tool_call_id": "c1"},
        {"role": "assistant", "content": "This is Oslo.", "reasoning_content": "The tool said so."},
        {"role": "user", "content": [{"type": "text", "text": "And this one?"}, {"type": "image"}]},
    ]
    tokenizer = qwen.model.tokenizer
    text = tokenizer.apply_chat_template(dicts, tools=[tool], tokenize=False, add_generation_prompt=True)
    out = qwen.model.media.image_processor(images=[first, second], return_tensors="np")
    for grid in out["image_grid_thw"]:
        text = text.replace("<|image_pad|>", "<|placeholder|>" * (int(np.prod(grid)) // 4), 1)
    expected = tokenizer(text.replace("<|placeholder|>", "<|image_pad|>"))["input_ids"]

    parameters = struct_pb2.Struct()
    parameters.update(params)
    request = render_pb2.RenderChatRequest(
        tools=[chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
            name="find_city", description="Locate a photo", parameters=parameters))],
        messages=[
            chat_pb2.ChatMessage(role="system", content="You look at photos."),
            chat_pb2.ChatMessage(role="user", content_parts=[image_part(encode(first)), text_part("Where is this?")]),
            chat_pb2.ChatMessage(role="assistant", content="", tool_calls=[chat_pb2.ToolCall(
                id="c1", type="function", function=chat_pb2.FunctionCall(name="find_city",
                                                                         arguments='{"city": "Oslo"}'))]),
            chat_pb2.ChatMessage(role="tool", content="Oslo, Norway", tool_call_id="c1"),
            chat_pb2.ChatMessage(role="assistant", content="This is Oslo.", reasoning_content="The tool said so."),
            chat_pb2.ChatMessage(role="user", content_parts=[text_part("And this one?"), image_part(encode(second))]),
        ])
    response = chat_response(qwen, request)
    assert list(response.generate_request.token_ids) == list(expected)
    rows = np.concatenate([to_numpy(i.kwargs["pixel_values"]) for i in response.generate_request.mm_features.items])
    assert rows.tobytes() == out["pixel_values"].tobytes()
    assert response.derender_context.tool_choice.mode == chat_pb2.TOOL_CHOICE_MODE_AUTO


def test_qwen_rgba_and_palette_images_match_hf(qwen):
    rgba = picture(120, 90, seed=3, mode="RGBA")
    palette = picture(64, 64, seed=4).convert("P")
    for image in (rgba, palette):
        response = chat_response(qwen, chat(image_part(encode(image))))
        ids, pixel_values, _ = hf_qwen_path(qwen, [{"role": "user", "content": [{"type": "image"}]}], [image])
        assert list(response.generate_request.token_ids) == list(ids)
        item = response.generate_request.mm_features.items[0]
        assert to_numpy(item.kwargs["pixel_values"]).tobytes() == pixel_values.tobytes()


def test_payload_modes(qwen):
    request = chat(text_part("see"), image_part(encode(picture(640, 480))), request_id="same")
    responses = {}
    for mode in (multimodal_pb2.MM_PAYLOAD_UNSPECIFIED, TENSORS, METADATA, NONE):
        request.mm_payload = mode
        responses[mode] = chat_response(qwen, request)
    full = responses[TENSORS].generate_request
    assert responses[multimodal_pb2.MM_PAYLOAD_UNSPECIFIED].generate_request == full
    for mode in (METADATA, NONE):
        generate = responses[mode].generate_request
        assert list(generate.token_ids) == list(full.token_ids)
        item, full_item = generate.mm_features.items[0], full.mm_features.items[0]
        assert item.mm_hash == full_item.mm_hash and item.placeholder == full_item.placeholder
        assert len(item.kwargs) == 0
    # METADATA keeps image_grid_thw, computed without processing the pixels, equal to the processor's.
    assert responses[METADATA].generate_request.mm_features.items[0].metadata == \
        full.mm_features.items[0].metadata
    assert len(responses[NONE].generate_request.mm_features.items[0].metadata) == 0


@pytest.mark.parametrize("size", [(32, 32), (100, 60), (1920, 1080), (57, 311), (3000, 40)])
@pytest.mark.parametrize("max_pixels", [None, 28 * 28 * 4, 28 * 28 * 200])
def test_qwen_metadata_grid_without_pixels_equals_processor(qwen, size, max_pixels):
    adapter = qwen.model.media
    options = render_pb2.MediaOptions()
    if max_pixels:
        options.max_pixels = max_pixels
    kwargs = adapter.call_kwargs(media_options_from_proto(options), 64_000_000)
    image = picture(*size)
    full = adapter.process(image, kwargs, with_tensors=True)
    light = adapter.process(image, kwargs, with_tensors=False)
    assert light.metadata["image_grid_thw"].tolist() == full.metadata["image_grid_thw"].tolist()
    assert light.span_token_ids == full.span_token_ids and not light.kwargs


def test_media_options_max_pixels_changes_tensors_and_hash(qwen):
    data = encode(picture(1920, 1080))
    base = chat_response(qwen, chat(image_part(data))).generate_request.mm_features.items[0]
    small_request = chat(image_part(data))
    small_request.media_options.max_pixels = 28 * 28 * 8
    small = chat_response(qwen, small_request).generate_request.mm_features.items[0]
    assert small.placeholder.length < base.placeholder.length
    assert to_numpy(small.kwargs["pixel_values"]).shape[0] == int(np.prod(to_numpy(small.metadata["image_grid_thw"])))
    assert small.mm_hash != base.mm_hash
    # Spelling out the default gives the default's tensors and the same hash.
    default_request = chat(image_part(data))
    default_request.media_options.max_pixels = qwen.model.media.image_processor.size["longest_edge"]
    default_request.media_options.processor_kwargs.update({"resample": 3})
    same = chat_response(qwen, default_request).generate_request.mm_features.items[0]
    assert same.mm_hash == base.mm_hash and same.kwargs == base.kwargs


def test_hash_is_of_pixels_not_encoding(qwen):
    image = picture(200, 150, seed=7)
    png, webp = encode(image), encode(image, "WEBP", lossless=True)
    assert png != webp
    data_url = "data:image/webp;base64," + base64.b64encode(webp).decode()
    hashes = set()
    for part in (image_part(png), image_part(webp), chat_pb2.ContentPart(image=chat_pb2.ImageSource(url=data_url))):
        hashes.add(chat_response(qwen, chat(part)).generate_request.mm_features.items[0].mm_hash)
    assert len(hashes) == 1
    other = chat_response(qwen, chat(image_part(encode(picture(200, 150, seed=8)))))
    assert other.generate_request.mm_features.items[0].mm_hash not in hashes
    lossy = chat_response(qwen, chat(image_part(encode(image, "JPEG", quality=80))))
    assert lossy.generate_request.mm_features.items[0].mm_hash not in hashes  # different pixels


def test_two_identical_images_share_a_hash_and_get_distinct_spans(qwen):
    data = encode(picture(64, 64))
    items = chat_response(qwen, chat(image_part(data), text_part("vs"), image_part(data))).generate_request \
        .mm_features.items
    assert items[0].mm_hash == items[1].mm_hash
    assert items[0].placeholder.offset + items[0].placeholder.length < items[1].placeholder.offset


def test_signed_items_verify_and_tampering_breaks_them(tiny_vl_model):
    key = b"k" * 32
    renderer = load_renderer(tiny_vl_model, signer=Signer(key, "key-1"))
    for mode in (TENSORS, METADATA, NONE):
        item = chat_response(renderer, chat(image_part(encode(picture(90, 90))), mm_payload=mode)) \
            .generate_request.mm_features.items[0]
        assert item.auth_key_id == "key-1" and len(item.auth_tag) == 32
        assert signing.verify_item(item, {"key-1": key})
        forged = multimodal_pb2.MultiModalItem()
        forged.CopyFrom(item)
        forged.mm_hash = "0" * 64
        assert not signing.verify_item(forged, {"key-1": key})


def test_model_info_lists_image_and_video_modalities(qwen):
    assert list(model_info_to_proto(qwen).modalities) == [multimodal_pb2.MODALITY_IMAGE, multimodal_pb2.MODALITY_VIDEO]


# --------------------------------------------------------------------------- Gemma3 (interleaved span)


def test_gemma3_ids_pixels_and_is_embed_equal_processor(gemma, gemma_model):
    from transformers import AutoProcessor

    processor = AutoProcessor.from_pretrained(str(gemma_model), backend="pil")  # render's backend
    images = [picture(80, 50, seed=1), picture(300, 300, seed=2)]
    request = chat(text_part("look"), image_part(encode(images[0])), text_part("and"),
                   image_part(encode(images[1])), text_part("hi"))
    response = chat_response(gemma, request)
    text = gemma.model.tokenizer.apply_chat_template(
        [{"role": "user", "content": [{"type": "text", "text": "look"}, {"type": "image"},
                                      {"type": "text", "text": "and"}, {"type": "image"},
                                      {"type": "text", "text": "hi"}]}],
        tokenize=False, add_generation_prompt=True)
    expected = processor(text=text, images=images, return_tensors="np")
    token_ids = list(response.generate_request.token_ids)
    assert token_ids == expected["input_ids"][0].tolist()

    items = response.generate_request.mm_features.items
    rows = np.concatenate([to_numpy(item.kwargs["pixel_values"]) for item in items])
    assert rows.tobytes() == expected["pixel_values"].tobytes()
    # is_embed marks exactly the image-token positions (the processor's token_type_ids).
    embed_positions = set()
    for item in items:
        span = interleaved_image_span()
        offset, length = item.placeholder.offset, item.placeholder.length
        assert tuple(token_ids[offset:offset + length]) == span.token_ids
        assert tuple(item.placeholder.is_embed) == span.is_embed
        embed_positions |= {offset + i for i, embed in enumerate(item.placeholder.is_embed) if embed}
    assert embed_positions == set(np.flatnonzero(expected["token_type_ids"][0]).tolist())


def test_gemma3_rejects_pixel_bounds(gemma):
    from tito.errors import InvalidArgument

    request = chat(image_part(encode(picture(64, 64))))
    request.media_options.max_pixels = 1000
    with pytest.raises(InvalidArgument) as err:
        chat_response(gemma, request)
    assert err.value.field == "media_options.max_pixels"


def test_gemma3_metadata_mode_has_no_tensors(gemma):
    item = chat_response(gemma, chat(image_part(encode(picture(64, 64))), mm_payload=METADATA)) \
        .generate_request.mm_features.items[0]
    assert len(item.kwargs) == 0 and len(item.placeholder.is_embed) == item.placeholder.length == 18
