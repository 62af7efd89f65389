"""Encoder outputs shared between engine processes through one directory (E/PD disaggregation).

`Encode` on one engine writes each item's encoder output here; `Generate` on another engine of
the same model, given METADATA-only items and the descriptors `Encode` returned, loads the
outputs instead of running its encoder. The directory is a local disk, an NFS export or a
Kubernetes shared volume mounted by every engine (the same idea as vLLM's `ec-shared-storage`
connector). Nothing here imports torch: entries are tito's wire encoding of a tensor (dtype,
shape, little-endian bytes).

Layout under the root:

* `store.json`: `{"format": 1, "store_id": "ecdir-<hex>"}`, created once by whichever engine
  opens the directory first (atomically: written aside, then linked into place; a second engine
  reads the winner's). Every engine on the directory therefore names the same `store_id`, which
  is what descriptors carry (`uri` is `ecdir://<store_id>`: the mount path may differ between
  engines and never leaves the engine).
* `entries/<h[:2]>/<h>.ec`, `h = sha256(key)` with key `<model_fingerprint>/<content_id>` (the
  encoder cache's `CacheKey.text`). No part of a path comes from a caller: a key is only ever
  hashed, so no key can name a file outside the root (`..`, `/`, NUL are just hashed bytes).
* `tmp/`: files being written.

An entry file is `MAGIC`, a 4-byte little-endian header length, a JSON header (key, model
fingerprint, dtype, shape, byte_size, checksum `sha256:<hex>` of the data) and the data.
Reading verifies everything: the header names the key asked for (a file copied under another
name is refused), the data has the header's length and checksum. A file that fails is
`EntryCorrupt` (tampered with or damaged on disk) and is removed, so the next `Encode` writes a
good one.

Writes are atomic: the entry is written to `tmp/`, flushed to disk, and hard-linked into place,
which fails when the name exists: the first writer of a key wins and later writers keep its
entry (an output re-encoded elsewhere with other rounding would otherwise make earlier
descriptors stale). Readers never see a partial file.

Size is bounded by `max_bytes` across all engines sharing the directory: after a write pushes
this process's running estimate past the bound, it rescans the directory and deletes the least
recently used entries (modification time; a read touches it) down to 90% of the bound. Engines
evict independently; a file deleted under a reader that has it open stays readable to it
(POSIX), one deleted before the reader opens it is `EntryMissing` (evicted).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import secrets
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from tito import tensors

MAGIC = b"TITOEC01"
FORMAT = 1
URI_SCHEME = "ecdir://"
_HEADER_LIMIT = 64 << 10
_STALE_TMP_SECONDS = 3600.0
_LOW_WATER = 0.9


class StoreError(Exception):
    """Base of the store's own errors (features.py turns them into the caller's codes)."""


class EntryMissing(StoreError):
    """No entry under the key: never written, or evicted since."""


class EntryCorrupt(StoreError):
    """The entry's file does not verify (tampered with or damaged on disk); it has been removed."""


@dataclass(frozen=True)
class StoredHeader:
    """What an entry file says about its data (and what a descriptor promises)."""

    key: str
    model_fingerprint: str
    dtype: int  # tito.v1.Dtype
    shape: tuple[int, ...]
    byte_size: int
    checksum: str  # "sha256:<hex>" of the data

    def to_json(self) -> bytes:
        return json.dumps({"key": self.key, "model_fingerprint": self.model_fingerprint, "dtype": self.dtype,
                           "shape": list(self.shape), "byte_size": self.byte_size, "checksum": self.checksum},
                          sort_keys=True).encode()

    @classmethod
    def from_json(cls, raw: bytes) -> "StoredHeader":
        value = json.loads(raw)
        shape = tuple(int(d) for d in value["shape"])
        header = cls(str(value["key"]), str(value["model_fingerprint"]), int(value["dtype"]), shape,
                     int(value["byte_size"]), str(value["checksum"]))
        if any(d < 0 for d in shape) or header.byte_size != math.prod(shape) * tensors.itemsize(header.dtype):
            raise ValueError("the header's byte_size is not its shape times the dtype's size")
        return header


