"""Processed media -> `MultiModalItem`s, per mm_payload mode, optionally signed.

TENSORS: kwargs + metadata. METADATA: metadata only (engines that hold the item's encoder output
in cache or get an EC descriptor; the mode vLLM lacks). NONE: hash + placeholder only (routing).
Tensors go as raw bytes (tito.tensors), never pickled. The HMAC tag is computed last, over the
item exactly as sent (hash, placeholder, tensors, metadata).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from tito import signing
from tito.tensors import from_numpy
from tito.v1 import multimodal_pb2, tensor_pb2

from tito_render.media.processors import ProcessedImage

TENSORS = multimodal_pb2.MM_PAYLOAD_TENSORS
METADATA = multimodal_pb2.MM_PAYLOAD_METADATA
NONE = multimodal_pb2.MM_PAYLOAD_NONE


def resolve_payload(mode: int) -> int:
    """UNSPECIFIED -> TENSORS; unknown values are refused by the caller (see renderer)."""
    return TENSORS if mode == multimodal_pb2.MM_PAYLOAD_UNSPECIFIED else mode


@dataclass(frozen=True)
class Signer:
    """The HMAC key shared with the engine (tito.signing)."""

    key: bytes
    key_id: str = ""

    def sign(self, item: multimodal_pb2.MultiModalItem) -> None:
        signing.sign_item(item, self.key, self.key_id)


def build_item(processed: ProcessedImage, mm_hash: str, offset: int, payload: int,
               signer: Signer | None = None, modality: int | None = None,
               into: multimodal_pb2.MultiModalItem | None = None) -> multimodal_pb2.MultiModalItem:
    """The item for one processed image; filled into `into` (an empty item already inside the
    response, so its tensors are not copied again) when given."""
    modality = processed.modality if modality is None else modality
    item = multimodal_pb2.MultiModalItem() if into is None else into
    item.modality = modality
    item.mm_hash = mm_hash
    item.placeholder.offset = offset
    item.placeholder.length = len(processed.span_token_ids)
    if processed.is_embed is not None and not all(processed.is_embed):
        item.placeholder.is_embed.extend(processed.is_embed)
    if payload == TENSORS:
        for name, array in processed.kwargs.items():
            _fill_tensor(item.kwargs[name], array)
    if payload in (TENSORS, METADATA):
        for name, array in processed.metadata.items():
            _fill_tensor(item.metadata[name], array)
    if signer is not None:
        signer.sign(item)
    return item


def _fill_tensor(tensor: tensor_pb2.Tensor, array: np.ndarray) -> None:
    """`tensor.CopyFrom(tito.tensors.from_numpy(array))` without the CopyFrom: the raw bytes are
    copied into the response once rather than twice. The codec still decides the dtype code (and
    refuses unsupported dtypes), from an empty array of the same dtype."""
    array = np.asarray(array)
    tensor.dtype = from_numpy(np.empty(0, dtype=array.dtype)).dtype
    tensor.shape.extend(array.shape)
    little = array.dtype if array.dtype.itemsize == 1 else array.dtype.newbyteorder("<")
    tensor.data = np.asarray(array, dtype=little, order="C").tobytes()
