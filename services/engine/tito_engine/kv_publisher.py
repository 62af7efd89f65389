"""The engine's KV events on vLLM's own wire: a ZMQ PUB socket (and an optional ROUTER socket for
replay) in the exact framing of vLLM's `ZmqEventPublisher`, so an indexer written for vLLM
(llm-d's KV-cache indexer, Dynamo's KV router, SMG) subscribes to a tito engine unchanged.

Framing, as vLLM sends it: each batch is one multipart message `(topic, sequence, payload)`, the
sequence an 8-byte big-endian integer, the payload a msgpack-encoded `KVEventBatch`
(`[ts, [events...], data_parallel_rank]`, each event a map tagged `"type": "BlockStored"` /
`"BlockRemoved"` / `"AllBlocksCleared"` with vLLM's field names). Replay: a client sends an 8-byte
big-endian start sequence to the ROUTER socket and receives every buffered batch from it as
`(b"", topic, sequence, payload)`, then the end marker `(b"", b"", -1 as 8 signed bytes, b"")`.
Sequence numbers are the ones `SubscribeKvEvents` uses for the same batches.

Block hashes go out as vLLM sends them by default (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1): 64-bit
integers, the last 8 bytes of the engine's id read big-endian; `int_hashes=False` sends the ids'
bytes whole. The publisher binds `tcp://*:PORT` to loopback unless told to listen on every
interface (`public`): the events carry other callers' prompt tokens (docs/security.md).
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import msgspec
import zmq

from tito.config import ConfigError

from tito_engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch, KvEventLog

log = logging.getLogger(__name__)

END_SEQUENCE = (-1).to_bytes(8, "big", signed=True)
_HASH_MASK = (1 << 64) - 1


# The wire schema: vLLM's structs (vllm/distributed/kv_events.py), field for field, so msgspec
# encodes what vLLM's publisher encodes and vLLM's decoder reads it back.
class _EventBatch(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    ts: float
    events: list[Any]
    data_parallel_rank: int | None = None


class _KVCacheEvent(msgspec.Struct, omit_defaults=True, gc=False, tag=True):
    pass


class _BlockStored(_KVCacheEvent, tag="BlockStored"):
    block_hashes: list[bytes | int]
    parent_block_hash: bytes | int | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None
    medium: str | None
    lora_name: str | None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


class _BlockRemoved(_KVCacheEvent, tag="BlockRemoved"):
    block_hashes: list[bytes | int]
    medium: str | None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


class _AllBlocksCleared(_KVCacheEvent, tag="AllBlocksCleared"):
    pass


class _KVEventBatch(_EventBatch):
    events: list[_BlockStored | _BlockRemoved | _AllBlocksCleared]


def wire_hash(digest: bytes | int, int_hashes: bool) -> bytes | int:
    """A block id as the ZMQ wire carries it (see the module docstring)."""
    if isinstance(digest, int):
        return digest
    return int.from_bytes(digest, "big") & _HASH_MASK if int_hashes else digest


def to_wire(batch: KvEventBatch, int_hashes: bool = True) -> _KVEventBatch:
    events: list[Any] = []
    for event in batch.events:
        if isinstance(event, BlockStored):
            extra = None
            # vLLM's order per block: the bare LoRA name (when the blocks have one), (mm_hash,
            # offset) pairs, the bare salt.
            lora = (event.lora_name,) if event.lora_name else ()
            if event.extra_keys is not None or lora:
                entries = event.extra_keys if event.extra_keys is not None else (None,) * len(event.block_hashes)
                extra = [tuple([*lora, *(() if keys is None else (
                    *((media.mm_hash, media.offset) for media in keys.media),
                    *((keys.cache_salt,) if keys.cache_salt else ())))]) or None
                         for keys in entries]
            parent = event.parent_block_hash
            events.append(_BlockStored(
                block_hashes=[wire_hash(digest, int_hashes) for digest in event.block_hashes],
                parent_block_hash=None if parent is None else wire_hash(parent, int_hashes),
                token_ids=list(event.token_ids), block_size=event.block_size, lora_id=None, medium=event.medium,
                lora_name=event.lora_name, extra_keys=extra))
        elif isinstance(event, BlockRemoved):
            events.append(_BlockRemoved(block_hashes=[wire_hash(digest, int_hashes) for digest in event.block_hashes],
                                        medium=event.medium))
        elif isinstance(event, AllBlocksCleared):
            events.append(_AllBlocksCleared())
    return _KVEventBatch(ts=batch.timestamp, events=events, data_parallel_rank=batch.data_parallel_rank)


def encode_batch(batch: KvEventBatch, int_hashes: bool = True) -> bytes:
    """The msgpack payload of one batch, as vLLM's publisher would send it."""
    return msgspec.msgpack.encode(to_wire(batch, int_hashes))


