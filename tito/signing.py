"""HMAC binding of media items to their content, shared by render (signs) and engine (verifies).

An engine must never trust a client-supplied hash or cache reference on its own: a forged
`mm_hash` could make it reuse another tenant's encoder output. Render, configured with a key it
shares with the engine, signs each item; the engine, configured with the same key and
`--require-signed-features`, rejects items whose tag does not verify.

The signed bytes are defined here explicitly (not as protobuf serialization, which is not
canonical across implementations): a domain tag, then every field that decides what the engine
computes — modality, mm_hash, placeholder (offset, length, is_embed), each kwargs and metadata
tensor by sorted name (dtype, shape, SHA-256 of the raw bytes), and the EC descriptor. Lengths
prefix every variable-size part, so no two different items share signed bytes.

Because the bytes come from field values, the functions that read an item take the wire message
(render signs it) or any object with the same fields (the engine verifies its domain item, whose
absent placeholder or EC descriptor is None): both give the same bytes.
"""

from __future__ import annotations

import hashlib
import hmac
import struct
from pathlib import Path

from tito.errors import ConfigError
from tito.v1 import multimodal_pb2

_DOMAIN = b"tito.v1.MultiModalItem/hmac-sha256\x00"
_DESCRIPTOR_DOMAIN = b"tito.v1.EncoderCacheDescriptor/hmac-sha256\x00"


def _enum(number: int) -> bytes:
    """An enum field's number: an int32 on the wire, and open (a caller may send one its enum does
    not name, negative included). The bytes of 0..2**31-1 are those an unsigned 32-bit field would
    have, so the tags of every named value are what they always were."""
    return struct.pack("<i", number)


def _blob(value: bytes) -> bytes:
    return struct.pack("<Q", len(value)) + value


def _text(value: str) -> bytes:
    return _blob(value.encode("utf-8"))


def _tensors(tensors) -> bytes:
    out = [struct.pack("<Q", len(tensors))]
    for name in sorted(tensors):
        tensor = tensors[name]
        out.append(_text(name))
        out.append(_enum(tensor.dtype))
        out.append(struct.pack("<Q", len(tensor.shape)) + struct.pack(f"<{len(tensor.shape)}q", *tensor.shape))
        out.append(hashlib.sha256(tensor.data).digest())
    return b"".join(out)


def _descriptor_bytes(ec) -> bytes:
    return b"".join([_text(ec.store_id), _text(ec.uri), _text(ec.key), _enum(ec.dtype),
                     struct.pack("<Q", len(ec.shape)) + struct.pack(f"<{len(ec.shape)}q", *ec.shape),
                     struct.pack("<Q", ec.byte_size), _text(ec.checksum), _text(ec.model_fingerprint)])


def _descriptor_of(item):
    """The item's EC descriptor, or None: the wire message says by presence, a domain item by None."""
    if isinstance(item, multimodal_pb2.MultiModalItem):
        return item.ec_descriptor if item.HasField("ec_descriptor") else None
    return item.ec_descriptor


def signed_bytes(item, *, with_descriptor: bool = True) -> bytes:
    """The canonical bytes an item's tag covers (everything but auth_tag and auth_key_id).

    `with_descriptor=False`: the bytes of the item as if it had no EC descriptor (what render
    signed before an engine's signed descriptor was attached, see `verify_item`)."""
    placeholder = item.placeholder  # None (a domain item without one) signs as the wire's default
    offset, length, is_embed = (placeholder.offset, placeholder.length, placeholder.is_embed) \
        if placeholder is not None else (0, 0, ())
    parts = [
        _DOMAIN,
        _enum(item.modality),
        _text(item.mm_hash),
        struct.pack("<II", offset, length),
        _blob(bytes(bytearray(1 if b else 0 for b in is_embed))),
        _tensors(item.kwargs),
        _tensors(item.metadata),
    ]
    descriptor = _descriptor_of(item) if with_descriptor else None
    if descriptor is not None:
        parts += [b"\x01", _descriptor_bytes(descriptor)]
    else:
        parts.append(b"\x00")
    return b"".join(parts)


def compute_tag(item, key: bytes, *, with_descriptor: bool = True) -> bytes:
    return hmac.new(key, signed_bytes(item, with_descriptor=with_descriptor), hashlib.sha256).digest()


