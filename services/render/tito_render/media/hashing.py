"""Content hashes of media items (`mm_hash`), computed by render and never taken from a client.

The hash covers what decides the item's tensors and nothing else: the decoded RGB pixels (so
the same picture sent as PNG or as lossless WebP, as bytes or as a data: URL, hashes alike), the
image size, the model family, and the processor settings that shape the tensors, as canonical
JSON (sorted keys, the *effective* values: a request that spells out the default max_pixels hashes
like one that leaves it unset; a different max_pixels hashes differently).
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
from PIL import Image

_DOMAIN = b"tito.mm_hash.image.v1\x00"
_VIDEO_DOMAIN = b"tito.mm_hash.video.v1\x00"


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()


def image_hash(image: Image.Image, family: str, options: dict[str, Any], pixels: Any = None) -> str:
    """Hex SHA-256 of an RGB image plus the settings that shape its tensors. `pixels`: the image's
    RGB bytes when the caller already holds them (`rgb_pixels(image)`), which saves packing them
    again; any C-contiguous buffer of exactly `image.tobytes()`."""
    if image.mode != "RGB":
        raise ValueError(f"image_hash expects an RGB image, got mode {image.mode}")
    header = canonical_json({"family": family, "mode": image.mode, "size": list(image.size), "options": options})
    digest = hashlib.sha256(_DOMAIN)
    digest.update(struct.pack("<Q", len(header)))
    digest.update(header)
    digest.update(image.tobytes() if pixels is None else pixels)
    return digest.hexdigest()


def rgb_pixels(image: Image.Image) -> np.ndarray:
    """The pixels of an RGB image as a read-only (height, width, 3) uint8 array, packed once: its
    buffer is `image.tobytes()` (what the hash covers) and it is what `np.array(image)` gives the
    image processor, so render packs a decoded image a single time for both."""
    if image.mode != "RGB":
        raise ValueError(f"rgb_pixels expects an RGB image, got mode {image.mode}")
    pixels = np.asarray(image)
    if pixels.shape != (image.height, image.width, 3) or pixels.dtype != np.uint8 or not pixels.flags.c_contiguous:
        raise ValueError(f"unexpected pixel layout {pixels.shape} {pixels.dtype}")  # a Pillow change: a bug
    return pixels


class VideoHasher:
    """SHA-256 of a video given as RGB frames (all one size), in order, plus its frame count, fps
    and the settings that shape its tensors; fed one frame at a time (render does not keep the
    full-size frames). Another frame order hashes differently."""

    def __init__(self, num_frames: int, size: tuple[int, int], fps: float, family: str,
                 options: dict[str, Any]) -> None:
        self.size = tuple(size)
        self._left = num_frames
        header = canonical_json({"family": family, "mode": "RGB", "frames": num_frames, "size": list(size),
                                 "fps": float(fps), "options": options})
        self._digest = hashlib.sha256(_VIDEO_DOMAIN)
        self._digest.update(struct.pack("<Q", len(header)))
        self._digest.update(header)

    def update(self, frame: Image.Image) -> None:
        if frame.mode != "RGB" or frame.size != self.size or self._left <= 0:
            raise ValueError(f"unexpected frame ({frame.mode} {frame.size}, {self._left} frames left)")
        data = frame.tobytes()
        self._digest.update(struct.pack("<Q", len(data)))
        self._digest.update(data)
        self._left -= 1

    def hexdigest(self) -> str:
        if self._left:
            raise ValueError(f"{self._left} frames were not hashed")
        return self._digest.hexdigest()


def video_hash(frames: Sequence[Image.Image], fps: float, family: str, options: dict[str, Any]) -> str:
    """VideoHasher over all `frames` at once."""
    if not frames:
        raise ValueError("video_hash needs at least one frame")
    hasher = VideoHasher(len(frames), frames[0].size, fps, family, options)
    for frame in frames:
        hasher.update(frame)
    return hasher.hexdigest()
