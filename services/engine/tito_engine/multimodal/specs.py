"""What a model accepts as media, per family: the modalities, each one's placeholder token, its
encoder inputs and metadata, and how many encoder rows an item produces (`ModelMultimodalSpec`,
from the HF config by `multimodal_spec_from_config`). Admission (features.py) checks items against
it; render's processors produce the same layouts. Torch-free: tensors are read with tito.tensors.
"""

from __future__ import annotations

import math
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from tito import tensors
from tito.errors import FailedPrecondition, InvalidArgument
from tito.v1 import tensor_pb2

from tito_engine.multimodal.domain import MediaItem, RawTensor

Dtype = tensor_pb2.Dtype
FLOAT_DTYPES = frozenset({Dtype.DTYPE_FLOAT32, Dtype.DTYPE_FLOAT16, Dtype.DTYPE_BFLOAT16, Dtype.DTYPE_FLOAT64})
INT_DTYPES = frozenset({Dtype.DTYPE_INT64, Dtype.DTYPE_INT32})

#: An item the engine cannot serve without its tensors (re-render with mm_payload TENSORS).
TENSORS_REQUIRED = "MM_TENSORS_REQUIRED"


@dataclass(frozen=True)
class ItemLayout:
    """What the model's metadata says about one item: encoder output rows and, if any, its grid."""

    num_rows: int
    grid_thw: tuple[int, int, int] | None = None
    # Qwen2.5-VL videos: seconds per temporal grid step (M-RoPE time axis); None elsewhere.
    second_per_grid_ts: float | None = None


class ModalitySpec(Protocol):
    """How one model consumes one modality. Implementations raise tito errors naming `path`."""

    modality: str  # "image", "video", "audio"
    placeholder_token_id: int
    contiguous_embeds: bool  # M-RoPE models: the embed positions must form one run

    def check_names(self, item: MediaItem, path: str) -> None:
        """Reject kwargs/metadata names the model does not know."""

    def layout(self, item: MediaItem, path: str) -> ItemLayout:
        """Encoder output rows (and grid) from metadata, or kwargs when metadata lacks them."""

    def check_encoder_inputs(self, item: MediaItem, layout: ItemLayout, path: str) -> None:
        """The kwargs are present with plausible shapes and dtypes (only called when kwargs exist)."""


@dataclass(frozen=True)
class ModelMultimodalSpec:
    """The media a loaded model accepts, and the identity its encoder outputs are keyed by."""

    model_fingerprint: str
    modalities: Mapping[str, ModalitySpec]
    hidden_size: int
    uses_mrope: bool = False

    @property
    def placeholder_token_ids(self) -> dict[int, str]:
        return {spec.placeholder_token_id: name for name, spec in self.modalities.items()}


def tensor_path(path: str, group: str, name: str) -> str:
    # Names are caller-chosen map keys: clip them so an error (sent in trailers) stays small.
    return f"{path}.{group}.{name if len(name) <= 64 else name[:64] + '...'}"


def _grid_from(tensor: RawTensor, field_path: str, merge: int) -> tuple[int, int, int]:
    if tensor.dtype != Dtype.DTYPE_INT64 or list(tensor.shape) not in ([3], [1, 3]):
        raise InvalidArgument(
            f"{field_path} must be an INT64 tensor of shape [3] or [1, 3] (t, h, w), got "
            f"{Dtype.Name(tensor.dtype)} {list(tensor.shape)}", reason="MM_GRID_INVALID", field=field_path)
    t, h, w = (int(v) for v in struct.unpack("<3q", tensor.data))
    if t < 1 or h < 1 or w < 1 or h % merge or w % merge:
        raise InvalidArgument(
            f"{field_path} = [{t}, {h}, {w}]: every entry must be >= 1 and h, w multiples of the "
            f"spatial merge size {merge}", reason="MM_GRID_INVALID", field=field_path)
    return t, h, w


def _seconds_from(tensor: RawTensor, field_path: str) -> float:
    """A positive, finite float32/float64 scalar given as shape [] or [1] (second_per_grid_ts)."""
    itemsize = {Dtype.DTYPE_FLOAT32: 4, Dtype.DTYPE_FLOAT64: 8}.get(tensor.dtype)
    value = None
    if itemsize is not None and list(tensor.shape) in ([], [1]) and len(tensor.data) == itemsize:
        value = struct.unpack("<f" if itemsize == 4 else "<d", tensor.data)[0]
    if value is None or not math.isfinite(value) or value <= 0:
        raise InvalidArgument(f"{field_path} must be one positive finite FLOAT32 or FLOAT64 value (shape [1]): "
                              f"the seconds each temporal grid step of the video spans", reason="MM_GRID_INVALID",
                              field=field_path)
    return value


