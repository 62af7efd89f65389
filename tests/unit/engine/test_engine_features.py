"""Admission of multimodal features (features.py) and the encoder cache (encoder_cache.py).

Every admission rule has a test that a bad input raises the right exception type, reason and
field path. The model spec comes from the tiny Qwen2-VL / Gemma3 configs (config only: no
weights are loaded here), so these tests take milliseconds.
"""

from __future__ import annotations

import hashlib
import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoConfig

from tito import signing, tensors
from tito.errors import FailedPrecondition, InvalidArgument, NotFound, ResourceExhausted, TitoError
from tito_models.tiny import INTERLEAVED_VL_MODEL, TEXT_MODEL, ensure_model
from tito.v1 import multimodal_pb2, tensor_pb2
from tito_engine.multimodal.encoder_cache import CacheKey, EncoderCache
from tito_engine.multimodal import features as admission
from tito_engine.multimodal.features import FeaturePolicy, content_digest
from tito_engine.service.convert import descriptor_to_proto, item_from_proto
from tito_engine.multimodal.specs import multimodal_spec_from_config

Dtype = tensor_pb2.Dtype
FINGERPRINT = "fp-test-0001"
STORE = "engine-a"
IMAGE_PAD, VIDEO_PAD, VISION_START, VISION_END = 1005, 1006, 1003, 1004
PATCH_DIM = 3 * 2 * 14 * 14  # in_channels * temporal_patch_size * patch_size**2
KEY = b"k" * 32
OPEN = FeaturePolicy()  # signing off


def items_of(features: multimodal_pb2.MultiModalFeatures | None):
    """The wire features as the servicer hands them to admission."""
    return tuple(item_from_proto(item) for item in features.items) if features is not None else ()


def validate_mm_features(token_ids, features, *args):
    return admission.validate_mm_features(token_ids, items_of(features), *args)


def validate_encode_request(features, *args):
    return admission.validate_encode_request(items_of(features), *args)


def hash_of(seed: int) -> str:
    return hashlib.sha256(f"image-{seed}".encode()).hexdigest()


@pytest.fixture(scope="module")
def spec(tiny_vl_model):
    return multimodal_spec_from_config(AutoConfig.from_pretrained(tiny_vl_model), FINGERPRINT)


@pytest.fixture(scope="module")
def gemma_spec(model_cache):
    path = ensure_model(INTERLEAVED_VL_MODEL, model_cache)
    return multimodal_spec_from_config(AutoConfig.from_pretrained(path), FINGERPRINT)


@pytest.fixture
def cache():
    return EncoderCache(max_bytes=1 << 20, store_id=STORE, model_fingerprint=FINGERPRINT)


def grid_tensor(grid, shape=(3,), dtype=np.int64):
    return tensors.from_numpy(np.array(grid, dtype=dtype).reshape(shape))


