"""Qwen2-VL / Qwen3-VL video (a list of frames) -> `pixel_values_videos` + `video_grid_thw`, without torchvision.

transformers' `Qwen2VLVideoProcessor` imports torchvision, which does not install here, so render
does its math itself, with the same settings the video processor would load:

- settings: `processor_config.json["video_processor"]`, else `video_preprocessor_config.json`, else
  `preprocessor_config.json` (transformers' own lookup order), over `Qwen2VLVideoProcessor`'s class
  defaults (size 128*28*28 .. 768*28*28 pixels per frame, bicubic, CLIP mean/std, patch 14,
  temporal patch 2, merge 2); `min_pixels` / `max_pixels` keys override `size` as in its __init__.
  A model without a video config therefore uses its image settings (the image file is the
  fallback), one with neither `size` nor min/max_pixels the video defaults.
- all frames must share one size (the processor stacks them into one tensor); one smart_resize'd
  size for the video (with `cap_pixels_per_frame`, the per-frame cap is the even share of
  `max_video_tokens`, floored at 1.05 * min_pixels, as the processor computes it);
- resize each frame with PIL (what the PIL image-processor backend does for images: `np_resize`
  -> `PIL.Image.resize(reducing_gap=None)`); the torchvision path resizes uint8 tensors with
  antialiased bicubic instead, which can differ by a few levels at some pixels (see README);
- rescale (float64 multiply, then float32) and normalize ((x - mean) / std in float32): exactly
  `transformers.image_transforms.rescale` / `normalize`, elementwise;
- pad the frame count to a multiple of temporal_patch_size by repeating the last frame, then the
  video processor's patch layout: rows (t, h/m, w/m, m_h, m_w), columns (C, T, P, P).

Qwen3-VL (`Qwen3VLVideoProcessor`, `VideoSettings.qwen3`): the same pipeline with its own class
defaults (16-pixel patches, size 128*32*32 .. 768*32*32, mean = std = 0.5) and its own size
choice (`budget_over_frames`): the pixel budget covers the whole video (t_bar * h * w, t_bar the
frame count rounded to the temporal patch), a frame smaller than one merged patch is first scaled
up, fewer frames than temporal_patch_size are refused (as its smart_resize raises), and
`cap_pixels_per_frame` caps each frame at min(max_video_tokens * factor**2, longest_edge /
frames), floored at 1.05 * shortest_edge. Frames arrive already sampled: render never samples
(the processor's do_sample_frames does not apply).

Domain code: no grpc.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image

#: transformers' OPENAI_CLIP_MEAN / OPENAI_CLIP_STD (Qwen2VLVideoProcessor's defaults).
_CLIP_MEAN = (0.48145466, 0.4578275, 0.40821073)
_CLIP_STD = (0.26862954, 0.26130258, 0.27577711)
#: transformers' IMAGENET_STANDARD_MEAN / _STD (Qwen3VLVideoProcessor's defaults).
_STANDARD_MEAN = (0.5, 0.5, 0.5)
_STANDARD_STD = (0.5, 0.5, 0.5)


@dataclass(frozen=True)
class VideoSettings:
    """The Qwen2-VL video processor settings that shape the tensors (defaults = the class's)."""

    min_pixels: int = 128 * 28 * 28
    max_pixels: int = 28 * 28 * 768
    patch_size: int = 14
    temporal_patch_size: int = 2
    merge_size: int = 2
    resample: int = 3  # PIL BICUBIC
    do_resize: bool = True
    do_rescale: bool = True
    rescale_factor: float = 1 / 255
    do_normalize: bool = True
    image_mean: tuple[float, ...] = _CLIP_MEAN
    image_std: tuple[float, ...] = _CLIP_STD
    cap_pixels_per_frame: bool = False  # the processor's None (today's default) behaves as False
    max_video_tokens: int = 128000
    #: Qwen3-VL's size choice: the pixel budget covers all frames (see the module docstring).
    budget_over_frames: bool = False

    @classmethod
    def qwen3(cls) -> "VideoSettings":
        """Qwen3VLVideoProcessor's class defaults."""
        return cls(min_pixels=128 * 32 * 32, max_pixels=32 * 32 * 768, patch_size=16, image_mean=_STANDARD_MEAN,
                   image_std=_STANDARD_STD, max_video_tokens=768, budget_over_frames=True)

    @property
    def factor(self) -> int:
        return self.patch_size * self.merge_size

    def with_overrides(self, min_pixels: int | None, max_pixels: int | None, resample: int | None) -> "VideoSettings":
        changes: dict[str, Any] = {}
        if min_pixels is not None:
            changes["min_pixels"] = min_pixels
        if max_pixels is not None:
            changes["max_pixels"] = max_pixels
        if resample is not None:
            changes["resample"] = resample
        return VideoSettings(**{**self.as_dict(), **changes}) if changes else self

    def as_dict(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    def hash_options(self) -> dict[str, Any]:
        """Plain-JSON form (tuples -> lists) for the content hash and the cache key."""
        return json.loads(json.dumps(self.as_dict()))


def _read_json(path: Path) -> dict[str, Any]:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def video_processor_dict(model_dir: Path) -> dict[str, Any]:
    """The dict transformers' video processor loading would use (its lookup order)."""
    nested = _read_json(model_dir / "processor_config.json").get("video_processor")
    if isinstance(nested, dict):
        return nested
    for name in ("video_preprocessor_config.json", "preprocessor_config.json"):
        data = _read_json(model_dir / name)
        if data:
            return data
    return {}


def load_video_settings(model_dir: Path, qwen3: bool = False) -> VideoSettings:
    """Qwen2VLVideoProcessor.__init__'s (`qwen3`: Qwen3VLVideoProcessor's) resolution of its
    config over its class defaults."""
    config = video_processor_dict(model_dir)
    defaults = VideoSettings.qwen3() if qwen3 else VideoSettings()
    size = config.get("size") if isinstance(config.get("size"), dict) else {}
    min_pixels = size.get("shortest_edge", defaults.min_pixels)
    max_pixels = size.get("longest_edge", defaults.max_pixels)
    if config.get("min_pixels") is not None:
        min_pixels = config["min_pixels"]
    if config.get("max_pixels") is not None:
        max_pixels = config["max_pixels"]

    def pick(name: str, cast):
        value = config.get(name)
        return cast(value) if value is not None else getattr(defaults, name)

    return VideoSettings(
        min_pixels=int(min_pixels), max_pixels=int(max_pixels),
        patch_size=pick("patch_size", int), temporal_patch_size=pick("temporal_patch_size", int),
        merge_size=pick("merge_size", int), resample=pick("resample", int),
        do_resize=pick("do_resize", bool), do_rescale=pick("do_rescale", bool),
        rescale_factor=pick("rescale_factor", float), do_normalize=pick("do_normalize", bool),
        image_mean=pick("image_mean", lambda v: tuple(float(x) for x in v)),
        image_std=pick("image_std", lambda v: tuple(float(x) for x in v)),
        cap_pixels_per_frame=pick("cap_pixels_per_frame", bool),
        max_video_tokens=pick("max_video_tokens", int), budget_over_frames=defaults.budget_over_frames)


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen2-VL `smart_resize` (ValueError beyond aspect ratio 200)."""
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def smart_resize_frames(num_frames: int, height: int, width: int, temporal_factor: int, factor: int,
                        min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """transformers' Qwen3-VL video `smart_resize`: the budget covers t_bar * h * w."""
    if num_frames < temporal_factor:
        raise ValueError(f"t:{num_frames} must be larger than temporal_factor:{temporal_factor}")
    if height < factor or width < factor:
        scale = max(factor / height, factor / width)
        height, width = int(height * scale), int(width * scale)
    if max(height, width) / min(height, width) > 200:
        ratio = max(height, width) / min(height, width)
        raise ValueError(f"absolute aspect ratio must be smaller than 200, got {ratio}")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    t_bar = round(num_frames / temporal_factor) * temporal_factor
    if t_bar * h_bar * w_bar > max_pixels:
        beta = math.sqrt((num_frames * height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif t_bar * h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (num_frames * height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def _qwen3_resized_size(height: int, width: int, num_frames: int, settings: VideoSettings) -> tuple[int, int]:
    """Qwen3VLVideoProcessor.resize's size choice."""
    max_pixels = settings.max_pixels
    if settings.cap_pixels_per_frame:
        frame_cap = settings.max_video_tokens * settings.factor * settings.factor
        per_frame = max(min(frame_cap, settings.max_pixels // num_frames), int(settings.min_pixels * 1.05))
        max_pixels = per_frame * num_frames
    return smart_resize_frames(num_frames, height, width, settings.temporal_patch_size, settings.factor,
                               settings.min_pixels, max_pixels)


def resized_size(height: int, width: int, num_frames: int, settings: VideoSettings) -> tuple[int, int]:
    """The size every frame is resized to (Qwen2VLVideoProcessor.resize, Qwen3VLVideoProcessor.resize)."""
    if not settings.do_resize:
        return height, width
    if settings.budget_over_frames:
        return _qwen3_resized_size(height, width, num_frames, settings)
    max_pixels = settings.max_pixels
    if settings.cap_pixels_per_frame:
        total_pixels = int(settings.max_video_tokens * settings.factor * settings.factor * 0.9)
        max_pixels = max(min(max_pixels, total_pixels * settings.temporal_patch_size // num_frames),
                         int(settings.min_pixels * 1.05))
    return smart_resize(height, width, settings.factor, settings.min_pixels, max_pixels)


def video_grid_thw(num_frames: int, height: int, width: int, settings: VideoSettings) -> np.ndarray:
    """`video_grid_thw` [1, 3] int64 without touching the pixels."""
    resized_h, resized_w = resized_size(height, width, num_frames, settings)
    grid_t = -(-num_frames // settings.temporal_patch_size)  # padded up to a multiple
    return np.array([[grid_t, resized_h // settings.patch_size, resized_w // settings.patch_size]], dtype=np.int64)


def frame_timestamps(num_frames: int, fps: float, temporal_patch_size: int) -> list[float]:
    """Qwen3VLProcessor._calculate_timestamps for frames 0..num_frames-1 sampled at `fps`: the
    indices padded to a multiple of the temporal patch by repeating the last, each temporal
    patch's time the mean of its first and last frame's, in seconds."""
    indices = list(range(num_frames))
    if len(indices) % temporal_patch_size:
        indices.extend(indices[-1] for _ in range(temporal_patch_size - len(indices) % temporal_patch_size))
    seconds = [index / fps for index in indices]
    return [(seconds[i] + seconds[i + temporal_patch_size - 1]) / 2
            for i in range(0, len(seconds), temporal_patch_size)]


def resize_frame(frame: Image.Image, num_frames: int, settings: VideoSettings) -> Image.Image:
    """One frame at the video's size (PIL, as the image processor's PIL backend resizes). Render
    resizes each frame right after decoding it, so a video never holds all its full-size frames."""
    if not settings.do_resize:
        return frame
    height, width = resized_size(frame.height, frame.width, num_frames, settings)
    return frame.resize((width, height), resample=settings.resample, reducing_gap=None)


def normalized_frames(resized_frames: Sequence[Image.Image], settings: VideoSettings) -> np.ndarray:
    """[T, C, H', W'] float32: resized frames rescaled and normalized (the PIL backend's math)."""
    video = np.stack([np.asarray(frame) for frame in resized_frames])  # [T, H, W, C] uint8
    if settings.do_rescale:
        video = (video.astype(np.float64) * settings.rescale_factor).astype(np.float32)
    if settings.do_normalize:
        if not np.issubdtype(video.dtype, np.floating):
            video = video.astype(np.float32)
        mean = np.array(settings.image_mean, dtype=video.dtype)
        std = np.array(settings.image_std, dtype=video.dtype)
        video = (video - mean) / std
    return np.ascontiguousarray(np.transpose(video, (0, 3, 1, 2)), dtype=np.float32)


def patchify(video: np.ndarray, settings: VideoSettings) -> tuple[np.ndarray, np.ndarray]:
    """Qwen2VLVideoProcessor.patchify for one video [T, C, H, W] -> (rows, grid_thw [1, 3])."""
    temporal, patch, merge = settings.temporal_patch_size, settings.patch_size, settings.merge_size
    num_frames, channels, height, width = video.shape
    if pad := -num_frames % temporal:
        video = np.concatenate([video, np.repeat(video[-1:], pad, axis=0)])
        num_frames += pad
    grid_t, grid_h, grid_w = num_frames // temporal, height // patch, width // patch
    patches = video.reshape(grid_t, temporal, channels, grid_h // merge, merge, patch, grid_w // merge, merge, patch)
    # (t, h/m, w/m, m_h, m_w, C, T, P, P)
    patches = patches.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)
    rows = patches.reshape(grid_t * grid_h * grid_w, channels * temporal * patch * patch)
    return np.ascontiguousarray(rows), np.array([[grid_t, grid_h, grid_w]], dtype=np.int64)


def process_resized_video(resized_frames: Sequence[Image.Image], settings: VideoSettings) -> dict[str, np.ndarray]:
    """`pixel_values_videos` [grid_t*grid_h*grid_w, C*T*P*P] float32 and `video_grid_thw` [1, 3]
    from frames already at the video's size (`resize_frame`)."""
    rows, grid = patchify(normalized_frames(resized_frames, settings), settings)
    return {"pixel_values_videos": rows, "video_grid_thw": grid}


def process_video(frames: Sequence[Image.Image], settings: VideoSettings) -> dict[str, np.ndarray]:
    """The whole computation from full-size frames (all one size)."""
    return process_resized_video([resize_frame(frame, len(frames), settings) for frame in frames], settings)