@dataclass(frozen=True)
class Qwen2VLVisionSpec:
    """Qwen2-VL images or videos: patches flattened to rows, a (t, h, w) grid, M-RoPE."""

    modality: str
    placeholder_token_id: int
    pixel_key: str  # "pixel_values" | "pixel_values_videos"
    grid_key: str  # "image_grid_thw" | "video_grid_thw"
    in_channels: int
    temporal_patch_size: int
    patch_size: int
    spatial_merge_size: int
    contiguous_embeds: bool = True
    # Qwen3-VL videos: timestamp text separates the frames, so the embed positions form one
    # contiguous run of h*w // merge**2 per temporal grid step (not one run for the whole video).
    runs_per_frame: bool = False
    # Qwen2.5-VL videos: "second_per_grid_ts" (seconds per temporal grid step; M-RoPE spaces the
    # time axis by it). Optional on the wire: absent means 1.0, as in HF's get_rope_index.
    time_key: str | None = None

    @property
    def patch_dim(self) -> int:
        return self.in_channels * self.temporal_patch_size * self.patch_size ** 2

    def check_names(self, item, path):
        names = {self.grid_key} | ({self.time_key} if self.time_key else set())
        for group, allowed in (("kwargs", {self.pixel_key} | names), ("metadata", names)):
            for name in getattr(item, group):
                if name not in allowed:
                    raise InvalidArgument(
                        f"{tensor_path(path, group, name)}: the model takes no such {group} tensor for "
                        f"{self.modality} items (expected: {', '.join(sorted(allowed))})",
                        reason="MM_TENSOR_UNKNOWN", field=tensor_path(path, group, name))

    def layout(self, item, path):
        merge = self.spatial_merge_size
        grids = {group: _grid_from(getattr(item, group)[self.grid_key], tensor_path(path, group, self.grid_key), merge)
                 for group in ("metadata", "kwargs") if self.grid_key in getattr(item, group)}
        if not grids:
            if item.kwargs:
                raise InvalidArgument(f"{path}.kwargs.{self.grid_key} is missing: the encoder needs it with "
                                      f"{self.pixel_key}", reason="MM_TENSOR_MISSING",
                                      field=tensor_path(path, "kwargs", self.grid_key))
            raise FailedPrecondition(
                f"{path} has neither kwargs nor metadata.{self.grid_key}, which this model needs for its "
                f"positions even when the encoder output is cached; re-render the request with "
                f"mm_payload TENSORS (or METADATA)", reason=TENSORS_REQUIRED, field=f"{path}.metadata")
        if len(set(grids.values())) > 1:
            raise InvalidArgument(f"{path}.kwargs.{self.grid_key} {list(grids['kwargs'])} disagrees with "
                                  f"metadata.{self.grid_key} {list(grids['metadata'])}",
                                  reason="MM_METADATA_MISMATCH", field=tensor_path(path, "kwargs", self.grid_key))
        grid = next(iter(grids.values()))
        return ItemLayout(num_rows=math.prod(grid) // merge ** 2, grid_thw=grid,
                          second_per_grid_ts=self._second_per_grid_ts(item, path))

    def _second_per_grid_ts(self, item, path) -> float | None:
        if self.time_key is None:
            return None
        values = {group: _seconds_from(getattr(item, group)[self.time_key], tensor_path(path, group, self.time_key))
                  for group in ("metadata", "kwargs") if self.time_key in getattr(item, group)}
        if len(set(values.values())) > 1:
            raise InvalidArgument(f"{path}.kwargs.{self.time_key} disagrees with metadata.{self.time_key}",
                                  reason="MM_METADATA_MISMATCH", field=tensor_path(path, "kwargs", self.time_key))
        return next(iter(values.values()), 1.0)

    def check_encoder_inputs(self, item, layout, path):
        field_path = tensor_path(path, "kwargs", self.pixel_key)
        if self.pixel_key not in item.kwargs:
            raise InvalidArgument(f"{field_path} is missing: items with kwargs must carry the encoder input",
                                  reason="MM_TENSOR_MISSING", field=field_path)
        pixels = item.kwargs[self.pixel_key]
        expected = [math.prod(layout.grid_thw), self.patch_dim]
        if pixels.dtype not in FLOAT_DTYPES or list(pixels.shape) != expected:
            raise InvalidArgument(
                f"{field_path} must be a floating point tensor of shape {expected} (prod(grid_thw) patches x "
                f"channels*temporal_patch*patch^2), got {Dtype.Name(pixels.dtype)} {list(pixels.shape)}",
                reason="MM_TENSOR_SHAPE_INVALID", field=field_path)


