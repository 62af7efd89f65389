"""KV cache events in vLLM's shapes, and the engine's bounded log of them. Torch-free, grpc-free.

What an engine's prefix cache stores, evicts and clears is what a cache-aware router needs to
send a request where its prefix K/V already is. The events have the field set of vLLM's
`vllm/distributed/kv_events.py` (`BlockStored`, `BlockRemoved`, `AllBlocksCleared` in a
`KVEventBatch` with a sequence number and a timestamp), which llm-d's KV-cache indexer, Dynamo's
KV router and SMG consume. Both backends feed one `KvEventLog` (the native engine from its
`BlockAllocator`, the vLLM backend by relaying vLLM's own events); the `SubscribeKvEvents` RPC and
the optional ZMQ publisher read from it.

The log numbers batches 0, 1, 2, ... and keeps the last `capacity` of them, so a subscriber that
was away can resume from a sequence number; asking for one that has been dropped (or one that was
never reached: the engine restarted) raises `OutOfRange` with the way to resync.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections import deque
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass

from tito.errors import OutOfRange, Unavailable

#: vLLM's medium names.
MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"

#: Batches a log keeps for replay (vLLM's ZmqEventPublisher keeps 10,000 "buffer_steps").
DEFAULT_KV_EVENT_BUFFER = 10_000

SEQUENCE_DROPPED = "KV_EVENTS_SEQUENCE_DROPPED"
SEQUENCE_AHEAD = "KV_EVENTS_SEQUENCE_AHEAD"


@dataclass(frozen=True, slots=True)
class MediaKey:
    """A media item inside a block: its mm_hash and where its placeholder starts relative to the
    block's first token (negative when it began in an earlier block). vLLM's (mm_hash, offset)."""

    mm_hash: str
    offset: int


@dataclass(frozen=True, slots=True)
class BlockKeys:
    """What a block's hash covers besides its tokens (vLLM's per-block extra_keys entry)."""

    media: tuple[MediaKey, ...] = ()
    cache_salt: str = ""

    def __bool__(self) -> bool:
        return bool(self.media or self.cache_salt)


@dataclass(frozen=True, slots=True)
class BlockStored:
    """Consecutive full blocks of one prompt that the cache now holds."""

    block_hashes: tuple[bytes | int, ...]  # tito: 32-byte digests; relayed from vLLM: its ids (64-bit ints)
    parent_block_hash: bytes | int | None
    token_ids: tuple[int, ...]  # block_size per block, concatenated
    block_size: int
    extra_keys: tuple[BlockKeys | None, ...] | None = None  # one per block; None: no block has any
    medium: str | None = None
    lora_name: str | None = None


@dataclass(frozen=True, slots=True)
class BlockRemoved:
    """Blocks the cache no longer holds."""

    block_hashes: tuple[bytes | int, ...]
    medium: str | None = None


@dataclass(frozen=True, slots=True)
class AllBlocksCleared:
    """The cache holds nothing any more."""


KvEvent = BlockStored | BlockRemoved | AllBlocksCleared


@dataclass(frozen=True, slots=True)
class KvEventBatch:
    """One batch: the events of one engine step (or one relayed vLLM batch), in order."""

    sequence: int
    timestamp: float  # seconds since the Unix epoch
    events: tuple[KvEvent, ...]
    data_parallel_rank: int | None = None


def extra_keys_or_none(keys: Iterable[BlockKeys | None]) -> tuple[BlockKeys | None, ...] | None:
    """Per-block keys as events carry them: None entries for blocks without any, None overall
    when no block has any (vLLM's convention)."""
    entries = tuple(key if key else None for key in keys)
    return entries if any(entry is not None for entry in entries) else None


class KvEventLog:
    """The engine's KV events: numbered batches, the last `capacity` kept for replay, handed to
    listeners (the ZMQ publisher) and to async subscribers. `append` may be called from any
    thread; subscribers run on event loops."""

    def __init__(self, capacity: int = DEFAULT_KV_EVENT_BUFFER, data_parallel_rank: int | None = None):
        if capacity < 1:
            raise ValueError("a KV event log keeps at least one batch")
        self.capacity = capacity
        self.data_parallel_rank = data_parallel_rank
        self._lock = threading.Lock()
        self._buffer: deque[KvEventBatch] = deque(maxlen=capacity)
        self._next = 0
        self._closed = False
        self._waiters: set[tuple[asyncio.AbstractEventLoop, asyncio.Event]] = set()
        self._listeners: list[Callable[[KvEventBatch], None]] = []

    @property
    def next_sequence(self) -> int:
        with self._lock:
            return self._next

    @property
    def oldest_sequence(self) -> int:
        """The first sequence still buffered (== next_sequence when nothing is)."""
        with self._lock:
            return self._oldest_locked()

    def _oldest_locked(self) -> int:
        return self._buffer[0].sequence if self._buffer else self._next

    def add_listener(self, listener: Callable[[KvEventBatch], None]) -> None:
        """Call `listener(batch)` for every batch appended from now on (in order, on the appending
        thread; it must not block)."""
        with self._lock:
            self._listeners.append(listener)

    def append(self, events: Iterable[KvEvent], timestamp: float | None = None) -> KvEventBatch | None:
        """Number and keep one batch of events (none: nothing happens); wake the subscribers."""
        events = tuple(events)
        if not events:
            return None
        with self._lock:
            batch = KvEventBatch(self._next, time.time() if timestamp is None else timestamp, events,
                                 self.data_parallel_rank)
            self._next += 1
            self._buffer.append(batch)
            # Listeners are called under the lock so that they see batches in sequence order.
            for listener in self._listeners:
                listener(batch)
            waiters = list(self._waiters)
        _wake(waiters)
        return batch

    def since(self, start: int) -> list[KvEventBatch]:
        """The buffered batches from sequence `start` on (empty when `start` is the next one)."""
        with self._lock:
            self._check_locked(start)
            oldest = self._oldest_locked()
            return list(self._buffer)[start - oldest:]

    def _check_locked(self, start: int) -> None:
        oldest = self._oldest_locked()
        if start < oldest:
            raise OutOfRange(f"KV event batch {start} is no longer buffered (this engine keeps the last "
                             f"{self.capacity}; the oldest now is {oldest}); resync: forget every block this "
                             f"engine reported and subscribe again from oldest_sequence or live",
                             reason=SEQUENCE_DROPPED,
                             metadata={"oldest_sequence": str(oldest), "next_sequence": str(self._next)})
        if start > self._next:
            raise OutOfRange(f"KV event batch {start} lies past this engine's next batch {self._next}: the engine "
                             f"restarted since; resync: forget every block it reported and subscribe again from "
                             f"oldest_sequence or live", reason=SEQUENCE_AHEAD,
                             metadata={"oldest_sequence": str(oldest), "next_sequence": str(self._next)})

    def close(self) -> None:
        """The engine stops: subscribers end (with UNAVAILABLE SHUTTING_DOWN)."""
        with self._lock:
            self._closed = True
            waiters = list(self._waiters)
        _wake(waiters)

    async def subscribe(self, start: int | None = None) -> AsyncIterator[KvEventBatch]:
        """Replay from `start` (None: live only), then follow live. Raises OutOfRange before the
        first batch for a start the log cannot serve, and later when this subscriber fell so far
        behind that its next batch was dropped."""
        loop = asyncio.get_running_loop()
        wake = asyncio.Event()
        waiter = (loop, wake)
        with self._lock:
            position = self._next if start is None else start
            self._check_locked(position)
            self._waiters.add(waiter)
        try:
            while True:
                wake.clear()
                batches = self.since(position)
                for batch in batches:
                    yield batch
                    position = batch.sequence + 1
                if not batches:
                    with self._lock:
                        closed = self._closed
                    if closed:
                        raise Unavailable("the engine is shutting down; subscribe to another replica",
                                          reason="SHUTTING_DOWN")
                    await wake.wait()
        finally:
            with self._lock:
                self._waiters.discard(waiter)


def _wake(waiters: list[tuple[asyncio.AbstractEventLoop, asyncio.Event]]) -> None:
    for loop, event in waiters:
        try:
            loop.call_soon_threadsafe(event.set)
        except RuntimeError:  # that loop is closed: its subscriber is gone
            pass
