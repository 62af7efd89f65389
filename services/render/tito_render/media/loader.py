"""Fetch and decode one image with limits, turning every caller mistake into a field-named error.

Sources (a `domain.ImageSource`): raw bytes (`data`), `data:` URLs, local files under the configured media
directory (`file://` URLs or bare paths; nothing outside it, symlinks resolved first; every path
that cannot be served answers alike, so that callers cannot probe which files exist), and
`http(s)://` URLs only when remote media is enabled (total deadline and byte cap while reading).

Limits, each named in its error: encoded bytes (`--max-image-bytes`), decoded pixels
(`--max-image-pixels`, checked from the header before any pixel is decoded: a decompression-bomb
guard that also covers Pillow's own), and only well-known raster formats (Pillow plugins such as
EPS would run external programs).
"""

from __future__ import annotations

import base64
import binascii
import io
import logging
import re
import time
import urllib.error
import urllib.parse
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from tito.errors import InvalidArgument, ResourceExhausted

from tito_render.domain import ImageSource

#: Formats render decodes; anything else is refused before a plugin runs.
ALLOWED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP", "TIFF")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")
_READ_CHUNK = 64 * 1024
#: What any --media-dir path that cannot be served answers (see `_unservable`).
MEDIA_NOT_FOUND_MESSAGE = "no such media file under the media directory (--media-dir)"

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MediaPolicy:
    """Where images may come from and how large they may be."""

    media_dir: Path | None = None
    allow_remote: bool = False
    fetch_timeout: float = 10.0
    max_image_bytes: int = 20 * 1024 * 1024
    max_image_pixels: int = 64_000_000
    max_request_pixels: int = 128_000_000  # all images and video frames of one request, decoded

    @classmethod
    def from_config(cls, config) -> "MediaPolicy":
        return cls(media_dir=Path(config.media_dir).resolve() if config.media_dir else None,
                   allow_remote=config.allow_remote_media, fetch_timeout=config.media_fetch_timeout,
                   max_image_bytes=config.max_image_bytes, max_image_pixels=config.max_image_pixels,
                   max_request_pixels=config.max_request_pixels)


class PixelBudget:
    """The pixels one request may decode across all its images and frames, spent from each image's
    header before its pixels are decoded."""

    def __init__(self, limit: int):
        self.limit = limit
        self.spent = 0

    def spend(self, width: int, height: int, field: str) -> None:
        self.spent += width * height
        if self.spent > self.limit:
            raise ResourceExhausted(
                f"the request's images and frames come to more than {self.limit} decoded pixels "
                f"(--max-request-pixels), reached at this {width}x{height} image", reason="REQUEST_TOO_MANY_PIXELS",
                field=field, metadata={"limit": "max_request_pixels", "max": str(self.limit)})


def load_image(source: ImageSource, field: str, policy: MediaPolicy) -> Image.Image:
    """The decoded RGB image `source` names (`field` is the ImageSource's path in the request)."""
    encoded, encoded_field = read_source(source, field, policy)
    return decode_image(encoded, encoded_field, policy)


def read_source(source: ImageSource, field: str, policy: MediaPolicy) -> tuple[bytes, str]:
    """The encoded image bytes `source` names, and the field they came from (`<field>.data|url`)."""
    data = source.data
    if data is not None:
        if len(data) > policy.max_image_bytes:
            raise _too_large(len(data), f"{field}.data", policy)
        return data, f"{field}.data"
    if source.url is not None:
        return read_url(source.url, f"{field}.url", policy), f"{field}.url"
    raise InvalidArgument("image source is empty: set url or data", reason="EMPTY_IMAGE_SOURCE", field=field)


# ----------------------------------------------------------------------------- bytes


def read_url(url: str, field: str, policy: MediaPolicy) -> bytes:
    if url.startswith("data:"):
        return _read_data_url(url, field, policy)
    scheme_match = _SCHEME.match(url)
    scheme = scheme_match.group(1).lower() if scheme_match else ""
    if scheme in ("http", "https"):
        return _read_remote(url, field, policy)
    if scheme == "file":
        parsed = urllib.parse.urlparse(url)
        if parsed.netloc not in ("", "localhost"):
            raise InvalidArgument(f"file URL names host {parsed.netloc!r}: only local files (file:///path) are read",
                                  reason="UNSUPPORTED_MEDIA_URL", field=field)
        return _read_local(urllib.parse.unquote(parsed.path), field, policy)
    if scheme:
        raise InvalidArgument(f"unsupported image URL scheme {scheme!r}: use data:, file:// (under the media "
                              f"directory) or http(s):// (when remote media is enabled)",
                              reason="UNSUPPORTED_MEDIA_URL", field=field)
    if not url:
        raise InvalidArgument("image url is empty", reason="EMPTY_IMAGE_SOURCE", field=field)
    return _read_local(url, field, policy)