def bind_address(endpoint: str, public: bool) -> str:
    """Where to bind `endpoint`: `tcp://*:PORT` means loopback unless `public`."""
    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ConfigError(f"KV events endpoint {endpoint!r} must be tcp://HOST:PORT (e.g. tcp://*:5557), ipc://PATH "
                          f"or inproc://NAME")
    if endpoint.startswith("tcp://*:") and not public:
        return "tcp://127.0.0.1:" + endpoint.removeprefix("tcp://*:")
    return endpoint


class ZmqKvEventPublisher:
    """Publishes a KvEventLog's batches on ZMQ; one thread owns both sockets (ZMQ sockets are not
    thread-safe). `endpoint` / `replay_endpoint` give the bound addresses after `start()` (a port
    of 0 is chosen by the OS)."""

    def __init__(self, events: KvEventLog, endpoint: str, replay_endpoint: str | None = None, *, topic: str = "",
                 public: bool = False, int_hashes: bool = True, hwm: int = 100_000):
        self._log = events
        self._topic = topic.encode()
        self._int_hashes = int_hashes
        self._context = zmq.Context.instance()
        self._pub = self._context.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay = None
        try:
            self.endpoint = self._bind(self._pub, bind_address(endpoint, public))
            if replay_endpoint:
                self._replay = self._context.socket(zmq.ROUTER)
                self.replay_endpoint = self._bind(self._replay, bind_address(replay_endpoint, public))
            else:
                self.replay_endpoint = None
        except BaseException:
            self._close()
            raise
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="tito-kv-events-zmq", daemon=True)

    @staticmethod
    def _bind(socket: zmq.Socket, address: str) -> str:
        try:
            socket.bind(address)
        except zmq.ZMQError as exc:
            raise ConfigError(f"cannot bind the KV events endpoint {address}: {exc}") from exc
        return socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> None:
        self._log.add_listener(self._queue.put)
        self._thread.start()
        log.info("KV events published on %s%s", self.endpoint,
                 f" (replay on {self.replay_endpoint})" if self.replay_endpoint else "")

    def stop(self, timeout: float = 2.0) -> None:
        self._running = False
        self._queue.put(None)
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._close()

    def _close(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)

    def _serve(self) -> None:
        while self._running:
            if self._replay is not None and self._replay.poll(0):
                try:
                    self._answer_replay()
                except Exception:  # noqa: BLE001 - a bad replay request must not stop publishing
                    log.exception("answering a KV events replay request failed")
            try:
                batch = self._queue.get(timeout=0.05)
            except queue.Empty:
                continue
            if batch is None:
                return
            try:
                self._pub.send_multipart((self._topic, batch.sequence.to_bytes(8, "big"),
                                          encode_batch(batch, self._int_hashes)))
            except Exception:  # noqa: BLE001 - keep publishing the next batches
                log.exception("publishing KV events batch %d failed", batch.sequence)

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3:
            log.warning("ignoring a KV events replay request of %d frames (want: identity, empty, sequence)",
                        len(frames))
            return
        client, _, start_bytes = frames
        start = max(int.from_bytes(start_bytes, "big"), self._log.oldest_sequence)
        try:
            batches = self._log.since(start)
        except Exception:  # noqa: BLE001 - past the end: nothing to replay
            batches = []
        for batch in batches:
            self._replay.send_multipart((client, b"", self._topic, batch.sequence.to_bytes(8, "big"),
                                         encode_batch(batch, self._int_hashes)))
        self._replay.send_multipart((client, b"", b"", END_SEQUENCE, b""))