def sign_item(item: multimodal_pb2.MultiModalItem, key: bytes, key_id: str = "") -> None:
    """Set the item's auth_tag (and auth_key_id) in place."""
    item.auth_key_id = key_id
    item.auth_tag = compute_tag(item, key)


def verify_item(item, keys: dict[str, bytes]) -> bool:
    """True when the item's tag was made by one of `keys` (by auth_key_id) over its current content.

    An item whose EC descriptor carries its own tag (signed by the engine that answered Encode,
    `sign_descriptor`) also verifies when its tag covers the item without the descriptor: render
    signs an item before any engine has encoded it, and a router attaches the descriptor later.
    The descriptor's own tag is checked apart (`verify_descriptor`); it binds the descriptor's
    key, which names the item's mm_hash, so it cannot be moved to another item's content."""
    key = keys.get(item.auth_key_id)
    if key is None or len(item.auth_tag) != hashlib.sha256().digest_size:
        return False
    if hmac.compare_digest(item.auth_tag, compute_tag(item, key)):
        return True
    descriptor = _descriptor_of(item)
    return bool(descriptor is not None and descriptor.auth_tag) and \
        hmac.compare_digest(item.auth_tag, compute_tag(item, key, with_descriptor=False))


def descriptor_tag(descriptor, key: bytes) -> bytes:
    return hmac.new(key, _DESCRIPTOR_DOMAIN + _descriptor_bytes(descriptor), hashlib.sha256).digest()


def sign_descriptor(descriptor: multimodal_pb2.EncoderCacheDescriptor, key: bytes, key_id: str = "") -> None:
    """Set the descriptor's auth_tag (and auth_key_id) in place (the engine that answers Encode)."""
    descriptor.auth_key_id = key_id
    descriptor.auth_tag = descriptor_tag(descriptor, key)


def verify_descriptor(descriptor, keys: dict[str, bytes]) -> bool:
    """True when the descriptor's tag was made by one of `keys` (by auth_key_id) over its fields."""
    key = keys.get(descriptor.auth_key_id)
    if key is None or len(descriptor.auth_tag) != hashlib.sha256().digest_size:
        return False
    return hmac.compare_digest(descriptor.auth_tag, descriptor_tag(descriptor, key))


MIN_KEY_BYTES = 16


def read_key_file(path: str) -> bytes:
    """Read a shared HMAC key the way render and engine both must: the file's bytes without
    surrounding whitespace (so `openssl rand -hex 32 > FILE` works), at least MIN_KEY_BYTES long."""
    try:
        key = Path(path).read_bytes().strip()
    except OSError as exc:
        raise ConfigError(f"--hmac-key-file {path!r} cannot be read: {exc.strerror}") from None
    if len(key) < MIN_KEY_BYTES:
        raise ConfigError(f"--hmac-key-file {path!r} holds {len(key)} bytes: use a key of at least {MIN_KEY_BYTES} "
                          f"bytes (e.g. `openssl rand -hex 32 > FILE`), the same file for render and engine")
    return key


_KV_HANDLE_DOMAIN = b"tito.v1.KvTransferHandle/hmac-sha256\x00"


def kv_handle_bytes(handle) -> bytes:
    """The canonical bytes a KV transfer handle's tag covers: every field but auth_tag (the wire
    message or the engine's domain handle, which share field names)."""
    layout = handle.layout
    return b"".join([
        _KV_HANDLE_DOMAIN, _text(handle.transfer_id), _text(handle.request_id), _text(handle.engine_id),
        struct.pack("<IIII", handle.block_count, handle.block_size, handle.num_tokens, 0), _text(handle.dtype),
        struct.pack("<III", layout.num_layers, layout.kv_heads, layout.head_dim),
        struct.pack("<d", handle.expires_at), _blob(handle.prompt_digest), _text(handle.model_fingerprint),
        _text(handle.auth_key_id)])


def kv_handle_tag(handle, key: bytes) -> bytes:
    """HMAC-SHA256 of a KV transfer handle under `key`: a handle no key holder issued cannot
    name another request's pinned KV."""
    return hmac.new(key, kv_handle_bytes(handle), hashlib.sha256).digest()
