"""The two plain parts of a media item that render and the engine describe alike: a tensor as the
wire carries it and a placeholder range. Each service's own `MediaItem` (render's
`tito_render.domain`, the engine's `tito_engine.multimodal.domain`) is built from them; they are
here because a service may not import the other. Frozen, picklable, torch- and grpc-free.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RawTensor:
    """A `tito.v1.Tensor`'s fields: dtype code, shape, little-endian bytes (`tito.tensors` checks
    and decodes them like the wire message's).

    `data` is one bytes object made once: render builds it when the item is made (the HMAC tag
    hashes it and the response carries the same object); the engine takes it from the message
    once (reading a protobuf bytes field copies it each time)."""

    dtype: int  # tito.v1.Dtype number
    shape: tuple[int, ...]
    data: bytes


@dataclass(frozen=True, slots=True)
class Placeholder:
    """Where an item's tokens are in the prompt's token_ids; `is_embed` empty: every position takes
    a row."""

    offset: int
    length: int
    is_embed: tuple[bool, ...] = ()
