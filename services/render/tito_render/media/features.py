"""Processed media -> media items (`domain.MediaItem`), per mm_payload mode, optionally signed.

TENSORS: kwargs + metadata. METADATA: metadata only (engines that hold the item's encoder output
in cache or get an EC descriptor; the mode vLLM lacks). NONE: hash + placeholder only (routing).
Tensors go as raw bytes (tito.tensors), never pickled. The HMAC tag is computed last, over the
item exactly as sent (hash, placeholder, tensors, metadata).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import numpy as np

from tito import signing
from tito.tensors import dtype_number

from tito_render.domain import MediaItem, MmPayload, Placeholder, RawTensor
from tito_render.media.processors import ProcessedImage

TENSORS = MmPayload.TENSORS
METADATA = MmPayload.METADATA
NONE = MmPayload.NONE


def resolve_payload(mode: int) -> int:
    """UNSPECIFIED -> TENSORS; unknown values are refused by the caller (see renderer)."""
    return TENSORS if mode == MmPayload.UNSPECIFIED else mode


@dataclass(frozen=True)
class Signer:
    """The HMAC key shared with the engine (tito.signing)."""

    key: bytes
    key_id: str = ""

    def sign(self, item: MediaItem) -> MediaItem:
        """The item with its auth_tag (and auth_key_id) set."""
        return dataclasses.replace(item, auth_key_id=self.key_id, auth_tag=signing.compute_tag(item, self.key))


def build_item(processed: ProcessedImage, mm_hash: str, offset: int, payload: int,
               signer: Signer | None = None, modality: int | None = None) -> MediaItem:
    """The item for one processed image."""
    is_embed = processed.is_embed if processed.is_embed is not None and not all(processed.is_embed) else ()
    item = MediaItem(
        modality=processed.modality if modality is None else modality, mm_hash=mm_hash,
        placeholder=Placeholder(offset, len(processed.span_token_ids), tuple(is_embed)),
        kwargs={name: raw_tensor(array) for name, array in processed.kwargs.items()} if payload == TENSORS else {},
        metadata={name: raw_tensor(array) for name, array in processed.metadata.items()}
        if payload in (TENSORS, METADATA) else {})
    return signer.sign(item) if signer is not None else item


def raw_tensor(array: np.ndarray) -> RawTensor:
    """`tito.tensors.from_numpy(array)` without the message: its bytes are made once here and put
    into the response as they are (a message's bytes field is copied on every read). The codec
    still decides the dtype code (and refuses unsupported dtypes)."""
    array = np.asarray(array)
    code = dtype_number(array.dtype)
    little = array.dtype if array.dtype.itemsize == 1 else array.dtype.newbyteorder("<")
    return RawTensor(code, tuple(array.shape), np.asarray(array, dtype=little, order="C").tobytes())