def image_item(offset: int, grid=(1, 4, 4), *, seed: int = 0, kwargs: bool = True, metadata: bool = True,
               grid_in_kwargs: bool = False, modality=multimodal_pb2.MODALITY_IMAGE) -> multimodal_pb2.MultiModalItem:
    t, h, w = grid
    item = multimodal_pb2.MultiModalItem(
        modality=modality, mm_hash=hash_of(seed),
        placeholder=multimodal_pb2.PlaceholderRange(offset=offset, length=t * h * w // 4))
    pixel_key, grid_key = (("pixel_values", "image_grid_thw") if modality != multimodal_pb2.MODALITY_VIDEO
                           else ("pixel_values_videos", "video_grid_thw"))
    if kwargs:
        pixels = np.random.default_rng(seed).standard_normal((t * h * w, PATCH_DIM), dtype=np.float32)
        item.kwargs[pixel_key].CopyFrom(tensors.from_numpy(pixels))
        if grid_in_kwargs:
            item.kwargs[grid_key].CopyFrom(grid_tensor(grid))
    if metadata:
        item.metadata[grid_key].CopyFrom(grid_tensor(grid))
    return item


def prompt(*grids, pad=IMAGE_PAD):
    """Token ids `text <vs> pad*rows <ve> text ...` and the offsets of each image's pads."""
    ids, offsets = [5, 6], []
    for t, h, w in grids:
        ids.append(VISION_START)
        offsets.append(len(ids))
        ids += [pad] * (t * h * w // 4)
        ids += [VISION_END, 7]
    return ids + [8], offsets


def request(*grids, **item_options):
    ids, offsets = prompt(*grids)
    features = multimodal_pb2.MultiModalFeatures(
        items=[image_item(offset, grid, seed=k, **item_options)
               for k, (offset, grid) in enumerate(zip(offsets, grids))])
    return ids, features


def rejects(exc_type, reason, field, ids, features, spec, policy=OPEN, cache=None):
    with pytest.raises(exc_type) as exc:
        validate_mm_features(ids, features, spec, policy, cache)
    assert exc.value.reason == reason, exc.value.message
    assert exc.value.field == field, exc.value.message
    return exc.value


def rows_for(item_grid=(1, 4, 4), hidden=64, seed=0):
    t, h, w = item_grid
    return torch.randn(t * h * w // 4, hidden, generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------- accepted requests


def test_two_images_are_decoded_with_absolute_embed_positions(spec, cache):
    ids, features = request((1, 4, 4), (1, 6, 8))
    result = validate_mm_features(ids, features, spec, OPEN, cache)
    first, second = result.items
    assert first.embed_positions == tuple(range(3, 7)) and first.num_rows == 4
    assert second.embed_positions == tuple(range(10, 22)) and second.num_rows == 12
    assert all(ids[p] == IMAGE_PAD for p in first.embed_positions + second.embed_positions)
    assert second.grid_thw == (1, 6, 8) and isinstance(second.grid_thw[0], int)
    pixels = features.items[1].kwargs["pixel_values"]
    assert torch.equal(second.encoder_inputs["pixel_values"], torch.from_numpy(tensors.to_numpy(pixels).copy()))
    assert second.encoder_inputs["pixel_values"].shape == (48, PATCH_DIM)
    assert first.needs_encoder and result.to_encode == result.items
    assert first.cache_key == CacheKey(features.items[0].mm_hash, FINGERPRINT)  # signing off: hash trusted
    assert first.content_id == features.items[0].mm_hash
    assert result.total_bytes == sum(len(t.data) for item in features.items
                                     for t in list(item.kwargs.values()) + list(item.metadata.values()))
    assert cache.stats().misses == 2 and cache.stats().hits == 0


def test_no_features_and_no_placeholders_is_empty(spec):
    result = validate_mm_features([1, 2, 3], None, spec, OPEN)
    assert not result and result.items == ()
    assert not validate_mm_features([1, 2, 3], multimodal_pb2.MultiModalFeatures(), None, OPEN)


def test_grid_may_come_in_kwargs_only(spec):
    ids, features = request((1, 4, 4), grid_in_kwargs=True, metadata=False)
    (item,) = validate_mm_features(ids, features, spec, OPEN).items
    assert item.grid_thw == (1, 4, 4) and set(item.encoder_inputs) == {"pixel_values", "image_grid_thw"}


def test_grid_of_shape_1x3_and_bfloat16_pixels_are_accepted(spec):
    ids, features = request((1, 4, 4))
    item = features.items[0]
    item.metadata["image_grid_thw"].CopyFrom(grid_tensor((1, 4, 4), shape=(1, 3)))
    bf16 = torch.randn(16, PATCH_DIM).to(torch.bfloat16)
    item.kwargs["pixel_values"].CopyFrom(tensors.from_torch(bf16))
    (validated,) = validate_mm_features(ids, features, spec, OPEN).items
    assert validated.encoder_inputs["pixel_values"].dtype == torch.bfloat16
    assert torch.equal(validated.encoder_inputs["pixel_values"], bf16)


def test_span_with_boundary_tokens_marked_not_embed_is_accepted(spec):
    ids, features = request((1, 4, 4))
    placeholder = features.items[0].placeholder
    placeholder.offset -= 1  # include <|vision_start|> and <|vision_end|>
    placeholder.length += 2
    placeholder.is_embed.extend([False] + [True] * 4 + [False])
    (item,) = validate_mm_features(ids, features, spec, OPEN).items
    assert item.embed_positions == (3, 4, 5, 6) and item.offset == 2 and item.length == 6
    assert item.is_embed == (False, True, True, True, True, False)


def test_video_item(spec):
    ids, offsets = prompt((2, 4, 4), pad=VIDEO_PAD)
    features = multimodal_pb2.MultiModalFeatures(
        items=[image_item(offsets[0], (2, 4, 4), modality=multimodal_pb2.MODALITY_VIDEO)])
    (item,) = validate_mm_features(ids, features, spec, OPEN).items
    assert item.modality == "video" and item.num_rows == 8 and "pixel_values_videos" in item.encoder_inputs


def test_spec_from_configs(spec, gemma_spec, model_cache):
    assert spec.uses_mrope and spec.hidden_size == 64
    assert spec.placeholder_token_ids == {IMAGE_PAD: "image", VIDEO_PAD: "video"}
    assert gemma_spec.placeholder_token_ids == {1015: "image"} and not gemma_spec.uses_mrope
    text_config = AutoConfig.from_pretrained(ensure_model(TEXT_MODEL, model_cache))
    assert multimodal_spec_from_config(text_config, FINGERPRINT) is None


@pytest.fixture(scope="module")
def qwen2_5_spec(tiny_qwen2_5_vl_model):
    return multimodal_spec_from_config(AutoConfig.from_pretrained(tiny_qwen2_5_vl_model), FINGERPRINT)


def timed_video(seconds=None, group="metadata", dtype=np.float32, shape=(1,)):
    ids, offsets = prompt((2, 4, 4), pad=VIDEO_PAD)
    item = image_item(offsets[0], (2, 4, 4), modality=multimodal_pb2.MODALITY_VIDEO)
    if seconds is not None:
        getattr(item, group)["second_per_grid_ts"].CopyFrom(
            tensors.from_numpy(np.array(seconds, dtype=dtype).reshape(shape)))
    return ids, multimodal_pb2.MultiModalFeatures(items=[item])


def test_qwen2_5_vl_video_takes_second_per_grid_ts(qwen2_5_spec):
    assert qwen2_5_spec.uses_mrope and set(qwen2_5_spec.modalities) == {"image", "video"}
    (item,) = validate_mm_features(*timed_video(0.5), qwen2_5_spec, OPEN).items
    assert item.second_per_grid_ts == 0.5 and item.grid_thw == (2, 4, 4)
    (item,) = validate_mm_features(*timed_video(2.0, dtype=np.float64, shape=()), qwen2_5_spec, OPEN).items
    assert item.second_per_grid_ts == 2.0
    (item,) = validate_mm_features(*timed_video(None), qwen2_5_spec, OPEN).items
    assert item.second_per_grid_ts == 1.0  # HF's get_rope_index default


@pytest.mark.parametrize("seconds,dtype,shape", [(-1.0, np.float32, (1,)), (0.0, np.float32, (1,)),
                                                 (float("nan"), np.float64, (1,)), (1, np.int64, (1,)),
                                                 ([1.0, 2.0], np.float32, (2,))])
def test_qwen2_5_vl_bad_second_per_grid_ts(qwen2_5_spec, seconds, dtype, shape):
    ids, features = timed_video(seconds, dtype=dtype, shape=shape)
    rejects(InvalidArgument, "MM_GRID_INVALID", "mm_features.items[0].metadata.second_per_grid_ts", ids, features,
            qwen2_5_spec)


def test_second_per_grid_ts_in_kwargs_must_agree_and_qwen2_vl_has_none(qwen2_5_spec, spec):
    ids, features = timed_video(0.5)
    features.items[0].kwargs["second_per_grid_ts"].CopyFrom(tensors.from_numpy(np.array([0.25], np.float32)))
    rejects(InvalidArgument, "MM_METADATA_MISMATCH", "mm_features.items[0].kwargs.second_per_grid_ts", ids,
            features, qwen2_5_spec)
    rejects(InvalidArgument, "MM_TENSOR_UNKNOWN", "mm_features.items[0].kwargs.second_per_grid_ts",
            *timed_video(0.5, group="kwargs"), spec)
    image_ids, image_features = request((1, 4, 4))
    image_features.items[0].metadata["second_per_grid_ts"].CopyFrom(tensors.from_numpy(np.ones(1, np.float32)))
    rejects(InvalidArgument, "MM_TENSOR_UNKNOWN", "mm_features.items[0].metadata.second_per_grid_ts", image_ids,
            image_features, qwen2_5_spec)


@pytest.fixture(scope="module")
def qwen3_vl_spec(tiny_qwen3_vl_model):
    return multimodal_spec_from_config(AutoConfig.from_pretrained(tiny_qwen3_vl_model), FINGERPRINT)


def qwen3_video(frame_runs=(4, 4, 4), gap=3):
    """A Qwen3-VL video span: per frame, `gap` timestamp tokens, <vs>, the frame's pads, <ve>;
    is_embed true at the pads. Grid (3, 4, 4): 3 frames of 4 rows, 16-pixel patches."""
    ids, mask = [5, 6, VISION_START], []
    offset = len(ids)
    for run in frame_runs:
        ids += [27] * gap + [VISION_START] + [VIDEO_PAD] * run + [VISION_END]
        mask += [False] * (gap + 1) + [True] * run + [False]
    ids += [VISION_END, 8]
    item = multimodal_pb2.MultiModalItem(
        modality=multimodal_pb2.MODALITY_VIDEO, mm_hash=hash_of(9),
        placeholder=multimodal_pb2.PlaceholderRange(offset=offset, length=len(mask), is_embed=mask))
    pixels = np.random.default_rng(9).standard_normal((48, 3 * 2 * 16 * 16), dtype=np.float32)
    item.kwargs["pixel_values_videos"].CopyFrom(tensors.from_numpy(pixels))
    item.metadata["video_grid_thw"].CopyFrom(grid_tensor((3, 4, 4)))
    return ids, multimodal_pb2.MultiModalFeatures(items=[item])


def test_qwen3_vl_video_embeds_one_run_per_frame(qwen3_vl_spec):
    assert qwen3_vl_spec.uses_mrope and not qwen3_vl_spec.modalities["video"].contiguous_embeds
    assert qwen3_vl_spec.modalities["image"].contiguous_embeds  # an image stays one run
    ids, features = qwen3_video()
    (item,) = validate_mm_features(ids, features, qwen3_vl_spec, OPEN).items
    assert item.num_rows == 12 and len(item.embed_positions) == 12
    assert all(ids[p] == VIDEO_PAD for p in item.embed_positions)
    # A frame whose pads are split by text breaks the per-frame runs M-RoPE needs.
    ids, features = qwen3_video(frame_runs=(4, 4, 4))
    mask = list(features.items[0].placeholder.is_embed)
    first = mask.index(True)
    ids[features.items[0].placeholder.offset + first + 1] = 27
    mask[first + 1] = False
    last = len(mask) - 1 - mask[::-1].index(True)
    ids[features.items[0].placeholder.offset + last + 1] = VIDEO_PAD  # the row moves past the frame's end
    mask[last + 1] = True
    features.items[0].placeholder.ClearField("is_embed")
    features.items[0].placeholder.is_embed.extend(mask)
    rejects(InvalidArgument, "MM_EMBEDS_NOT_CONTIGUOUS", "mm_features.items[0].placeholder.is_embed", ids, features,
            qwen3_vl_spec)


# ---------------------------------------------------------------------------- structure


@pytest.mark.parametrize("modality", [multimodal_pb2.MODALITY_AUDIO, multimodal_pb2.MODALITY_UNSPECIFIED, 42])
def test_unsupported_modality(spec, modality):
    ids, features = request((1, 4, 4))
    features.items[0].modality = modality
    rejects(InvalidArgument, "UNSUPPORTED_MODALITY", "mm_features.items[0].modality", ids, features, spec)


def test_text_only_model_rejects_any_item():
    ids, features = request((1, 4, 4))
    error = rejects(InvalidArgument, "UNSUPPORTED_MODALITY", "mm_features.items[0].modality", ids, features, None)
    assert "text-only" in error.message


@pytest.mark.parametrize("mm_hash", ["", "xyz" * 8, "ABCDEF0123456789", "abc123", "a" * 129])
def test_mm_hash_must_be_lowercase_hex(spec, mm_hash):
    ids, features = request((1, 4, 4))
    features.items[0].mm_hash = mm_hash
    rejects(InvalidArgument, "MM_HASH_INVALID", "mm_features.items[0].mm_hash", ids, features, spec)


def test_placeholder_is_required(spec):
    ids, features = request((1, 4, 4))
    features.items[0].ClearField("placeholder")
    rejects(InvalidArgument, "MM_PLACEHOLDER_MISSING", "mm_features.items[0].placeholder", ids, features, spec)


def test_placeholder_must_not_be_empty(spec):
    ids, features = request((1, 4, 4))
    features.items[0].placeholder.length = 0
    rejects(InvalidArgument, "MM_PLACEHOLDER_EMPTY", "mm_features.items[0].placeholder.length", ids, features, spec)


def test_placeholder_offset_outside_token_ids(spec):
    ids, features = request((1, 4, 4))
    features.items[0].placeholder.offset = 200  # the review's example: 100 tokens, offset 200
    rejects(InvalidArgument, "MM_PLACEHOLDER_OUT_OF_RANGE", "mm_features.items[0].placeholder.offset", ids,
            features, spec)


def test_placeholder_running_past_the_end(spec):
    ids, features = request((1, 4, 4))
    features.items[0].placeholder.offset = len(ids) - 2
    rejects(InvalidArgument, "MM_PLACEHOLDER_OUT_OF_RANGE", "mm_features.items[0].placeholder.length", ids,
            features, spec)


def test_placeholder_length_near_uint32_max_does_not_wrap(spec):
    ids, features = request((1, 4, 4))
    features.items[0].placeholder.length = 2**32 - 1
    rejects(InvalidArgument, "MM_PLACEHOLDER_OUT_OF_RANGE", "mm_features.items[0].placeholder.length", ids,
            features, spec)


def test_overlapping_ranges(spec):
    ids, features = request((1, 4, 4), (1, 4, 4))
    features.items[1].placeholder.offset = features.items[0].placeholder.offset + 2
    rejects(InvalidArgument, "MM_PLACEHOLDER_OVERLAP", "mm_features.items[1].placeholder.offset", ids, features, spec)


def test_unsorted_ranges(spec):
    ids, features = request((1, 4, 4), (1, 6, 8))
    first, second = list(features.items)
    del features.items[:]
    features.items.extend([second, first])
    rejects(InvalidArgument, "MM_PLACEHOLDER_OVERLAP", "mm_features.items[1].placeholder.offset", ids, features, spec)


def test_is_embed_length_must_equal_length(spec):
    ids, features = request((1, 4, 4))
    features.items[0].placeholder.is_embed.extend([True] * 3)
    rejects(InvalidArgument, "MM_IS_EMBED_LENGTH_MISMATCH", "mm_features.items[0].placeholder.is_embed", ids,
            features, spec)


def test_embed_count_must_equal_encoder_rows(spec):
    ids, features = request((1, 4, 4))
    features.items[0].metadata["image_grid_thw"].CopyFrom(grid_tensor((1, 4, 6)))  # 6 rows, span has 4
    features.items[0].ClearField("kwargs")
    rejects(InvalidArgument, "MM_EMBED_COUNT_MISMATCH", "mm_features.items[0].placeholder.length", ids, features, spec)


def test_embed_count_with_is_embed_must_equal_encoder_rows(spec):
    ids, features = request((1, 4, 4))
    features.items[0].placeholder.is_embed.extend([True, True, True, False])
    rejects(InvalidArgument, "MM_EMBED_COUNT_MISMATCH", "mm_features.items[0].placeholder.is_embed", ids,
            features, spec)


def test_mrope_embeds_must_be_contiguous(spec):
    ids, features = request((1, 4, 4))
    placeholder = features.items[0].placeholder
    placeholder.length = 6  # pads at 3..6, then <|vision_end|> 7, text 8
    placeholder.is_embed.extend([True, True, True, False, False, True])
    ids[8] = IMAGE_PAD
    rejects(InvalidArgument, "MM_EMBEDS_NOT_CONTIGUOUS", "mm_features.items[0].placeholder.is_embed", ids,
            features, spec)


def test_embed_positions_must_hold_the_placeholder_token(spec):
    ids, features = request((1, 4, 4))
    ids[5] = 42
    error = rejects(InvalidArgument, "MM_PLACEHOLDER_TOKEN_MISMATCH", "mm_features.items[0].placeholder", ids,
                    features, spec)
    assert [v.field for v in error.violations] == ["mm_features.items[0].placeholder", "token_ids[5]"]


def test_image_item_over_video_tokens_is_rejected(spec):
    ids, features = request((1, 4, 4))
    for p in range(3, 7):
        ids[p] = VIDEO_PAD
    rejects(InvalidArgument, "MM_PLACEHOLDER_TOKEN_MISMATCH", "mm_features.items[0].placeholder", ids, features, spec)


def test_placeholder_token_outside_any_item(spec):
    ids, features = request((1, 4, 4))
    ids[-1] = IMAGE_PAD
    rejects(InvalidArgument, "MM_PLACEHOLDER_UNCLAIMED", f"token_ids[{len(ids) - 1}]", ids, features, spec)
    rejects(InvalidArgument, "MM_PLACEHOLDER_UNCLAIMED", "token_ids[1]", [1, IMAGE_PAD, 2], None, spec)


# ---------------------------------------------------------------------------- tensors and limits


def test_unknown_dtype(spec):
    ids, features = request((1, 4, 4))
    features.items[0].kwargs["pixel_values"].dtype = Dtype.DTYPE_UNSPECIFIED
    rejects(InvalidArgument, "TENSOR_DTYPE_INVALID", "mm_features.items[0].kwargs.pixel_values.dtype", ids,
            features, spec)


def test_data_length_must_match_shape(spec):
    ids, features = request((1, 4, 4))
    features.items[0].kwargs["pixel_values"].data = features.items[0].kwargs["pixel_values"].data[:-4]
    rejects(InvalidArgument, "TENSOR_SIZE_MISMATCH", "mm_features.items[0].kwargs.pixel_values.data", ids,
            features, spec)


def test_metadata_tensor_is_checked_too(spec):
    ids, features = request((1, 4, 4))
    features.items[0].metadata["image_grid_thw"].shape.append(2)
    rejects(InvalidArgument, "TENSOR_SIZE_MISMATCH", "mm_features.items[0].metadata.image_grid_thw.data", ids,
            features, spec)


def test_item_byte_limit(spec):
    ids, features = request((1, 4, 4))
    error = rejects(ResourceExhausted, "MM_ITEM_TOO_LARGE", "mm_features.items[0]", ids, features, spec,
                    FeaturePolicy(max_item_bytes=1000))
    assert "--max-mm-item-bytes" in error.message and error.metadata["limit"] == "max_item_bytes"


def test_request_byte_limit(spec):
    ids, features = request((1, 4, 4), (1, 4, 4))
    one_item = sum(len(t.data) for t in list(features.items[0].kwargs.values()) +
                   list(features.items[0].metadata.values()))
    error = rejects(ResourceExhausted, "MM_REQUEST_TOO_LARGE", "mm_features", ids, features, spec,
                    FeaturePolicy(max_request_bytes=one_item + 10))
    assert "--max-mm-request-bytes" in error.message and "items[1]" in error.message


def test_item_count_limit(spec):
    ids, features = request((1, 4, 4), (1, 4, 4))
    rejects(ResourceExhausted, "MM_TOO_MANY_ITEMS", "mm_features.items", ids, features, spec,
            FeaturePolicy(max_items=1))


# ---------------------------------------------------------------------------- model kwargs


@pytest.mark.parametrize("group", ["kwargs", "metadata"])
def test_unknown_tensor_name(spec, group):
    ids, features = request((1, 4, 4))
    getattr(features.items[0], group)["pixel_attention_mask"].CopyFrom(grid_tensor((1, 1, 1)))
    rejects(InvalidArgument, "MM_TENSOR_UNKNOWN", f"mm_features.items[0].{group}.pixel_attention_mask", ids,
            features, spec)


def test_kwargs_without_pixel_values(spec):
    ids, features = request((1, 4, 4), grid_in_kwargs=True)
    del features.items[0].kwargs["pixel_values"]
    rejects(InvalidArgument, "MM_TENSOR_MISSING", "mm_features.items[0].kwargs.pixel_values", ids, features, spec)


def test_kwargs_without_any_grid(spec):
    ids, features = request((1, 4, 4), metadata=False)
    rejects(InvalidArgument, "MM_TENSOR_MISSING", "mm_features.items[0].kwargs.image_grid_thw", ids, features, spec)


@pytest.mark.parametrize("shape, dtype", [((16, PATCH_DIM + 1), np.float32), ((17, PATCH_DIM), np.float32),
                                          ((16 * PATCH_DIM,), np.float32), ((16, PATCH_DIM), np.int32)])
def test_pixel_values_shape_and_dtype(spec, shape, dtype):
    ids, features = request((1, 4, 4))
    features.items[0].kwargs["pixel_values"].CopyFrom(tensors.from_numpy(np.zeros(shape, dtype=dtype)))
    rejects(InvalidArgument, "MM_TENSOR_SHAPE_INVALID", "mm_features.items[0].kwargs.pixel_values", ids, features, spec)


@pytest.mark.parametrize("grid_tensor_value", [
    grid_tensor((1, 4, 4), dtype=np.int32), grid_tensor((1, 4, 4, 1), shape=(4,)), grid_tensor((1, 4, 4), shape=(3, 1)),
    grid_tensor((0, 4, 4)), grid_tensor((1, 3, 4)), grid_tensor((1, -4, -4)),
])
def test_grid_must_be_int64_three_positive_mergeable(spec, grid_tensor_value):
    ids, features = request((1, 4, 4))
    features.items[0].metadata["image_grid_thw"].CopyFrom(grid_tensor_value)
    rejects(InvalidArgument, "MM_GRID_INVALID", "mm_features.items[0].metadata.image_grid_thw", ids, features, spec)


def test_kwargs_grid_must_agree_with_metadata_grid(spec):
    ids, features = request((1, 4, 4), grid_in_kwargs=True)
    features.items[0].kwargs["image_grid_thw"].CopyFrom(grid_tensor((1, 2, 8)))
    rejects(InvalidArgument, "MM_METADATA_MISMATCH", "mm_features.items[0].kwargs.image_grid_thw", ids, features, spec)


def test_huge_grid_in_metadata_is_rejected_by_the_span_not_allocated(spec, cache):
    ids, features = request((1, 4, 4), kwargs=False)
    features.items[0].metadata["image_grid_thw"].CopyFrom(grid_tensor((2**20, 2**20, 2**20)))
    rejects(InvalidArgument, "MM_EMBED_COUNT_MISMATCH", "mm_features.items[0].placeholder.length", ids, features,
            spec, cache=cache)


def test_gemma3_interleaved_span(gemma_spec):
    span = [1013] + [1015] * 16 + [1014]
    ids = [5, 6] + span + [7]
    item = multimodal_pb2.MultiModalItem(
        modality=multimodal_pb2.MODALITY_IMAGE, mm_hash=hash_of(1),
        placeholder=multimodal_pb2.PlaceholderRange(offset=2, length=18, is_embed=[False] + [True] * 16 + [False]))
    item.kwargs["pixel_values"].CopyFrom(tensors.from_numpy(np.zeros((1, 3, 64, 64), dtype=np.float32)))
    item.kwargs["num_crops"].CopyFrom(tensors.from_numpy(np.zeros((1,), dtype=np.int64)))
    features = multimodal_pb2.MultiModalFeatures(items=[item])
    item = features.items[0]  # the message copied it: edit the copy inside the request
    (validated,) = validate_mm_features(ids, features, gemma_spec, OPEN).items
    assert validated.embed_positions == tuple(range(3, 19)) and validated.grid_thw is None

    del item.placeholder.is_embed[:]  # every position an embed: 18 != 16 rows
    rejects(InvalidArgument, "MM_EMBED_COUNT_MISMATCH", "mm_features.items[0].placeholder.length", ids, features,
            gemma_spec)
    item.placeholder.is_embed.extend([False] + [True] * 16 + [False])
    item.kwargs["num_crops"].CopyFrom(tensors.from_numpy(np.ones((1,), dtype=np.int64)))
    rejects(InvalidArgument, "MM_TENSOR_SHAPE_INVALID", "mm_features.items[0].kwargs.num_crops", ids, features,
            gemma_spec)
    del item.kwargs["num_crops"]
    item.kwargs["pixel_values"].CopyFrom(tensors.from_numpy(np.zeros((1, 3, 32, 32), dtype=np.float32)))
    rejects(InvalidArgument, "MM_TENSOR_SHAPE_INVALID", "mm_features.items[0].kwargs.pixel_values", ids, features,
            gemma_spec)


# ---------------------------------------------------------------------------- tensors required, cache


def test_layout_only_item_needs_tensors(spec, cache):
    ids, features = request((1, 4, 4), kwargs=False, metadata=False)
    error = rejects(FailedPrecondition, "MM_TENSORS_REQUIRED", "mm_features.items[0].metadata", ids, features, spec,
                    cache=cache)
    assert "mm_payload TENSORS" in error.message


def test_layout_only_item_is_refused_even_when_cached(spec, cache):
    """M-RoPE needs the grid whatever the cache holds (the failure mode of the second review)."""
    ids, features = request((1, 4, 4), kwargs=False, metadata=False)
    cache.put(cache.key_for(features.items[0].mm_hash), rows_for())
    rejects(FailedPrecondition, "MM_TENSORS_REQUIRED", "mm_features.items[0].metadata", ids, features, spec,
            cache=cache)


def test_metadata_only_item_on_a_cache_miss(spec, cache):
    ids, features = request((1, 4, 4), kwargs=False)
    error = rejects(FailedPrecondition, "MM_TENSORS_REQUIRED", "mm_features.items[0].kwargs", ids, features, spec,
                    cache=cache)
    assert "mm_payload TENSORS" in error.message
    rejects(FailedPrecondition, "MM_TENSORS_REQUIRED", "mm_features.items[0].kwargs", ids, features, spec)  # no cache


def test_metadata_only_item_hits_the_cache_and_pins_the_rows(spec, cache):
    ids, features = request((1, 4, 4), kwargs=False)
    rows = rows_for()
    cache.put(cache.key_for(features.items[0].mm_hash), rows)
    (item,) = validate_mm_features(ids, features, spec, OPEN, cache).items
    assert not item.needs_encoder and torch.equal(item.encoder_rows, rows) and item.encoder_inputs == {}
    assert cache.stats().hits == 1
    cache.clear()  # eviction after admission cannot take the rows away from the request
    assert torch.equal(item.encoder_rows, rows)


def test_item_with_tensors_hits_the_cache_and_skips_decoding(spec, cache):
    ids, features = request((1, 4, 4))
    cache.put(cache.key_for(features.items[0].mm_hash), rows_for())
    (item,) = validate_mm_features(ids, features, spec, OPEN, cache).items
    assert not item.needs_encoder and item.encoder_inputs == {}


def test_cached_rows_that_disagree_with_metadata(spec, cache):
    ids, features = request((1, 4, 4), kwargs=False)
    cache.put(cache.key_for(features.items[0].mm_hash), rows_for((1, 6, 8)))
    rejects(InvalidArgument, "MM_METADATA_MISMATCH", "mm_features.items[0].metadata", ids, features, spec, cache=cache)


def test_rejected_request_does_not_touch_the_cache(spec, cache):
    ids, features = request((1, 4, 4), (1, 4, 4))
    cache.put(cache.key_for(features.items[0].mm_hash), rows_for())
    features.items[1].mm_hash = "nothex"
    rejects(InvalidArgument, "MM_HASH_INVALID", "mm_features.items[1].mm_hash", ids, features, spec, cache=cache)
    assert cache.stats().hits == 0 and cache.stats().misses == 0


# ---------------------------------------------------------------------------- EC descriptors


def descriptor_item(spec, cache, *, kwargs=False):
    ids, features = request((1, 4, 4), kwargs=kwargs)
    key = cache.key_for(features.items[0].mm_hash)
    cache.put(key, rows_for())
    features.items[0].ec_descriptor.CopyFrom(descriptor_to_proto(cache.descriptor_for(key)))
    return ids, features


def test_local_descriptor_is_resolved(spec, cache):
    ids, features = descriptor_item(spec, cache)
    (item,) = validate_mm_features(ids, features, spec, OPEN, cache).items
    assert not item.needs_encoder and item.encoder_rows.shape == (4, 64)


@pytest.mark.parametrize("part, value", [
    ("store_id", "engine-b"), ("uri", "engine://engine-b"), ("model_fingerprint", "other-model"),
    ("key", f"{FINGERPRINT}/{hash_of(99)}"), ("checksum", "sha256:" + "0" * 64), ("shape", [5, 64]),
])
def test_forged_descriptor_is_rejected_without_use(spec, cache, part, value):
    ids, features = descriptor_item(spec, cache)
    ec = features.items[0].ec_descriptor
    if part == "shape":
        del ec.shape[:]
        ec.shape.extend(value)
    else:
        setattr(ec, part, value)
    hits_before = cache.stats().hits
    rejects(InvalidArgument, "EC_DESCRIPTOR_INVALID", f"mm_features.items[0].ec_descriptor.{part}", ids, features,
            spec, cache=cache)
    if part in ("store_id", "uri", "model_fingerprint", "key"):
        assert cache.stats().hits == hits_before  # never looked up


def test_descriptor_pointing_at_another_items_entry_is_rejected(spec, cache):
    ids, features = descriptor_item(spec, cache)
    other = cache.key_for(hash_of(99))
    cache.put(other, rows_for())
    # Genuine, but for other content:
    features.items[0].ec_descriptor.CopyFrom(descriptor_to_proto(cache.descriptor_for(other)))
    rejects(InvalidArgument, "EC_DESCRIPTOR_INVALID", "mm_features.items[0].ec_descriptor.key", ids, features, spec,
            cache=cache)


def test_descriptor_on_an_engine_without_cache(spec, cache):
    ids, features = descriptor_item(spec, cache)
    rejects(InvalidArgument, "EC_DESCRIPTOR_INVALID", "mm_features.items[0].ec_descriptor.store_id", ids, features,
            spec)


def test_evicted_descriptor_entry(spec, cache):
    ids, features = descriptor_item(spec, cache)
    cache.clear()
    error = rejects(FailedPrecondition, "MM_TENSORS_REQUIRED", "mm_features.items[0].kwargs", ids, features, spec,
                    cache=cache)
    assert "no longer" in error.message
    ids, features = descriptor_item(spec, cache, kwargs=True)
    cache.clear()
    (item,) = validate_mm_features(ids, features, spec, OPEN, cache).items  # falls back to the tensors
    assert item.needs_encoder and "pixel_values" in item.encoder_inputs


# ---------------------------------------------------------------------------- signing


def signed(features, key=KEY, key_id=""):
    for item in features.items:
        signing.sign_item(item, key, key_id)
    return features


REQUIRED = FeaturePolicy(signing_keys={"": KEY, "k2": b"2" * 32}, require_signed_features=True)
OPTIONAL = FeaturePolicy(signing_keys={"": KEY})


def test_policy_requiring_signatures_needs_keys():
    with pytest.raises(ValueError):
        FeaturePolicy(require_signed_features=True)


def test_the_domain_item_has_the_wire_items_signed_bytes(cache):
    """The servicer's conversion keeps every field the tag covers: the same canonical bytes."""
    item = image_item(3)
    item.placeholder.is_embed.extend([True, False, True, True])
    key = cache.key_for(item.mm_hash)
    cache.put(key, rows_for())
    item.ec_descriptor.CopyFrom(descriptor_to_proto(cache.descriptor_for(key)))
    for with_descriptor in (True, False):
        assert signing.signed_bytes(item_from_proto(item), with_descriptor=with_descriptor) == \
            signing.signed_bytes(item, with_descriptor=with_descriptor)
    bare = multimodal_pb2.MultiModalItem(mm_hash=hash_of(1))  # no placeholder: signs as the wire's default
    assert signing.signed_bytes(item_from_proto(bare)) == signing.signed_bytes(bare)


def test_signed_items_verify(spec):
    ids, features = request((1, 4, 4), (1, 6, 8))
    signed(features)
    signing.sign_item(features.items[1], b"2" * 32, "k2")  # rotated key
    items = validate_mm_features(ids, features, spec, REQUIRED).items
    assert all(item.signed for item in items)


def test_required_signature_missing(spec):
    ids, features = request((1, 4, 4), (1, 4, 4))
    signing.sign_item(features.items[0], KEY)
    rejects(InvalidArgument, "MM_SIGNATURE_INVALID", "mm_features.items[1].auth_tag", ids, features, spec, REQUIRED)


@pytest.mark.parametrize("policy", [REQUIRED, OPTIONAL], ids=["required", "optional"])
@pytest.mark.parametrize("tamper", ["hash", "pixels", "placeholder", "key_id", "wrong_key", "short_tag"])
def test_bad_signature_is_rejected(spec, policy, tamper):
    ids, features = request((1, 4, 4))
    item = features.items[0]
    signing.sign_item(item, b"x" * 32 if tamper == "wrong_key" else KEY)
    if tamper == "hash":
        item.mm_hash = hash_of(7)
    elif tamper == "pixels":
        data = bytearray(item.kwargs["pixel_values"].data)
        data[0] ^= 1
        item.kwargs["pixel_values"].data = bytes(data)
    elif tamper == "placeholder":
        item.placeholder.is_embed.extend([True] * 4)
    elif tamper == "key_id":
        item.auth_key_id = "unknown"
    elif tamper == "short_tag":
        item.auth_tag = item.auth_tag[:16]
    rejects(InvalidArgument, "MM_SIGNATURE_INVALID", "mm_features.items[0].auth_tag", ids, features, spec, policy)


def test_signed_metadata_only_item_may_hit_the_cache(spec, cache):
    ids, features = request((1, 4, 4), kwargs=False)
    cache.put(cache.key_for(features.items[0].mm_hash), rows_for())
    (item,) = validate_mm_features(ids, signed(features), spec, REQUIRED, cache).items
    assert item.signed and not item.needs_encoder


def test_signed_descriptor_is_resolved(spec, cache):
    ids, features = descriptor_item(spec, cache)
    (item,) = validate_mm_features(ids, signed(features), spec, REQUIRED, cache).items
    assert not item.needs_encoder


def test_unsigned_metadata_only_item_cannot_claim_a_hit(spec, cache):
    ids, features = request((1, 4, 4), kwargs=False)
    cache.put(cache.key_for(features.items[0].mm_hash), rows_for())
    error = rejects(FailedPrecondition, "MM_TENSORS_REQUIRED", "mm_features.items[0].kwargs", ids, features, spec,
                    OPTIONAL, cache)
    assert "unsigned" in error.message
    assert cache.stats().hits == 0


def test_unsigned_descriptor_is_not_honoured(spec, cache):
    ids, features = descriptor_item(spec, cache)
    rejects(FailedPrecondition, "MM_TENSORS_REQUIRED", "mm_features.items[0].kwargs", ids, features, spec, OPTIONAL,
            cache)


def test_unsigned_item_with_tensors_is_keyed_by_its_tensors_not_its_claimed_hash(spec, cache):
    """A client that names someone else's hash gets neither their output nor can poison it."""
    ids, features = request((1, 4, 4))
    victim = cache.key_for(features.items[0].mm_hash)
    cache.put(victim, rows_for(seed=5))
    (item,) = validate_mm_features(ids, features, spec, OPTIONAL, cache).items
    assert item.needs_encoder and not item.signed
    assert item.cache_key == cache.key_for(content_digest(features.items[0])) != victim
    assert item.content_id == content_digest(features.items[0]) != features.items[0].mm_hash
    # once its own output is cached, the same tensors hit it (through a descriptor too)
    cache.put(item.cache_key, rows_for(seed=6))
    (again,) = validate_mm_features(ids, features, spec, OPTIONAL, cache).items
    assert torch.equal(again.encoder_rows, rows_for(seed=6))
    features.items[0].ec_descriptor.CopyFrom(descriptor_to_proto(cache.descriptor_for(item.cache_key)))
    (via_descriptor,) = validate_mm_features(ids, features, spec, OPTIONAL, cache).items
    assert torch.equal(via_descriptor.encoder_rows, rows_for(seed=6))


def test_content_digest_depends_on_every_tensor():
    _, features = request((1, 4, 4), (1, 4, 4))
    a, b = features.items
    assert content_digest(a) != content_digest(b)
    c = multimodal_pb2.MultiModalItem()
    c.CopyFrom(a)
    c.mm_hash, c.placeholder.offset = hash_of(9), 99  # not part of the content
    assert content_digest(c) == content_digest(a)
    c.metadata["image_grid_thw"].CopyFrom(grid_tensor((1, 2, 8)))
    assert content_digest(c) != content_digest(a)


def test_without_keys_tags_are_ignored(spec, cache):
    ids, features = request((1, 4, 4), kwargs=False)
    features.items[0].auth_tag = b"\x00" * 32
    cache.put(cache.key_for(features.items[0].mm_hash), rows_for())
    (item,) = validate_mm_features(ids, features, spec, OPEN, cache).items
    assert not item.signed and not item.needs_encoder


# ---------------------------------------------------------------------------- Encode


def test_encode_then_generate_with_the_returned_descriptor(spec, cache):
    _, features = request((1, 4, 4), (1, 6, 8))
    encode = validate_encode_request(features, spec, OPEN, cache)
    assert [item.needs_encoder for item in encode.items] == [True, True] and encode.items[1].num_rows == 12
    assert encode.items[0].embed_positions == ()
    descriptors = []
    for item in encode.to_encode:  # what the Encode servicer does after running the encoder
        cache.put(item.cache_key, rows_for((1, 4, 4) if item.index == 0 else (1, 6, 8), seed=item.index))
        descriptors.append(descriptor_to_proto(cache.descriptor_for(item.cache_key)))
    assert not any(item.needs_encoder for item in validate_encode_request(features, spec, OPEN, cache).items)

    ids, generate = request((1, 4, 4), (1, 6, 8), kwargs=False)
    for item, descriptor in zip(generate.items, descriptors):
        item.ec_descriptor.CopyFrom(descriptor)
    items = validate_mm_features(ids, generate, spec, OPEN, cache).items
    assert [tuple(item.encoder_rows.shape) for item in items] == [(4, 64), (12, 64)]


def rejects_encode(exc_type, reason, field, features, spec, policy=OPEN, cache=None):
    with pytest.raises(exc_type) as exc:
        validate_encode_request(features, spec, policy, cache)
    assert (exc.value.reason, exc.value.field) == (reason, field), exc.value.message


def test_encode_needs_tensors(spec, cache):
    _, features = request((1, 4, 4), kwargs=False)
    rejects_encode(FailedPrecondition, "MM_TENSORS_REQUIRED", "mm_features.items[0].kwargs", features, spec,
                   cache=cache)


def test_encode_needs_an_encoder_cache(spec):
    _, features = request((1, 4, 4))
    rejects_encode(FailedPrecondition, "ENCODER_CACHE_DISABLED", None, features, spec)


def test_encode_needs_items(spec, cache):
    rejects_encode(InvalidArgument, "MM_ITEMS_EMPTY", "mm_features.items", multimodal_pb2.MultiModalFeatures(), spec,
                   cache=cache)


def test_encode_checks_signatures_and_tensors(spec, cache):
    _, features = request((1, 4, 4))
    rejects_encode(InvalidArgument, "MM_SIGNATURE_INVALID", "mm_features.items[0].auth_tag", features, spec,
                   REQUIRED, cache)
    features.items[0].kwargs["pixel_values"].shape[0] = 3
    rejects_encode(InvalidArgument, "TENSOR_SIZE_MISMATCH", "mm_features.items[0].kwargs.pixel_values.data",
                   features, spec, cache=cache)


def test_encode_needs_no_placeholder(spec, cache):
    """Encode has no token ids, so an item's placeholder means nothing to it and may be absent:
    the item is encoded under the same key as with one (it once raised AttributeError: INTERNAL)."""
    _, features = request((1, 4, 4))
    with_placeholder = validate_encode_request(features, spec, OPEN, cache).items[0]
    features.items[0].ClearField("placeholder")
    (item,) = validate_encode_request(features, spec, OPEN, cache).items
    assert item.needs_encoder and item.cache_key == with_placeholder.cache_key and item.num_rows == 4


def test_unsigned_encode_is_keyed_by_content(spec, cache):
    _, features = request((1, 4, 4))
    (item,) = validate_encode_request(features, spec, OPTIONAL, cache).items
    assert item.cache_key == cache.key_for(content_digest(features.items[0]))


# ---------------------------------------------------------------------------- encoder cache


def test_cache_hits_misses_and_checksum(cache):
    key = cache.key_for(hash_of(1))
    assert cache.get(key) is None
    rows = rows_for()
    entry = cache.put(key, rows)
    assert cache.get(key) is entry and torch.equal(entry.rows, rows)
    assert entry.checksum == "sha256:" + hashlib.sha256(rows.numpy().astype("<f4").tobytes()).hexdigest()
    assert entry.byte_size == 4 * 64 * 4 and entry.shape == (4, 64) and entry.dtype == Dtype.DTYPE_FLOAT32
    stats = cache.stats()
    assert (stats.hits, stats.misses, stats.entries, stats.bytes_used) == (1, 1, 1, 1024)


def test_cache_descriptor(cache):
    key = cache.key_for(hash_of(1))
    entry = cache.put(key, rows_for().to(torch.bfloat16))
    ec = cache.descriptor_for(key)
    assert (ec.store_id, ec.uri, ec.key, ec.model_fingerprint) == (STORE, f"engine://{STORE}",
                                                                  f"{FINGERPRINT}/{hash_of(1)}", FINGERPRINT)
    assert (ec.dtype, list(ec.shape), ec.byte_size) == (Dtype.DTYPE_BFLOAT16, [4, 64], 512)
    assert ec.checksum == entry.checksum and ec.checksum.startswith("sha256:") and len(ec.checksum) == 71
    with pytest.raises(NotFound) as exc:
        cache.descriptor_for(cache.key_for(hash_of(2)))
    assert exc.value.reason == "ENCODER_CACHE_MISS"


def test_cache_evicts_least_recently_used_within_the_budget():
    cache = EncoderCache(max_bytes=3 * 1024, store_id=STORE, model_fingerprint=FINGERPRINT)
    keys = [cache.key_for(hash_of(k)) for k in range(4)]
    for key in keys[:3]:
        cache.put(key, rows_for())
    assert cache.get(keys[0]) is not None  # now most recent: keys[1] is the oldest
    cache.put(keys[3], rows_for())
    assert keys[1] not in cache and all(k in cache for k in (keys[0], keys[2], keys[3]))
    assert cache.stats().bytes_used == 3 * 1024 and cache.stats().evictions == 1
    cache.put(keys[0], rows_for((1, 4, 8)))  # replacing an entry re-accounts its bytes
    assert cache.stats().bytes_used <= 3 * 1024 and keys[0] in cache


def test_cache_does_not_keep_an_entry_larger_than_the_budget():
    cache = EncoderCache(max_bytes=1000, store_id=STORE, model_fingerprint=FINGERPRINT)
    entry = cache.put(cache.key_for(hash_of(1)), rows_for())
    assert entry.checksum.startswith("sha256:") and len(cache) == 0 and cache.stats().bytes_used == 0


def test_cache_refuses_another_models_key(cache):
    with pytest.raises(ValueError):
        cache.put(CacheKey(hash_of(1), "other-model"), rows_for())


def test_cache_is_thread_safe():
    cache = EncoderCache(max_bytes=8 * 1024, store_id=STORE, model_fingerprint=FINGERPRINT)
    rows = rows_for()
    errors: list[BaseException] = []

    def worker(seed: int) -> None:
        try:
            for k in range(200):
                key = cache.key_for(hash_of((seed * 7 + k) % 20))
                if k % 2:
                    cache.put(key, rows)
                elif cache.get(key) is not None:
                    try:
                        cache.descriptor_for(key)
                    except NotFound:
                        pass  # evicted by another thread since the get: allowed
        except BaseException as error:  # pragma: no cover - reported below
            errors.append(error)

    threads = [threading.Thread(target=worker, args=(s,)) for s in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    stats = cache.stats()
    assert not errors
    assert stats.bytes_used == 1024 * stats.entries <= 8 * 1024
    assert stats.hits + stats.misses == 4 * 100


# ---------------------------------------------------------------------------- robustness

_INTS = st.one_of(st.integers(0, 40), st.integers(0, 2**32 - 1))
_MUTATIONS = st.lists(st.tuples(st.sampled_from([
    "offset", "length", "is_embed", "dtype", "shape", "truncate", "grid", "grid_dtype", "drop_pixels", "drop_grid",
    "hash", "modality", "descriptor", "token", "extra_name", "sign", "tag",
]), st.integers(0, 1), _INTS, st.lists(st.booleans(), max_size=20)), min_size=1, max_size=4)


def _mutate(ids, features, cache, mutation):
    name, which, number, flags = mutation
    item = features.items[which]
    if name == "offset":
        item.placeholder.offset = number
    elif name == "length":
        item.placeholder.length = number
    elif name == "is_embed":
        del item.placeholder.is_embed[:]
        item.placeholder.is_embed.extend(flags)
    elif name == "dtype":
        item.kwargs["pixel_values"].dtype = number % 12
    elif name == "shape":
        shape = item.kwargs["pixel_values"].shape  # (creates an empty tensor if dropped: also a case)
        if len(shape) <= number % 2:
            shape.append(number - 3)
        else:
            shape[number % 2] = number - 3
    elif name == "truncate":
        item.kwargs["pixel_values"].data = item.kwargs["pixel_values"].data[:number]
    elif name == "grid":
        item.metadata["image_grid_thw"].CopyFrom(grid_tensor((number % 3, number % 7, number)))
    elif name == "grid_dtype":
        item.metadata["image_grid_thw"].dtype = number % 12
    elif name == "drop_pixels":
        item.ClearField("kwargs")
    elif name == "drop_grid":
        item.ClearField("metadata")
    elif name == "hash":
        item.mm_hash = hash_of(number)[: number % 70]
    elif name == "modality":
        item.modality = number % 5
    elif name == "descriptor":
        key = cache.key_for(item.mm_hash if number % 2 else hash_of(number))
        cache.put(key, rows_for((1, 4, 4) if number % 3 else (1, 6, 8)))
        item.ec_descriptor.CopyFrom(descriptor_to_proto(cache.descriptor_for(key)))
        if number % 5 == 0:
            item.ec_descriptor.checksum = "sha256:0"
    elif name == "token":
        ids[number % len(ids)] = IMAGE_PAD if flags else number % 1013
    elif name == "extra_name":
        item.kwargs["x" * (number % 100)].CopyFrom(grid_tensor((1, 1, 1)))
    elif name == "sign":
        signing.sign_item(item, KEY)
    elif name == "tag":
        item.auth_tag = bytes(number % 40)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(mutations=_MUTATIONS, policy=st.sampled_from([OPEN, OPTIONAL, REQUIRED]), with_cache=st.booleans())
def test_any_mutated_request_is_admitted_or_refused_with_a_tito_error(spec, mutations, policy, with_cache):
    """No input makes admission raise anything but a TitoError (which maps to a 4xx-like status)."""
    cache = EncoderCache(max_bytes=1 << 20, store_id=STORE, model_fingerprint=FINGERPRINT)
    ids, features = request((1, 4, 4), (1, 6, 8))
    for mutation in mutations:
        _mutate(ids, features, cache, mutation)
    try:
        result = validate_mm_features(ids, features, spec, policy, cache if with_cache else None)
    except TitoError as error:
        assert error.reason and error.reason.isupper() and error.field
        return
    for item in result.items:  # admitted: everything the runner relies on holds
        assert len(item.embed_positions) == item.num_rows > 0
        assert all(ids[p] == spec.modalities[item.modality].placeholder_token_id for p in item.embed_positions)
        assert item.encoder_rows is not None or "pixel_values" in item.encoder_inputs
        if item.encoder_rows is not None:
            assert item.encoder_rows.shape[0] == item.num_rows
