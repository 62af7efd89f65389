"""The media items of a request as the engine's domain code sees them: plain frozen dataclasses,
made from the wire `tito.v1.MultiModalFeatures` at the servicer (service/convert.py) and never
turned back, except the EC descriptors Encode answers with.

They keep the wire's values as they came, unchecked: admission (features.py) refuses what is
wrong, naming the wire field, so a value the proto allows but the engine does not (an unknown
modality number, a tensor whose bytes do not match its shape) must survive the conversion.
Torch-free and grpc-free; picklable (a checked item crosses the pipe to the engine core).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from tito.media_parts import Placeholder, RawTensor


@dataclass(frozen=True, slots=True)
class EncoderCacheDescriptor:
    """Where an item's encoder output lives (an engine's encoder cache or the shared store)."""

    store_id: str
    uri: str
    key: str
    dtype: int  # tito.v1.Dtype number
    shape: tuple[int, ...]
    byte_size: int
    checksum: str
    model_fingerprint: str
    auth_tag: bytes = b""  # the encoding engine's HMAC over the fields above (tito.signing)
    auth_key_id: str = ""


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One `tito.v1.MultiModalItem`.

    `modality` stays the wire's enum number, not a name: a number the engine does not know is
    refused by admission with the number in the message, and the HMAC tag and the engine's content
    digest cover the number. The tag is verified over these fields (tito.signing computes its
    canonical bytes from field values, never from a serialization), so nothing of the wire
    message needs to be kept for it."""

    modality: int
    mm_hash: str
    # None: the wire item has none (Generate's admission refuses that; Encode needs none).
    placeholder: Placeholder | None
    kwargs: Mapping[str, RawTensor] = field(default_factory=dict)
    metadata: Mapping[str, RawTensor] = field(default_factory=dict)
    ec_descriptor: EncoderCacheDescriptor | None = None
    auth_tag: bytes = b""
    auth_key_id: str = ""
