"""Images for the media tests, made from a seed so every run sends the same bytes.

Noise is the default picture: every pixel differs, so two seeds never share a media hash, a
resize changes every value a processor produces, and PNG cannot shrink it (its size is known).
"""

from __future__ import annotations

import base64
import io

import numpy as np
from PIL import Image


def noise_image(width: int, height: int, seed: int = 0, mode: str = "RGB") -> Image.Image:
    """`width` x `height` pixels of uniform noise in `mode` ("RGB", "RGBA", "L", ...)."""
    shape = (height, width, len(mode)) if len(mode) > 1 else (height, width)
    return Image.fromarray(np.random.RandomState(seed).randint(0, 256, size=shape, dtype=np.uint8), mode)


def encoded(image: Image.Image, fmt: str = "PNG", **save) -> bytes:
    """`image` as a file of format `fmt`; `save` goes to PIL (quality=80, lossless=True, ...)."""
    buffer = io.BytesIO()
    image.save(buffer, fmt, **save)
    return buffer.getvalue()


def png(image: Image.Image) -> bytes:
    return encoded(image, "PNG")


def jpeg(image: Image.Image) -> bytes:
    return encoded(image, "JPEG")


def noise_png(width: int, height: int, seed: int = 0) -> bytes:
    return png(noise_image(width, height, seed))


def solid_png(width: int, height: int, rgb: tuple[int, int, int]) -> bytes:
    return png(Image.new("RGB", (width, height), rgb))


def png_data_url(image: Image.Image) -> str:
    """`image` as an OpenAI `image_url` data URL."""
    return "data:image/png;base64," + base64.b64encode(png(image)).decode()


def noise_data_url(width: int, height: int, seed: int = 0) -> str:
    return png_data_url(noise_image(width, height, seed))
