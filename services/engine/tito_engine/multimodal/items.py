"""What admission makes of `mm_features`: the policy it checks against and its two results.

`CheckedItem`/`CheckedFeatures` are phase 1's (every rule but the encoder cache, picklable: they
cross the pipe to the engine core); `ValidatedItem`/`ValidatedFeatures` are phase 2's (what the
runner uses without further checks). The reasons admission's refusals carry are named here once.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from tito.v1 import multimodal_pb2

from tito_engine.multimodal.domain import MediaItem
from tito_engine.multimodal.encoder_cache import CacheKey
from tito_engine.multimodal.specs import ItemLayout

# The wire's enum numbers: a domain item keeps its modality as the number (see domain.MediaItem).
MODALITY_UNSPECIFIED = multimodal_pb2.MODALITY_UNSPECIFIED
MODALITY_NAMES: dict[int, str] = {
    multimodal_pb2.MODALITY_IMAGE: "image",
    multimodal_pb2.MODALITY_VIDEO: "video",
    multimodal_pb2.MODALITY_AUDIO: "audio",
}

SIGNATURE_INVALID = "MM_SIGNATURE_INVALID"
EC_DESCRIPTOR_INVALID = "EC_DESCRIPTOR_INVALID"
EC_DESCRIPTOR_STALE = "EC_DESCRIPTOR_STALE"
EC_ENTRY_EVICTED = "EC_ENTRY_EVICTED"
EC_MODEL_MISMATCH = "EC_MODEL_MISMATCH"
EC_ENTRY_CORRUPT = "EC_ENTRY_CORRUPT"
EC_STORE_UNAVAILABLE = "EC_STORE_UNAVAILABLE"


@dataclass(frozen=True)
class FeaturePolicy:
    """The engine's configured limits and signing keys for media items."""

    max_item_bytes: int = 64 << 20
    max_request_bytes: int = 256 << 20
    max_items: int = 64
    signing_keys: Mapping[str, bytes] = field(default_factory=dict)  # auth_key_id -> key ("" = default)
    require_signed_features: bool = False

    def __post_init__(self) -> None:
        if self.require_signed_features and not self.signing_keys:
            raise ValueError("require_signed_features needs at least one signing key to verify tags with")

    @property
    def signing_enabled(self) -> bool:
        return bool(self.signing_keys)


@dataclass(frozen=True)
class ValidatedItem:
    """One admitted media item, ready for the runner."""

    index: int  # position in mm_features.items
    modality: str
    mm_hash: str
    offset: int
    length: int
    embed_positions: tuple[int, ...]  # absolute token indices that take encoder rows, ascending
    num_rows: int  # == len(embed_positions)
    grid_thw: tuple[int, int, int] | None  # M-RoPE grid (Qwen2-VL, Qwen2.5-VL), None otherwise
    # What identifies the item's content for every cache (encoder cache, prefix cache): mm_hash
    # when trusted, else the engine's own digest of its tensors. Key prefix-cache blocks that cover
    # the item by this, never by a client's unverified mm_hash (the token ids of two images are equal).
    content_id: str
    # Where its encoder output is cached or belongs: after encoding, the runner `put`s the rows here.
    # None: the engine keeps no cache (do not cache).
    cache_key: CacheKey | None
    signed: bool  # its auth_tag verified
    # Decoded encoder inputs (e.g. pixel_values, image_grid_thw); empty when `encoder_rows` is set.
    encoder_inputs: Mapping[str, torch.Tensor] = field(default_factory=dict)
    # Encoder output pinned from the cache (hit or EC descriptor); None: the runner must encode.
    encoder_rows: torch.Tensor | None = None
    # Qwen2.5-VL videos: seconds per temporal grid step (spaces M-RoPE's time axis); None elsewhere.
    second_per_grid_ts: float | None = None
    # The encoder output was loaded from the shared encoder store (a descriptor, or a key hit there).
    from_store: bool = False

    @property
    def needs_encoder(self) -> bool:
        return self.encoder_rows is None

    @property
    def is_embed(self) -> tuple[bool, ...]:
        positions = set(self.embed_positions)
        return tuple(self.offset + k in positions for k in range(self.length))


@dataclass(frozen=True)
class ValidatedFeatures:
    items: tuple[ValidatedItem, ...] = ()
    total_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.items)

    @property
    def to_encode(self) -> tuple[ValidatedItem, ...]:
        return tuple(item for item in self.items if item.needs_encoder)


@dataclass(frozen=True)
class CheckedItem:
    """Phase-1 result for one item: every rule but cache resolution (picklable: it crosses the
    pipe from the server process to the engine core, where the encoder cache lives)."""

    item: MediaItem
    path: str
    modality: str
    layout: ItemLayout
    embed_positions: tuple[int, ...]
    signed: bool
    trusted_hash: bool


@dataclass(frozen=True)
class CheckedFeatures:
    """Phase-1 result for a request: the items that passed every cache-independent rule."""

    items: tuple[CheckedItem, ...] = ()
    total_bytes: int = 0

    def __bool__(self) -> bool:
        return bool(self.items)
