"""vision.py against Hugging Face itself (transformers 5.24) on the tiny Qwen2-VL and Gemma3 models.

Each case goes through the engine's own path (proto items -> convert.item_from_proto ->
features.validate_mm_features -> vision.encode_items -> build_prefill_embeddings / mrope_positions)
and compares with HF's full
forward (input_ids + pixel values + grid + mm_token_type_ids / token_type_ids) and with
`model.generate`. The tiny models run a forward in milliseconds.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor, Gemma3ForConditionalGeneration, GenerationConfig, \
    Qwen2VLForConditionalGeneration

from tito import tensors
from tito_models.tiny import INTERLEAVED_VL_MODEL, ensure_model
from tito.v1 import multimodal_pb2
from tito_engine.multimodal import vision
from tito_engine.multimodal.features import FeaturePolicy, validate_mm_features
from tito_engine.multimodal.specs import multimodal_spec_from_config
from tito_engine.service.convert import item_from_proto

IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 1005, 1006, 1003, 1004
BOI, EOI, SOFT = 1013, 1014, 1015
PATCH_DIM = 3 * 2 * 14 * 14
MODALITY = {"image": multimodal_pb2.MODALITY_IMAGE, "video": multimodal_pb2.MODALITY_VIDEO}


@pytest.fixture(scope="module")
def qwen(tiny_vl_model):
    return Qwen2VLForConditionalGeneration.from_pretrained(tiny_vl_model).eval()


@pytest.fixture(scope="module")
def qwen_eos(tiny_vl_model):
    eos = GenerationConfig.from_pretrained(tiny_vl_model).eos_token_id
    return list(eos) if isinstance(eos, (list, tuple)) else [eos]


@pytest.fixture(scope="module")
def gemma_path(model_cache):
    return ensure_model(INTERLEAVED_VL_MODEL, model_cache)


@pytest.fixture(scope="module")
def gemma(gemma_path):
    return Gemma3ForConditionalGeneration.from_pretrained(gemma_path).eval()


def qwen_request(media, seed=0):
    """media: [(modality, (t, h, w), text_before)] -> token ids, proto features, pixel tensors."""
    g = torch.Generator().manual_seed(seed)
    ids, items, pixels = [], [], []
    for index, (modality, grid, text_before) in enumerate(media):
        t, h, w = grid
        ids += list(range(10 + index, 10 + index + text_before))
        if text_before or index == 0:
            ids.append(VISION_START)
        pixel = torch.randn(t * h * w, PATCH_DIM, generator=g)
        pixels.append(pixel)
        item = multimodal_pb2.MultiModalItem(
            modality=MODALITY[modality], mm_hash=f"{index:064x}",
            placeholder=multimodal_pb2.PlaceholderRange(offset=len(ids), length=t * h * w // 4))
        pixel_key, grid_key = ("pixel_values", "image_grid_thw") if modality == "image" else \
            ("pixel_values_videos", "video_grid_thw")
        item.kwargs[pixel_key].CopyFrom(tensors.from_torch(pixel))
        item.metadata[grid_key].CopyFrom(tensors.from_numpy(np.array(grid, dtype=np.int64)))
        items.append(item)
        ids += [IMAGE_PAD if modality == "image" else VIDEO_PAD] * (t * h * w // 4)
        ids.append(VISION_END)
    ids += [20, 21, 22]
    return ids, multimodal_pb2.MultiModalFeatures(items=items), pixels


def items_of(features):
    return tuple(item_from_proto(item) for item in features.items)


def validated(model, ids, features):
    spec = multimodal_spec_from_config(model.config, "tiny")
    return list(validate_mm_features(ids, items_of(features), spec, FeaturePolicy()).items)


def hf_inputs(ids, media, pixels, items):
    inputs = {"input_ids": torch.tensor([ids]), "mm_token_type_ids": vision.mm_token_type_ids(len(ids), items)[None]}
    for modality, pixel_key, grid_key in (("image", "pixel_values", "image_grid_thw"),
                                          ("video", "pixel_values_videos", "video_grid_thw")):
        chosen = [k for k, (m, _, _) in enumerate(media) if m == modality]
        if chosen:
            inputs[pixel_key] = torch.cat([pixels[k] for k in chosen])
            inputs[grid_key] = torch.tensor([media[k][1] for k in chosen])
    return inputs


ONE_IMAGE = [("image", (1, 4, 4), 3)]
TWO_IMAGES = [("image", (1, 4, 4), 3), ("image", (1, 6, 8), 5)]
LAYOUTS = {
    "one_image": ONE_IMAGE,
    "two_images_of_different_sizes": TWO_IMAGES,
    "tall_and_wide": [("image", (1, 8, 2), 2), ("image", (1, 2, 10), 1)],
    "image_then_video": [("image", (1, 6, 4), 2), ("video", (2, 4, 6), 4)],
    "image_first_token": [("image", (1, 4, 4), 0)],
}


# ---------------------------------------------------------------------------- Qwen2-VL


def test_encode_images_equals_hf_get_image_features(qwen):
    ids, features, pixels = qwen_request(TWO_IMAGES)
    grids = torch.tensor([(1, 4, 4), (1, 6, 8)])
    with torch.no_grad():
        expected = qwen.model.get_image_features(torch.cat(pixels), grids, return_dict=True).pooler_output
    rows = vision.encode_images(qwen, torch.cat(pixels), grids)
    assert [r.shape for r in rows] == [(4, 64), (12, 64)]
    assert all(torch.equal(a, b) for a, b in zip(rows, expected))
    alone = [vision.encode_images(qwen, p, g[None])[0] for p, g in zip(pixels, grids)]
    assert all(torch.allclose(a, b, atol=1e-5) for a, b in zip(rows, alone))  # batching does not mix images
    items = validated(qwen, ids, features)
    assert all(torch.equal(a, b) for a, b in zip(vision.encode_items(qwen, items), rows))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_mrope_positions_equal_hf_get_rope_index(qwen, layout):
    ids, features, pixels = qwen_request(layout)
    items = validated(qwen, ids, features)
    inputs = hf_inputs(ids, layout, pixels, items)
    expected, expected_delta = qwen.model.get_rope_index(
        inputs["input_ids"], inputs["mm_token_type_ids"], image_grid_thw=inputs.get("image_grid_thw"),
        video_grid_thw=inputs.get("video_grid_thw"))
    positions, delta = vision.mrope_positions(ids, items, qwen.config)
    assert torch.equal(positions, expected[:, 0]) and delta == int(expected_delta)


def test_mrope_positions_of_text_only_prompt(qwen):
    positions, delta = vision.mrope_positions([1, 2, 3, 4], [], qwen.config)
    assert torch.equal(positions, torch.arange(4).expand(3, 4)) and delta == 0
    assert torch.equal(vision.mrope_decode_positions(10, 2, -3), torch.tensor([[7, 8]] * 3))


@pytest.mark.parametrize("layout", LAYOUTS.values(), ids=LAYOUTS.keys())
def test_prefill_logits_equal_hf_full_forward(qwen, layout):
    ids, features, pixels = qwen_request(layout)
    items = validated(qwen, ids, features)
    with torch.no_grad():
        expected = qwen(**hf_inputs(ids, layout, pixels, items)).logits[0]
        rows = vision.encode_items(qwen, items)
        embeds = vision.build_prefill_embeddings(qwen, ids, list(zip(items, rows)))
        positions, _ = vision.mrope_positions(ids, items, qwen.config)
        actual = qwen(inputs_embeds=embeds[None], position_ids=positions[:, None, :]).logits[0]
    assert embeds.shape == (len(ids), 64)
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", [ONE_IMAGE, TWO_IMAGES, LAYOUTS["image_then_video"]],
                         ids=["one_image", "two_images", "image_then_video"])
def test_greedy_reference_decode_equals_generate(qwen, qwen_eos, layout):
    ids, features, pixels = qwen_request(layout, seed=3)
    items = validated(qwen, ids, features)
    with torch.no_grad():
        generated = qwen.generate(**hf_inputs(ids, layout, pixels, items), max_new_tokens=24, do_sample=False)
    rows = vision.encode_items(qwen, items)
    reference = vision.reference_greedy_decode(qwen, ids, list(zip(items, rows)), 24, eos_token_ids=qwen_eos)
    assert reference == generated[0, len(ids):].tolist()
    assert len(reference) >= 8  # a long enough run that wrong decode positions would show


def test_cached_rows_give_the_same_logits(qwen):
    """Rows pinned from the encoder cache (a metadata-only item) drive the prefill just like fresh ones."""
    from tito_engine.multimodal.encoder_cache import EncoderCache

    ids, features, pixels = qwen_request(TWO_IMAGES)
    spec = multimodal_spec_from_config(qwen.config, "tiny")
    cache = EncoderCache(max_bytes=1 << 20, store_id="e", model_fingerprint="tiny")
    fresh = validate_mm_features(ids, items_of(features), spec, FeaturePolicy(), cache).items
    for item, rows in zip(fresh, vision.encode_items(qwen, fresh)):
        cache.put(item.cache_key, rows)
    for item in features.items:
        item.ClearField("kwargs")
    cached = validate_mm_features(ids, items_of(features), spec, FeaturePolicy(), cache).items
    assert not any(item.needs_encoder for item in cached)
    with torch.no_grad():
        expected = qwen(**hf_inputs(ids, TWO_IMAGES, pixels, cached)).logits[0]
        embeds = vision.build_prefill_embeddings(qwen, ids, [(item, item.encoder_rows) for item in cached])
        positions, _ = vision.mrope_positions(ids, cached, qwen.config)
        actual = qwen(inputs_embeds=embeds[None], position_ids=positions[:, None, :]).logits[0]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


def test_real_image_processor_output_is_accepted_and_matches_hf(qwen, tiny_vl_model):
    processor = AutoImageProcessor.from_pretrained(tiny_vl_model, backend="pil")  # render's backend
    rng = np.random.default_rng(0)
    images = [Image.fromarray(rng.integers(0, 256, (56, 56, 3), dtype=np.uint8)),
              Image.fromarray(rng.integers(0, 256, (84, 112, 3), dtype=np.uint8))]
    processed = processor(images=images, return_tensors="pt")
    grids = [tuple(int(v) for v in g) for g in processed["image_grid_thw"]]
    patches = [g[0] * g[1] * g[2] for g in grids]
    split = torch.split(processed["pixel_values"], patches)
    ids, items = [7, 8], []
    for k, (grid, pixel) in enumerate(zip(grids, split)):
        ids.append(VISION_START)
        item = multimodal_pb2.MultiModalItem(modality=multimodal_pb2.MODALITY_IMAGE, mm_hash=f"{k + 1:064x}",
                                             placeholder=multimodal_pb2.PlaceholderRange(offset=len(ids),
                                                                                         length=patches[k] // 4))
        item.kwargs["pixel_values"].CopyFrom(tensors.from_torch(pixel))
        item.kwargs["image_grid_thw"].CopyFrom(tensors.from_numpy(np.array(grid, dtype=np.int64)))
        item.metadata["image_grid_thw"].CopyFrom(tensors.from_numpy(np.array(grid, dtype=np.int64)))
        items.append(item)
        ids += [IMAGE_PAD] * (patches[k] // 4) + [VISION_END, 9]
    valid = validated(qwen, ids, multimodal_pb2.MultiModalFeatures(items=items))
    with torch.no_grad():
        expected = qwen(input_ids=torch.tensor([ids]), pixel_values=processed["pixel_values"],
                        image_grid_thw=processed["image_grid_thw"],
                        mm_token_type_ids=vision.mm_token_type_ids(len(ids), valid)[None]).logits[0]
        embeds = vision.build_prefill_embeddings(qwen, ids, list(zip(valid, vision.encode_items(qwen, valid))))
        positions, _ = vision.mrope_positions(ids, valid, qwen.config)
        actual = qwen(inputs_embeds=embeds[None], position_ids=positions[:, None, :]).logits[0]
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)


@pytest.mark.parametrize("layout", [TWO_IMAGES, LAYOUTS["image_then_video"]], ids=["two_images", "image_then_video"])
def test_prefill_media_is_the_sparse_form_of_the_dense_prefill(qwen, layout):
    ids, features, _ = qwen_request(layout)
    items = validated(qwen, ids, features)
    pairs = list(zip(items, vision.encode_items(qwen, items)))
    media = vision.prefill_media(ids, pairs[::-1], qwen.config)  # any order in, prompt order out
    dense = vision.build_prefill_embeddings(qwen, ids, pairs)
    with torch.no_grad():
        sparse = qwen.get_input_embeddings()(torch.tensor(ids))
    sparse[media["embed_positions"]] = media["embeds"]
    assert torch.equal(sparse, dense)
    assert media["embed_positions"].tolist() == [p for item in items for p in item.embed_positions]
    positions, delta = vision.mrope_positions(ids, items, qwen.config)
    assert torch.equal(media["mrope_positions"], positions) and media["rope_delta"] == delta
    try:  # the batched runner's container, when its module is importable in this tree
        from tito_engine.model.forward import MultiModalPrefill
    except Exception:  # noqa: BLE001 - another engineer's module, possibly mid-rewrite
        return
    assert MultiModalPrefill(**media).rope_delta == delta


def test_prefill_media_of_gemma3_has_no_mrope(gemma):
    ids, features, _ = gemma_request(1)
    items = validated(gemma, ids, features)
    media = vision.prefill_media(ids, list(zip(items, vision.encode_items(gemma, items))), gemma.config)
    assert media["mrope_positions"] is None and media["rope_delta"] == 0
    assert media["embed_positions"].tolist() == list(range(4, 20)) and media["embeds"].shape == (16, 64)


def test_build_prefill_embeddings_refuses_rows_of_the_wrong_count(qwen):
    ids, features, _ = qwen_request(ONE_IMAGE)
    (item,) = validated(qwen, ids, features)
    with pytest.raises(ValueError):
        vision.build_prefill_embeddings(qwen, ids, [(item, torch.zeros(3, 64))])


# ---------------------------------------------------------------------------- Gemma3 (interleaved spans)


def gemma_request(num_images, seed=0):
    g = torch.Generator().manual_seed(seed)
    span = [BOI] + [SOFT] * 16 + [EOI]
    ids, items, pixels = [5, 6, 7], [], []
    for k in range(num_images):
        pixel = torch.randn(1, 3, 64, 64, generator=g)
        pixels.append(pixel)
        item = multimodal_pb2.MultiModalItem(
            modality=multimodal_pb2.MODALITY_IMAGE, mm_hash=f"{k + 1:064x}",
            placeholder=multimodal_pb2.PlaceholderRange(offset=len(ids), length=18,
                                                        is_embed=[False] + [True] * 16 + [False]))
        item.kwargs["pixel_values"].CopyFrom(tensors.from_torch(pixel))
        items.append(item)
        ids += span + [30 + k, 40 + k]
    return ids, multimodal_pb2.MultiModalFeatures(items=items), torch.cat(pixels)


@pytest.mark.parametrize("num_images", [1, 2])
def test_gemma3_prefill_logits_and_generate_equal_hf(gemma, gemma_path, num_images):
    ids, features, pixels = gemma_request(num_images, seed=num_images)
    items = validated(gemma, ids, features)
    token_type_ids = vision.embed_token_type_ids(len(ids), items)[None]
    assert token_type_ids.sum() == 16 * num_images
    with torch.no_grad():
        expected = gemma(input_ids=torch.tensor([ids]), pixel_values=pixels, token_type_ids=token_type_ids).logits[0]
        rows = vision.encode_items(gemma, items)
        embeds = vision.build_prefill_embeddings(gemma, ids, list(zip(items, rows)))
        actual = gemma(inputs_embeds=embeds[None], token_type_ids=token_type_ids).logits[0]
        text_embeds = gemma.get_input_embeddings()(torch.tensor(ids))
    torch.testing.assert_close(actual, expected, atol=1e-5, rtol=0)
    boundary = [items[0].offset, items[0].offset + 17]  # is_embed False: the token's own embedding stays
    assert torch.equal(embeds[boundary], text_embeds[boundary])

    eos = GenerationConfig.from_pretrained(gemma_path).eos_token_id
    eos = list(eos) if isinstance(eos, (list, tuple)) else [eos]
    with torch.no_grad():
        generated = gemma.generate(input_ids=torch.tensor([ids]), pixel_values=pixels, token_type_ids=token_type_ids,
                                   max_new_tokens=16, do_sample=False)
    reference = vision.reference_greedy_decode(gemma, ids, list(zip(items, rows)), 16, eos_token_ids=eos)
    assert reference == generated[0, len(ids):].tolist()


def test_unsupported_family_is_refused(qwen):
    class Config:
        model_type = "llava"

    with pytest.raises(ValueError):
        vision.model_family(Config())
    assert vision.uses_mrope(qwen) and not vision.uses_mrope(type("C", (), {"model_type": "gemma3"})())