@dataclass(frozen=True)
class FixedRowsImageSpec:
    """Images resized to one square size and encoded to a fixed number of rows (Gemma3, SigLIP)."""

    modality: str
    placeholder_token_id: int
    num_rows: int
    in_channels: int
    image_size: int
    contiguous_embeds: bool = False  # the span interleaves boundary tokens; is_embed says where rows go

    def check_names(self, item, path):
        for group, allowed in (("kwargs", {"pixel_values", "num_crops"}), ("metadata", {"num_crops"})):
            for name in getattr(item, group):
                if name not in allowed:
                    raise InvalidArgument(
                        f"{tensor_path(path, group, name)}: the model takes no such {group} tensor "
                        f"(expected: {', '.join(sorted(allowed))})",
                        reason="MM_TENSOR_UNKNOWN", field=tensor_path(path, group, name))
        for group in ("kwargs", "metadata"):
            crops = getattr(item, group).get("num_crops")
            if crops is not None and (crops.dtype not in INT_DTYPES or any(tensors.to_numpy(crops).ravel())):
                field_path = tensor_path(path, group, "num_crops")
                raise InvalidArgument(f"{field_path}: pan-and-scan crops are not supported; num_crops must be "
                                      f"0", reason="MM_TENSOR_SHAPE_INVALID", field=field_path)

    def layout(self, item, path):
        return ItemLayout(num_rows=self.num_rows)

    def check_encoder_inputs(self, item, layout, path):
        field_path = tensor_path(path, "kwargs", "pixel_values")
        if "pixel_values" not in item.kwargs:
            raise InvalidArgument(f"{field_path} is missing: items with kwargs must carry the encoder input",
                                  reason="MM_TENSOR_MISSING", field=field_path)
        pixels = item.kwargs["pixel_values"]
        image = [self.in_channels, self.image_size, self.image_size]
        if pixels.dtype not in FLOAT_DTYPES or list(pixels.shape) not in (image, [1, *image]):
            raise InvalidArgument(
                f"{field_path} must be a floating point tensor of shape [1, {', '.join(map(str, image))}], got "
                f"{Dtype.Name(pixels.dtype)} {list(pixels.shape)}", reason="MM_TENSOR_SHAPE_INVALID", field=field_path)


def multimodal_spec_from_config(config: Any, model_fingerprint: str) -> ModelMultimodalSpec | None:
    """The spec of a loaded HF model from its config; None for a text-only (or unknown) model."""
    model_type = getattr(config, "model_type", "")
    if model_type in ("qwen2_vl", "qwen2_5_vl", "qwen3_vl"):
        vision = config.vision_config
        common = dict(in_channels=vision.in_channels, temporal_patch_size=vision.temporal_patch_size,
                      patch_size=vision.patch_size, spatial_merge_size=vision.spatial_merge_size)
        return ModelMultimodalSpec(
            model_fingerprint=model_fingerprint,
            modalities={
                "image": Qwen2VLVisionSpec("image", config.image_token_id, "pixel_values", "image_grid_thw", **common),
                "video": Qwen2VLVisionSpec("video", config.video_token_id, "pixel_values_videos", "video_grid_thw",
                                           time_key="second_per_grid_ts" if model_type == "qwen2_5_vl" else None,
                                           contiguous_embeds=model_type != "qwen3_vl",
                                           runs_per_frame=model_type == "qwen3_vl", **common),
            },
            hidden_size=config.text_config.hidden_size, uses_mrope=True)
    if model_type == "gemma3":
        vision = config.vision_config
        return ModelMultimodalSpec(
            model_fingerprint=model_fingerprint,
            modalities={"image": FixedRowsImageSpec("image", config.image_token_id, config.mm_tokens_per_image,
                                                    vision.num_channels, vision.image_size)},
            hidden_size=config.text_config.hidden_size)
    return None
