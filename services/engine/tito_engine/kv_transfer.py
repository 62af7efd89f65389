"""Prefill/decode disaggregation, the engine's domain side (no grpc, no torch).

A prefill request (role `KvPrefill`) runs to its first token; the scheduler then pins its prompt
blocks under a random transfer id (scheduling/kv_pins.py) instead of freeing them, and the
request's last output carries a `KvPinned`. The service turns that into a `KvHandle`: which
engine, how many blocks of which layout, until when, for which prompt (a digest), signed with the
engine's HMAC key when it holds one. A decode engine sends the handle back to this engine's
PullKvBlocks, which checks it here (`HandleIssuer.check_pull`) before the core hands the blocks
out once (single-use) and frees them.

On the decode side (`HandleIssuer.check_decode`), the handle must name the same model and prompt;
the pulled blocks arrive as `ImportedKv` with the AddRequest, and the scheduler writes them into
the request's blocks after its own prefix-cache hits, so only the prompt's last token is computed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import math
import secrets
import struct
import time
from array import array
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from tito import signing
from tito.errors import FailedPrecondition, InvalidArgument, PermissionDenied

HANDLE_UNKNOWN = "KV_TRANSFER_HANDLE_UNKNOWN"
HANDLE_FORGED = "KV_TRANSFER_HANDLE_FORGED"
TRANSFER_MISMATCH = "KV_TRANSFER_MISMATCH"
TRANSFER_FAILED = "KV_TRANSFER_FAILED"
TRANSFER_UNSUPPORTED = "KV_TRANSFER_UNSUPPORTED"

DEFAULT_PIN_SECONDS = 30.0


@dataclass(frozen=True)
class KvLayout:
    """One transferred block: K then V, each [num_layers, block_size, kv_heads, head_dim]."""

    num_layers: int
    kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class KvHandle:
    """A prompt's KV pinned on one engine (the wire's KvTransferHandle, field for field)."""

    transfer_id: str
    request_id: str
    engine_id: str
    block_count: int
    block_size: int
    num_tokens: int
    dtype: str
    layout: KvLayout
    expires_at: float  # Unix seconds
    prompt_digest: bytes
    model_fingerprint: str
    auth_key_id: str = ""
    auth_tag: bytes = b""


@dataclass(frozen=True)
class KvPrefill:
    """The prefill role: pin the prompt's blocks for `pin_seconds` (None: the engine's default)."""

    pin_seconds: float | None = None


@dataclass(frozen=True)
class KvDecode:
    """The decode role: pull the handle's blocks from `source_address` and decode."""

    handle: KvHandle
    source_address: str


KvRole = KvPrefill | KvDecode


@dataclass(frozen=True)
class KvPinOrder:
    """What the core needs to pin a prefill request's blocks (AddRequest)."""

    transfer_id: str
    seconds: float


@dataclass(frozen=True)
class KvPinned:
    """The core pinned a prefill request's blocks (on its last output)."""

    transfer_id: str
    block_count: int
    block_size: int
    num_tokens: int
    dtype: str
    layout: KvLayout
    expires_at: float  # Unix seconds


@dataclass(frozen=True)
class ImportedKv:
    """Pulled blocks a decode request brings to the core: `blocks[i]` is prompt block
    `first_block + i`, in the cache's own bytes."""

    first_block: int
    blocks: tuple[bytes, ...]


@dataclass(frozen=True)
class KvExport:
    """The core's answer to a pull (core/messages.ExportKv): blocks first_block.. in prompt order,
    as the cache's bytes."""

    first_block: int
    blocks: tuple[bytes, ...]


@dataclass(frozen=True)
class TransferStats:
    """What a decode request pulled (GenerateResponse.kv_transfer_stats)."""

    blocks_pulled: int
    blocks_cached: int
    bytes_pulled: int


def new_transfer_id() -> str:
    return secrets.token_hex(16)


