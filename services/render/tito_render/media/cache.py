"""A per-process LRU cache of processed images, keyed by the encoded bytes and the settings.

Chat clients resend the same image on every turn of a conversation; decoding a large PNG alone
takes tens of milliseconds. The key is a SHA-256 of the encoded bytes plus the model family and
the effective processor settings, so a hit returns exactly what processing those bytes would
give (the mm_hash stored with it was computed from the decoded pixels, as always). Bounded by
the bytes of the tensors it holds; 0 disables it. Thread-safe (render threads share it).
"""

from __future__ import annotations

import hashlib
import threading
from collections import OrderedDict
from dataclasses import dataclass

from tito_render.media.hashing import canonical_json
from tito_render.media.processors import ProcessedImage

_DOMAIN = b"tito.render.processed-image-cache.v1\x00"
#: Rough per-entry bookkeeping cost, so many tiny entries still count.
_ENTRY_OVERHEAD = 1024


@dataclass(frozen=True)
class CachedImage:
    mm_hash: str
    processed: ProcessedImage

    @property
    def has_tensors(self) -> bool:
        return bool(self.processed.kwargs)

    @property
    def size(self) -> int:
        arrays = [*self.processed.kwargs.values(), *self.processed.metadata.values()]
        return _ENTRY_OVERHEAD + sum(a.nbytes for a in arrays) + len(self.processed.span_text)


class ProcessedImageCache:
    def __init__(self, max_bytes: int) -> None:
        self.max_bytes = max_bytes
        self._entries: OrderedDict[bytes, CachedImage] = OrderedDict()
        self._bytes = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @property
    def enabled(self) -> bool:
        """Whether entries are kept at all (callers skip computing keys when not)."""
        return self.max_bytes > 0

    @staticmethod
    def key(encoded: bytes, family: str, options: dict) -> bytes:
        digest = hashlib.sha256(_DOMAIN)
        digest.update(canonical_json({"family": family, "options": options}))
        digest.update(b"\x00")
        digest.update(encoded)
        return digest.digest()

    def get(self, key: bytes, need_tensors: bool) -> CachedImage | None:
        if self.max_bytes <= 0:
            return None
        with self._lock:
            entry = self._entries.get(key)
            if entry is None or (need_tensors and not entry.has_tensors):
                self.misses += 1
                return None
            self._entries.move_to_end(key)
            self.hits += 1
            return entry

    def put(self, key: bytes, entry: CachedImage) -> None:
        size = entry.size
        if self.max_bytes <= 0 or size > self.max_bytes:
            return
        with self._lock:
            old = self._entries.pop(key, None)
            if old is not None:
                self._bytes -= old.size
            self._entries[key] = entry
            self._bytes += size
            while self._bytes > self.max_bytes:
                _, evicted = self._entries.popitem(last=False)
                self._bytes -= evicted.size

    def __len__(self) -> int:
        return len(self._entries)
