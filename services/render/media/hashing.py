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
from typing import Any

from PIL import Image

_DOMAIN = b"tito.mm_hash.image.v1\x00"


def canonical_json(value: Any) -> bytes:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str).encode()


def image_hash(image: Image.Image, family: str, options: dict[str, Any]) -> str:
    """Hex SHA-256 of an RGB image plus the settings that shape its tensors."""
    if image.mode != "RGB":
        raise ValueError(f"image_hash expects an RGB image, got mode {image.mode}")
    header = canonical_json({"family": family, "mode": image.mode, "size": list(image.size), "options": options})
    digest = hashlib.sha256(_DOMAIN)
    digest.update(struct.pack("<Q", len(header)))
    digest.update(header)
    digest.update(image.tobytes())
    return digest.hexdigest()