def prompt_digest(token_ids: Sequence[int], cache_salt: str, lora_name: str, mm_hashes: Sequence[str] = ()) -> bytes:
    """What ties a handle to its prompt: the decode request must carry the same one."""
    digest = hashlib.sha256(b"tito-kv-prompt\0")
    for text in (cache_salt, lora_name, *mm_hashes):
        raw = text.encode()
        digest.update(struct.pack("<Q", len(raw)) + raw)
    digest.update(array("I", token_ids).tobytes())
    return digest.digest()


def block_checksum(data: bytes) -> bytes:
    return hashlib.sha256(data).digest()


def unknown_handle(detail: str) -> FailedPrecondition:
    return FailedPrecondition(f"the KV transfer handle names no pinned blocks here ({detail}): handles are "
                              f"single-use and expire; prefill the prompt again", reason=HANDLE_UNKNOWN,
                              field="kv_transfer.decode.handle")


class HandleIssuer:
    """This engine's handles: issued (signed when it holds a key) and checked."""

    def __init__(self, engine_id: str, model_fingerprint: str, signing_keys: Mapping[str, bytes],
                 max_pin_seconds: float = DEFAULT_PIN_SECONDS):
        self.engine_id = engine_id
        self.model_fingerprint = model_fingerprint
        self.signing_keys = dict(signing_keys)
        self.max_pin_seconds = max_pin_seconds

    def pin_order(self, role: KvPrefill) -> KvPinOrder:
        """The pin of a prefill request: its own seconds, capped at the engine's."""
        seconds = role.pin_seconds if role.pin_seconds else self.max_pin_seconds
        if not math.isfinite(seconds) or seconds < 0:
            raise InvalidArgument(f"pin_seconds must be a finite number > 0, got {seconds}", reason="INVALID_REQUEST",
                                  field="kv_transfer.prefill.pin_seconds")
        return KvPinOrder(new_transfer_id(), min(seconds, self.max_pin_seconds))

    def issue(self, pinned: KvPinned, request_id: str, digest: bytes) -> KvHandle:
        handle = KvHandle(pinned.transfer_id, request_id, self.engine_id, pinned.block_count, pinned.block_size,
                          pinned.num_tokens, pinned.dtype, pinned.layout, pinned.expires_at, digest,
                          self.model_fingerprint)
        if not self.signing_keys:
            return handle
        key_id, key = next(iter(self.signing_keys.items()))
        handle = _replace(handle, auth_key_id=key_id)
        return _replace(handle, auth_tag=signing.kv_handle_tag(handle, key))

    def check_pull(self, handle: KvHandle, now: float | None = None) -> None:
        """A PullKvBlocks handle: issued here, verifying, not expired."""
        self._check_signature(handle)
        if handle.engine_id != self.engine_id:
            raise unknown_handle(f"it was issued by engine {handle.engine_id!r}, this is {self.engine_id!r}")
        if (now if now is not None else time.time()) > handle.expires_at:
            raise unknown_handle("it expired")

    def check_decode(self, handle: KvHandle, digest: bytes) -> None:
        """A decode request's handle: verifying (when keys are shared), same model, same prompt."""
        self._check_signature(handle)
        if handle.model_fingerprint != self.model_fingerprint:
            raise FailedPrecondition("the KV transfer handle is for another model: decode on an engine of the "
                                     "model that prefilled", reason=TRANSFER_MISMATCH,
                                     field="kv_transfer.decode.handle")
        if not hmac.compare_digest(handle.prompt_digest, digest):
            raise FailedPrecondition("the request's prompt (token_ids, cache_salt, lora_name, media) is not the one "
                                     "the handle's KV was computed for", reason=TRANSFER_MISMATCH,
                                     field="kv_transfer.decode.handle.prompt_digest")

    def _check_signature(self, handle: KvHandle) -> None:
        if not self.signing_keys:
            return
        key = self.signing_keys.get(handle.auth_key_id)
        if key is None or not hmac.compare_digest(handle.auth_tag, signing.kv_handle_tag(handle, key)):
            raise PermissionDenied("the KV transfer handle's signature does not verify: send the handle the prefill "
                                   "response carried, unchanged", reason=HANDLE_FORGED,
                                   field="kv_transfer.decode.handle.auth_tag")


def _replace(handle: KvHandle, **changes) -> KvHandle:
    return dataclasses.replace(handle, **changes)