def _too_large(size: int | str, field: str, policy: MediaPolicy) -> InvalidArgument:
    return InvalidArgument(f"image is {size} bytes, over the limit max_image_bytes={policy.max_image_bytes} "
                           f"(--max-image-bytes)", reason="IMAGE_TOO_LARGE", field=field,
                           metadata={"limit": "max_image_bytes", "max": str(policy.max_image_bytes)})


def _read_data_url(url: str, field: str, policy: MediaPolicy) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise InvalidArgument("data URL has no ',' before its payload: use data:image/png;base64,<data>",
                              reason="INVALID_DATA_URL", field=field)
    if not header.endswith(";base64"):
        raise InvalidArgument("data URL must be base64 encoded: use data:image/<type>;base64,<data>",
                              reason="INVALID_DATA_URL", field=field)
    mime = header.removeprefix("data:").removesuffix(";base64").split(";")[0].strip().lower()
    if mime and not mime.startswith("image/"):
        raise InvalidArgument(f"data URL media type {mime!r} is not an image type (image/...)",
                              reason="INVALID_DATA_URL", field=field)
    # Check the size from the base64 length first: a huge payload is refused before decoding.
    if len(payload) // 4 * 3 > policy.max_image_bytes + 3:
        raise _too_large(f"about {len(payload) // 4 * 3}", field, policy)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError) as exc:
        raise InvalidArgument(f"data URL payload is not valid base64 ({exc})", reason="INVALID_DATA_URL",
                              field=field) from exc
    return data


def _read_local(path_text: str, field: str, policy: MediaPolicy) -> bytes:
    if policy.media_dir is None:
        raise InvalidArgument("local image files are disabled on this server (start render with --media-dir "
                              "DIR to allow files under DIR); send the image as data or a data: URL",
                              reason="LOCAL_MEDIA_DISABLED", field=field)
    if "\0" in path_text:  # no file has such a name (the OS refuses it with ValueError)
        raise InvalidArgument("media path contains a NUL byte", reason="INVALID_MEDIA_PATH", field=field)
    candidate = Path(path_text)
    if not candidate.is_absolute():
        candidate = policy.media_dir / candidate
    try:
        resolved = candidate.resolve(strict=True)  # symlinks resolved: no escape through a link
    except (OSError, RuntimeError, ValueError) as exc:
        raise _unservable(path_text, field, f"does not resolve ({exc})") from exc
    if not resolved.is_relative_to(policy.media_dir):
        raise _unservable(path_text, field, f"resolves to {resolved}, outside {policy.media_dir}")
    if not resolved.is_file():
        raise _unservable(path_text, field, f"resolves to {resolved}, not a regular file")
    try:
        with open(resolved, "rb") as handle:
            data = handle.read(policy.max_image_bytes + 1)
    except OSError as exc:
        raise _unservable(path_text, field, f"cannot be read ({exc.strerror})") from exc
    if len(data) > policy.max_image_bytes:
        raise _too_large(f"more than {policy.max_image_bytes}", field, policy)
    return data


def _unservable(path_text: str, field: str, cause: str) -> InvalidArgument:
    """One answer for every path that cannot be served (missing, outside the media directory, a
    symlink out of it, a directory, unreadable): the caller cannot tell which, so it cannot probe
    what exists on the server. The log keeps the cause."""
    log.info("media path %.300r (%s) cannot be served: %s", path_text, field, cause)
    return InvalidArgument(MEDIA_NOT_FOUND_MESSAGE, reason="MEDIA_NOT_FOUND", field=field)


