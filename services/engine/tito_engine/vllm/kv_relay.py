"""vLLM's own KV events, relayed into the engine's KvEventLog (SubscribeKvEvents, --kv-events-endpoint).

The vllm backend turns on vLLM's KV cache events (`kv_events_config`: enable_kv_cache_events, the
zmq publisher) on private `ipc://` sockets in a directory only this user can open; vLLM's engine
core publishes every scheduler step's events there. A relay thread here subscribes, decodes each
batch with vLLM's own `KVEventBatch` decoder, converts the events to tito's (the same field set)
and appends them to the log. A gap in vLLM's sequence numbers (a message lost while the socket
was joining) is filled from vLLM's replay socket; what cannot be recovered any more is reported
to subscribers as `AllBlocksCleared` followed by what comes next, so their view never silently
diverges. Block hashes stay as vLLM made them (64-bit integers by default); the gRPC stream sends
an integer id as its 8 bytes big-endian.
"""

from __future__ import annotations

import logging
import os
import tempfile
import threading
from collections.abc import Iterable
from typing import Any

from tito_engine.kv_events import (AllBlocksCleared, BlockKeys, BlockRemoved, BlockStored, KvEvent, KvEventLog,
                                   MediaKey, extra_keys_or_none)

log = logging.getLogger(__name__)

END_SEQUENCE = -1


def private_endpoints() -> tuple[str, str]:
    """(publish, replay) ipc:// endpoints in a fresh directory only this user can open."""
    directory = tempfile.mkdtemp(prefix="tito-vllm-kv-")
    os.chmod(directory, 0o700)
    return f"ipc://{directory}/events", f"ipc://{directory}/replay"


def events_config(endpoint: str, replay_endpoint: str) -> Any:
    from vllm.config.kv_events import KVEventsConfig

    return KVEventsConfig(enable_kv_cache_events=True, publisher="zmq", endpoint=endpoint,
                          replay_endpoint=replay_endpoint, topic="")


def _block_keys(entry: Iterable[Any] | None, lora_name: str | None) -> BlockKeys | None:
    """One block's vLLM extra keys (bare LoRA name, (mm_identifier, offset) pairs, the bare salt,
    prompt-embeds digests) as tito's."""
    if entry is None:
        return None
    media, salt, lora_seen = [], "", False
    for key in entry:
        if isinstance(key, (list, tuple)) and len(key) == 2 and isinstance(key[0], str):
            media.append(MediaKey(key[0], int(key[1])))
        elif isinstance(key, str):
            if lora_name and not lora_seen and key == lora_name:
                lora_seen = True
            else:
                salt = key
        # bytes: a prompt-embeds digest; tito sends no prompt embeddings
    keys = BlockKeys(tuple(media), salt)
    return keys if keys else None


def from_vllm(events: Iterable[Any]) -> list[KvEvent]:
    """vLLM's KVCacheEvents as tito's."""
    from vllm.distributed.kv_events import AllBlocksCleared as VllmCleared
    from vllm.distributed.kv_events import BlockRemoved as VllmRemoved
    from vllm.distributed.kv_events import BlockStored as VllmStored

    converted: list[KvEvent] = []
    for event in events:
        if isinstance(event, VllmStored):
            extra = None
            if event.extra_keys is not None:
                extra = extra_keys_or_none(_block_keys(entry, event.lora_name) for entry in event.extra_keys)
            converted.append(BlockStored(tuple(event.block_hashes), event.parent_block_hash,
                                         tuple(event.token_ids), event.block_size, extra, event.medium,
                                         event.lora_name))
        elif isinstance(event, VllmRemoved):
            converted.append(BlockRemoved(tuple(event.block_hashes), event.medium))
        elif isinstance(event, VllmCleared):
            converted.append(AllBlocksCleared())
    return converted


class VllmKvEventRelay:
    """Subscribes to vLLM's KV event sockets and appends what they carry to `events`."""

    def __init__(self, events: KvEventLog, endpoint: str, replay_endpoint: str | None):
        import msgspec
        import zmq
        from vllm.distributed.kv_events import KVEventBatch

        self._log = events
        self._zmq = zmq
        self._decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
        self._context = zmq.Context.instance()
        self._sub = self._context.socket(zmq.SUB)
        self._sub.setsockopt(zmq.SUBSCRIBE, b"")
        self._sub.connect(endpoint)
        self._replay_endpoint = replay_endpoint
        self._expected = 0  # vLLM numbers its batches from 0
        self._running = True
        self._thread = threading.Thread(target=self._serve, name="tito-vllm-kv-relay", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        self._running = False
        if self._thread.is_alive():
            self._thread.join(timeout)
        self._sub.close(linger=0)

    def _serve(self) -> None:
        while self._running:
            try:
                if not self._sub.poll(100):
                    continue
                _, sequence_bytes, payload = self._sub.recv_multipart()
                sequence = int.from_bytes(sequence_bytes, "big")
                if sequence < self._expected:
                    continue  # already relayed (from a replay)
                if sequence > self._expected:
                    self._fill_gap(sequence)
                self._relay(sequence, self._decoder.decode(payload))
            except Exception:  # noqa: BLE001 - keep relaying what comes next
                if self._running:
                    log.exception("relaying vLLM's KV events failed")

    def _relay(self, sequence: int, batch: Any) -> None:
        self._log.append(from_vllm(batch.events), batch.ts)
        self._expected = sequence + 1

    def _fill_gap(self, upto: int) -> None:
        """Batches [expected, upto) from vLLM's replay socket; what it no longer has becomes one
        AllBlocksCleared (the subscribers' view is then rebuilt from what follows)."""
        recovered = self._replay(self._expected, upto)
        if recovered and recovered[0][0] == self._expected and \
                [seq for seq, _ in recovered] == list(range(self._expected, upto)):
            for sequence, batch in recovered:
                self._relay(sequence, batch)
            return
        log.warning("vLLM's KV event batches %d..%d are lost; subscribers see AllBlocksCleared", self._expected,
                    upto - 1)
        self._log.append([AllBlocksCleared()])
        self._expected = upto

    def _replay(self, start: int, upto: int) -> list[tuple[int, Any]]:
        if self._replay_endpoint is None:
            return []
        zmq = self._zmq
        dealer = self._context.socket(zmq.DEALER)
        try:
            dealer.connect(self._replay_endpoint)
            dealer.send_multipart((b"", start.to_bytes(8, "big")))
            batches = []
            while dealer.poll(2000):
                _, _, sequence_bytes, payload = dealer.recv_multipart()
                sequence = int.from_bytes(sequence_bytes, "big", signed=True)
                if sequence == END_SEQUENCE:
                    break
                if start <= sequence < upto:
                    batches.append((sequence, self._decoder.decode(payload)))
            return batches
        finally:
            dealer.close(linger=0)
