"""The engine's encoder cache: computed encoder outputs kept by content, under a byte budget.

An entry is the encoder output of one media item (`rows`, shape [num_rows, hidden]) keyed by
`CacheKey(mm_hash, model_fingerprint)`: the same image seen again by the same model skips the
encoder, and an output computed by another model can never be served (the fingerprint is part of
the key). Each entry carries a `sha256:<hex>` checksum of its bytes as they would travel on the
wire (tito.tensors encoding), which is what an `EncoderCacheDescriptor` promises and what admission
compares a presented descriptor against.

Eviction is least-recently-used within `max_bytes`. An evicted entry's tensor stays alive for as
long as someone still holds it (admission pins the rows of a hit into the validated request), so
eviction never pulls data out from under a scheduled request.

Whether a *request* may look up or fill an entry under a given hash is decided by admission
(`features.py`), not here: this module trusts its callers to have bound the key to the content.

Thread-safety: every public method takes one lock. The engine thread writes (`put`) and reads;
the servicer thread may read (`get`, `descriptor_for`, `stats`) concurrently.
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

from tito import tensors
from tito.errors import NotFound

from tito_engine.multimodal.domain import EncoderCacheDescriptor


@dataclass(frozen=True)
class CacheKey:
    """Identity of an encoder output: the item's content hash and the model that encoded it."""

    mm_hash: str
    model_fingerprint: str

    @property
    def text(self) -> str:
        """The key as a descriptor carries it: `<model_fingerprint>/<mm_hash>`."""
        return f"{self.model_fingerprint}/{self.mm_hash}"


@dataclass(frozen=True)
class CacheEntry:
    """One cached encoder output. `rows` must not be modified in place by anyone holding it."""

    key: CacheKey
    rows: torch.Tensor
    checksum: str  # "sha256:<hex>" of the rows' wire bytes (little-endian, row-major)
    dtype: int  # tito.v1.Dtype
    shape: tuple[int, ...]
    byte_size: int


@dataclass(frozen=True)
class CacheStats:
    hits: int
    misses: int
    entries: int
    bytes_used: int
    max_bytes: int
    evictions: int


def checksum_of(rows: torch.Tensor) -> tuple[str, int, tuple[int, ...], int]:
    """(checksum, dtype, shape, byte_size) of `rows` in tito's wire encoding."""
    wire = tensors.from_torch(rows)
    return f"sha256:{hashlib.sha256(wire.data).hexdigest()}", wire.dtype, tuple(wire.shape), len(wire.data)


class EncoderCache:
    """LRU cache of encoder outputs with a byte budget, hit/miss counters and descriptors."""

    def __init__(self, *, max_bytes: int, store_id: str, model_fingerprint: str):
        if max_bytes < 0:
            raise ValueError(f"max_bytes must be >= 0, got {max_bytes}")
        if not store_id:
            raise ValueError("store_id must not be empty: descriptors name it")
        self.max_bytes = max_bytes
        self.store_id = store_id
        self.model_fingerprint = model_fingerprint
        self._entries: OrderedDict[CacheKey, CacheEntry] = OrderedDict()  # oldest first
        self._bytes = 0
        self._hits = 0
        self._misses = 0
        self._evictions = 0
        self._lock = threading.Lock()

    @property
    def uri(self) -> str:
        return f"engine://{self.store_id}"

    def key_for(self, mm_hash: str) -> CacheKey:
        return CacheKey(mm_hash, self.model_fingerprint)

    # ------------------------------------------------------------------ reads

    def get(self, key: CacheKey) -> CacheEntry | None:
        """The entry for `key` (now most recently used), counting a hit or a miss."""
        with self._lock:
            entry = self._entries.get(key)
            if entry is None:
                self._misses += 1
                return None
            self._entries.move_to_end(key)
            self._hits += 1
            return entry

    def peek(self, key: CacheKey) -> CacheEntry | None:
        """The entry for `key` without touching counters or recency (for inspection)."""
        with self._lock:
            return self._entries.get(key)

    def __contains__(self, key: CacheKey) -> bool:
        with self._lock:
            return key in self._entries

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def stats(self) -> CacheStats:
        with self._lock:
            return CacheStats(self._hits, self._misses, len(self._entries), self._bytes, self.max_bytes,
                              self._evictions)

    def descriptor_for(self, key: CacheKey) -> EncoderCacheDescriptor:
        """Where `key`'s output lives, as the Encode RPC returns it; NotFound if it is not cached."""
        with self._lock:
            entry = self._entries.get(key)
        if entry is None:
            raise NotFound(f"no encoder output for mm_hash {key.mm_hash} is cached (it was never encoded "
                           f"or has been evicted)", reason="ENCODER_CACHE_MISS")
        return EncoderCacheDescriptor(
            store_id=self.store_id, uri=self.uri, key=key.text, dtype=entry.dtype, shape=tuple(entry.shape),
            byte_size=entry.byte_size, checksum=entry.checksum, model_fingerprint=key.model_fingerprint)

    # ------------------------------------------------------------------ writes

    def put(self, key: CacheKey, rows: torch.Tensor) -> CacheEntry:
        """Store `rows` under `key`, evicting least recently used entries to fit the budget.

        Returns the entry (also when it is larger than the whole budget and so not kept: the
        caller still gets its checksum). Re-putting an existing key replaces the entry.
        """
        if key.model_fingerprint != self.model_fingerprint:
            raise ValueError(f"key for model {key.model_fingerprint!r} put into the cache of model "
                             f"{self.model_fingerprint!r}")
        rows = rows.detach()
        checksum, dtype, shape, byte_size = checksum_of(rows)  # outside the lock: hashing is the slow part
        return self._insert(CacheEntry(key, rows, checksum, dtype, shape, byte_size))

    def put_verified(self, key: CacheKey, rows: torch.Tensor, *, checksum: str, dtype: int,
                     byte_size: int) -> CacheEntry:
        """`put` for rows whose wire checksum is known already (loaded from the shared encoder store,
        which verified it), so they are not hashed twice."""
        if key.model_fingerprint != self.model_fingerprint:
            raise ValueError(f"key for model {key.model_fingerprint!r} put into the cache of model "
                             f"{self.model_fingerprint!r}")
        return self._insert(CacheEntry(key, rows.detach(), checksum, dtype, tuple(rows.shape), byte_size))

    def _insert(self, entry: CacheEntry) -> CacheEntry:
        key, byte_size = entry.key, entry.byte_size
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.byte_size
            if byte_size > self.max_bytes:
                return entry
            while self._entries and self._bytes + byte_size > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.byte_size
                self._evictions += 1
            self._entries[key] = entry
            self._bytes += byte_size
        return entry

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