def _read_remote(url: str, field: str, policy: MediaPolicy) -> bytes:
    if not policy.allow_remote:
        raise InvalidArgument("http(s) image URLs are disabled on this server (start render with "
                              "--allow-remote-media to fetch them); send the image as data or a data: URL",
                              reason="REMOTE_MEDIA_DISABLED", field=field)
    deadline = time.monotonic() + policy.fetch_timeout
    request = urllib.request.Request(url, headers={"User-Agent": "tito-render", "Accept": "image/*"})
    try:
        with urllib.request.urlopen(request, timeout=policy.fetch_timeout) as response:
            declared = response.headers.get("Content-Length")
            if declared and declared.isdigit() and int(declared) > policy.max_image_bytes:
                raise _too_large(declared, field, policy)
            chunks, total = [], 0
            while True:
                if time.monotonic() > deadline:
                    raise TimeoutError
                chunk = response.read(_READ_CHUNK)
                if not chunk:
                    break
                total += len(chunk)
                if total > policy.max_image_bytes:
                    raise _too_large(f"more than {policy.max_image_bytes}", field, policy)
                chunks.append(chunk)
            return b"".join(chunks)
    except urllib.error.HTTPError as exc:
        raise InvalidArgument(f"fetching the image failed: HTTP {exc.code}", reason="MEDIA_FETCH_FAILED",
                              field=field) from exc
    except TimeoutError as exc:
        raise InvalidArgument(f"fetching the image took longer than {policy.fetch_timeout:g}s "
                              f"(--media-fetch-timeout)", reason="MEDIA_FETCH_TIMEOUT", field=field) from exc
    except (urllib.error.URLError, OSError, ValueError) as exc:
        reason = getattr(exc, "reason", exc)
        if isinstance(reason, TimeoutError):
            raise InvalidArgument(f"fetching the image took longer than {policy.fetch_timeout:g}s "
                                  f"(--media-fetch-timeout)", reason="MEDIA_FETCH_TIMEOUT", field=field) from exc
        raise InvalidArgument(f"fetching the image failed: {reason}", reason="MEDIA_FETCH_FAILED",
                              field=field) from exc


# ----------------------------------------------------------------------------- pixels


def _too_many_pixels(width: int, height: int, field: str, policy: MediaPolicy) -> InvalidArgument:
    return InvalidArgument(
        f"image is {width}x{height} = {width * height} pixels, over the limit max_image_pixels="
        f"{policy.max_image_pixels} (--max-image-pixels)", reason="IMAGE_TOO_MANY_PIXELS", field=field,
        metadata={"limit": "max_image_pixels", "max": str(policy.max_image_pixels)})


def decode_image(data: bytes, field: str, policy: MediaPolicy, budget: PixelBudget | None = None) -> Image.Image:
    """Decode `data` into an RGB image (alpha dropped, as the Hugging Face processors do: `to_rgb`);
    its pixels are spent from the request's `budget` (when given) before they are decoded."""
    if len(data) > policy.max_image_bytes:
        raise _too_large(len(data), field, policy)
    if not data:
        raise InvalidArgument("image data is empty", reason="CORRUPT_IMAGE", field=field)
    try:
        # Our own pixel limit is checked from the header, before any pixel is decoded. (Pillow's
        # guard also raises DecompressionBombError in open() beyond 2 x Image.MAX_IMAGE_PIXELS.)
        image = Image.open(io.BytesIO(data), formats=ALLOWED_FORMATS)
        width, height = image.size
        if width * height > policy.max_image_pixels:
            raise _too_many_pixels(width, height, field, policy)
        if width < 1 or height < 1:
            raise InvalidArgument("image has no pixels", reason="CORRUPT_IMAGE", field=field)
        if budget is not None:
            budget.spend(width, height, field)
        image.load()
        return to_rgb(image)
    except Image.DecompressionBombError as exc:
        raise InvalidArgument(f"image has too many pixels ({exc}); the limit is max_image_pixels="
                              f"{policy.max_image_pixels} (--max-image-pixels)", reason="IMAGE_TOO_MANY_PIXELS",
                              field=field, metadata={"limit": "max_image_pixels",
                                                     "max": str(policy.max_image_pixels)}) from exc
    except (InvalidArgument, ResourceExhausted):
        raise
    except Image.UnidentifiedImageError as exc:
        raise InvalidArgument(f"not a decodable image (supported formats: {', '.join(ALLOWED_FORMATS)})",
                              reason="CORRUPT_IMAGE", field=field) from exc
    except (OSError, SyntaxError, ValueError, EOFError, IndexError, TypeError, MemoryError) as exc:
        # Truncated or corrupt data; Pillow reports it through a variety of exception types.
        raise InvalidArgument(f"image data is corrupt or truncated: {exc}", reason="CORRUPT_IMAGE",
                              field=field) from exc


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB exactly as transformers' `convert_to_rgb` makes it, so the pixels render hashes are the
    pixels the processor sees.

    transformers 5.19 (the pinned version) converts with a plain `image.convert("RGB")`: alpha and
    palette transparency are dropped, not composited onto white (image_transforms.convert_to_rgb;
    image_utils.load_image does the same). Note that vLLM 0.32's own image loading composites
    transparency onto white before its HF processor runs (vllm/multimodal/parse.py,
    multimodal/image.py `convert_image_mode`), so for images with transparency this matches HF, not
    vLLM's front end. Fully opaque images are identical either way."""
    if image.mode == "RGB":
        return image
    return image.convert("RGB")