def checksum_bytes(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


@dataclass(frozen=True)
class StoreStats:
    writes: int
    reads: int
    evictions: int
    corrupt: int
    bytes_estimate: int
    max_bytes: int


class SharedEncoderStore:
    """One engine's handle on a shared encoder-output directory."""

    def __init__(self, root: str | os.PathLike, *, max_bytes: int, model_fingerprint: str):
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        if not model_fingerprint:
            raise ValueError("model_fingerprint must not be empty")
        self.root = Path(root).resolve()
        self.max_bytes = max_bytes
        self.model_fingerprint = model_fingerprint
        self._entries = self.root / "entries"
        self._tmp = self.root / "tmp"
        self._entries.mkdir(parents=True, exist_ok=True)
        self._tmp.mkdir(exist_ok=True)
        self.store_id = self._open_identity()
        self._lock = threading.Lock()
        self._writes = self._reads = self._evictions = self._corrupt = 0
        self._bytes = self._scan_bytes()

    @property
    def uri(self) -> str:
        return f"{URI_SCHEME}{self.store_id}"

    # ------------------------------------------------------------------ identity and paths

    def _open_identity(self) -> str:
        path = self.root / "store.json"
        if not path.exists():
            candidate = json.dumps({"format": FORMAT, "store_id": f"ecdir-{secrets.token_hex(8)}"}).encode()
            self._link_new(candidate, path)  # loses quietly to another engine's identity
        value = json.loads(path.read_bytes())
        if value.get("format") != FORMAT or not str(value.get("store_id", "")).startswith("ecdir-"):
            raise ValueError(f"{path} is not a tito encoder store (format {FORMAT}); point the engine at an empty "
                             f"directory or one another tito engine created")
        return str(value["store_id"])

    def path_for(self, key: str) -> Path:
        """The entry file of `key`: a hash of the key, so always inside the root."""
        digest = hashlib.sha256(key.encode("utf-8", "surrogatepass")).hexdigest()
        path = self._entries / digest[:2] / f"{digest}.ec"
        if self._entries not in path.parents:  # cannot happen (hex names); kept as the guard it documents
            raise ValueError(f"entry path {path} escapes the store")
        return path

    def _link_new(self, data: bytes, path: Path) -> bool:
        """Write `data` to `path` atomically unless `path` exists; True when this call created it."""
        tmp = self._tmp / f"{os.getpid()}-{secrets.token_hex(8)}.part"
        with open(tmp, "wb") as out:
            out.write(data)
            out.flush()
            os.fsync(out.fileno())
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.link(tmp, path)
            return True
        except FileExistsError:
            return False
        finally:
            tmp.unlink(missing_ok=True)

    # ------------------------------------------------------------------ writes

    def put(self, key: str, dtype: int, shape: tuple[int, ...], data: bytes) -> StoredHeader | None:
        """Store an encoder output (wire encoding) under `key`; the header of the entry now there.

        When an entry for `key` exists already it is kept and its header returned (first writer
        wins); an unreadable one is replaced. None: the output alone exceeds the store's bound.
        """
        if len(data) > self.max_bytes:
            return None
        header = StoredHeader(key, self.model_fingerprint, dtype, tuple(int(d) for d in shape), len(data),
                              checksum_bytes(data))
        raw = header.to_json()
        blob = MAGIC + len(raw).to_bytes(4, "little") + raw + data
        path = self.path_for(key)
        if not self._link_new(blob, path):
            try:
                return self._read(path, key, header_only=True)[0]
            except (EntryMissing, EntryCorrupt):  # evicted meanwhile, or bad: put ours in its place
                if not self._link_new(blob, path):
                    return self._read(path, key, header_only=True)[0]
        with self._lock:
            self._writes += 1
            self._bytes += len(blob)
            over = self._bytes > self.max_bytes
        if over:
            self.evict(keep=path)
        return header

    def evict(self, keep: Path | None = None) -> int:
        """Delete least recently used entries until the directory holds at most 90% of the bound."""
        files = []
        now = time.time()
        for sub in self._entries.iterdir():
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub):
                try:
                    stat = entry.stat()
                except FileNotFoundError:
                    continue
                files.append((stat.st_mtime, stat.st_size, Path(entry.path)))
        for entry in os.scandir(self._tmp):  # writers that died mid-write
            try:
                if now - entry.stat().st_mtime > _STALE_TMP_SECONDS:
                    os.unlink(entry.path)
            except FileNotFoundError:
                pass
        total = sum(size for _, size, _ in files)
        target = int(self.max_bytes * _LOW_WATER)
        removed = 0
        for _, size, path in sorted(files, key=lambda f: f[0]):
            if total <= target:
                break
            if path == keep:
                continue
            try:
                path.unlink()
                removed += 1
            except FileNotFoundError:
                pass  # another engine evicted it first
            total -= size
        with self._lock:
            self._evictions += removed
            self._bytes = total
        return removed

    def remove(self, key: str) -> None:
        self.path_for(key).unlink(missing_ok=True)

    # ------------------------------------------------------------------ reads

    def get(self, key: str) -> tuple[StoredHeader, bytes]:
        """The header and data of `key`'s entry, verified; raises EntryMissing or EntryCorrupt."""
        header, data = self._read(self.path_for(key), key, header_only=False)
        with self._lock:
            self._reads += 1
        return header, data

    def header(self, key: str) -> StoredHeader:
        """`key`'s entry header without reading (or verifying) its data; raises EntryMissing/EntryCorrupt."""
        return self._read(self.path_for(key), key, header_only=True)[0]

    def _read(self, path: Path, key: str, *, header_only: bool) -> tuple[StoredHeader, bytes]:
        try:
            with open(path, "rb") as source:
                if not header_only:
                    os.utime(source.fileno())  # recently used: evicted last
                prefix = source.read(len(MAGIC) + 4)
                if len(prefix) < len(MAGIC) + 4 or prefix[:len(MAGIC)] != MAGIC:
                    raise self._corrupted(path, "it does not start with the store's magic bytes")
                size = int.from_bytes(prefix[len(MAGIC):], "little")
                if size > _HEADER_LIMIT:
                    raise self._corrupted(path, "its header length is implausible")
                try:
                    header = StoredHeader.from_json(source.read(size))
                except (ValueError, KeyError, TypeError) as exc:
                    raise self._corrupted(path, f"its header does not parse ({exc})") from None
                if header.key != key or header.model_fingerprint != self.model_fingerprint:
                    raise self._corrupted(path, "its header names another key")
                if header_only:
                    return header, b""
                data = source.read(header.byte_size + 1)
        except FileNotFoundError:
            raise EntryMissing(f"no entry for {key}") from None
        if len(data) != header.byte_size:
            raise self._corrupted(path, f"it holds {len(data)} data bytes, its header says {header.byte_size}")
        if checksum_bytes(data) != header.checksum:
            raise self._corrupted(path, "its data does not match its checksum")
        return header, data

    def _corrupted(self, path: Path, why: str) -> EntryCorrupt:
        path.unlink(missing_ok=True)
        with self._lock:
            self._corrupt += 1
        return EntryCorrupt(f"the stored entry failed verification: {why}; it was removed")

    # ------------------------------------------------------------------ accounting

    def _scan_bytes(self) -> int:
        total = 0
        for sub in self._entries.iterdir():
            if sub.is_dir():
                for entry in os.scandir(sub):
                    try:
                        total += entry.stat().st_size
                    except FileNotFoundError:
                        pass
        return total

    def stats(self) -> StoreStats:
        with self._lock:
            return StoreStats(self._writes, self._reads, self._evictions, self._corrupt, self._bytes, self.max_bytes)
