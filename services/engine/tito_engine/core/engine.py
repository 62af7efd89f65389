"""The native backend: tito's own continuous-batching engine (the live-request registry, load, streams).

The model and the scheduler live in an engine core (engine_core.py), hosted on a thread
(`Engine(runner)`) or in a child process (`Engine.in_process(spec)`, what the server uses) — the
same loop either way. Callers submit from any thread; outputs come back one batch per step and go
to each request's `deliver` callback. For streams of the async facade the batch is handed to
their event loop in one `call_soon_threadsafe` (at most one hand-over in flight per loop; what
arrives meanwhile goes with the next), and each stream merges what piled up for a choice into one
output. The gRPC event loop never runs a forward pass.

Requests arrive admitted (admission.py: the checks shared with the vLLM backend, including phase 1
of media admission). `submit` sends the checked items with the "add"; the core runs phase 2
against its encoder cache and may answer with a TitoError (they pickle whole), delivered to the caller
unchanged. `encode` (the Encode RPC) is a call to the core answered by key, outside the request
registry.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
import weakref
from collections.abc import AsyncIterator, Callable
from typing import Any

from tito.errors import Unavailable
from tito.supervision import retry

from tito_engine.backend.admission import AdmittedRequest, KVCapacity
from tito_engine.backend.interface import LoadSnapshot, check_can_accept
from tito_engine.core.messages import (AbortRequest, AddRequest, CoreLoad, EncodeItems, EncodeResult, ExportKv,
                                       KvExport, ListLoras, LoadLora, PeekPrefix, PrefixCacheReset, ResetPrefixCache,
                                       StepBatch, UnloadLora)
from tito_engine.core.engine_core import CoreProcessSpec, ProcessCore, ThreadCore
from tito_engine.core.seams import CoreHost, CoreRunner
from tito_engine.multimodal.domain import EncoderCacheDescriptor
from tito_engine.multimodal.features import CheckedFeatures
from tito_engine.kv_events import DEFAULT_KV_EVENT_BUFFER, AllBlocksCleared, KvEventLog
from tito_engine.lora_types import LoraAdapterInfo
from tito_engine.request import ChoiceOutput, FinishReason, Submission, Usage
from tito_engine.limits import DEFAULT_MAX_WAITING_REQUESTS, SchedulerLimits

log = logging.getLogger(__name__)

Deliver = Callable[[ChoiceOutput | BaseException], None]
CORE_LOST_MESSAGE = "the engine's model process exited; a new one is starting: retry shortly"


class Engine:
    kv_connector = False  # prefill/decode through tito's own transfers (PullKvBlocks)
    kv_connector_name = ""
    def __init__(self, runner: CoreRunner | None = None, *, limits: SchedulerLimits = SchedulerLimits(),
                 max_waiting_requests: int = DEFAULT_MAX_WAITING_REQUESTS, core: CoreHost | None = None,
                 encoder_cache_bytes: int = 0, encoder_store_dir: str = "", encoder_store_bytes: int = 0,
                 kv_event_buffer: int = DEFAULT_KV_EVENT_BUFFER, lora_dir: str = "",
                 lora_modules: tuple[tuple[str, str], ...] = ()):
        """`runner` hosts the core on a thread of this process; `core` passes a ready host instead
        (built with the same `limits`). `kv_event_buffer`: KV event batches kept for replay.

        `encoder_cache_bytes` sizes the thread-hosted core's encoder cache; `encoder_store_dir`
        (bounded by `encoder_store_bytes`) is the shared encoder store it writes Encode's outputs to.
        `lora_dir` and `lora_modules`: the thread-hosted core's LoRA adapters (engine_core.EngineCore). Requests arrive
        admitted (admission.py): this class only queues, schedules and streams them.
        """
        if core is None and runner is None:
            raise ValueError("Engine needs a runner (hosted on a thread here) or a ready core host")
        self._core: CoreHost = core if core is not None else ThreadCore(runner, limits, encoder_cache_bytes,
                                                                        encoder_store_dir, encoder_store_bytes,
                                                                        lora_dir, lora_modules)
        self.info = self._core.info
        self.max_loras, self.max_lora_rank = self._core.max_loras, self._core.max_lora_rank
        self.mm_spec = self._core.mm_spec
        self.max_running_sequences = limits.max_running_sequences
        self.max_waiting_requests = max_waiting_requests
        self._kv_blocks_total = self._core.kv_blocks_total
        self._block_size = self._core.block_size
        self.kv_capacity = KVCapacity(self._kv_blocks_total, self._block_size,
                                      how_to_grow="start the engine with more --kv-blocks / --kv-cache-bytes")
        # Its scheduler places an item of any size in one prefill chunk; the encoder cache only
        # keeps what fits its bytes (engine_core), so no per-item bound of its own.
        self.media_item_rows_limit: int | None = None
        self._lock = threading.Lock()
        self._live: dict[str, Submission] = {}  # request id -> submission, until its last output
        self._by_key: dict[int, Submission] = {}
        self._keys = itertools.count(1)
        self._submitted = 0  # "add" commands sent; the core reports how many it has taken
        self._load = LoadSnapshot(0, 0, 0, self._kv_blocks_total, 0, self._block_size)
        self._adds_seen = 0
        self._stopping = False
        self._core_lost = False
        self.on_core_lost: Callable[[], None] | None = None  # e.g. the server turns health NOT_SERVING
        self.on_core_restored: Callable[[], None] | None = None  # e.g. the server turns health SERVING again
        self._spec: CoreProcessSpec | None = None  # set for a child-process core: how to start a new one
        self._counted_before = LoadSnapshot(0, 0, 0)  # cumulative counters of cores that died
        self._dispatch = _Dispatcher()
        self._calls: dict[int, Callable[[Any], None]] = {}  # key -> callback of a pending core call (Encode)
        # What the prefix cache stores, evicts and clears (SubscribeKvEvents, the ZMQ publisher).
        self.kv_events = KvEventLog(kv_event_buffer)

    @classmethod
    def in_process(cls, spec: CoreProcessSpec, *, max_waiting_requests: int = 1024,
                   kv_event_buffer: int = DEFAULT_KV_EVENT_BUFFER) -> "Engine":
        """An engine whose core runs in a child process (loads the model there)."""
        core = ProcessCore(spec)
        engine = cls(core=core, limits=spec.limits, max_waiting_requests=max_waiting_requests,
                     kv_event_buffer=kv_event_buffer)
        engine._spec = spec
        return engine

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._core.start(self._on_batch, self._on_core_lost)

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still live and stop the core."""
        with self._lock:
            self._stopping = True
        self._core.stop(timeout)
        self.kv_events.close()

    # ---------------------------------------------------------------- called from any thread

    def submit(self, admitted: AdmittedRequest, deliver: Deliver, loop: asyncio.AbstractEventLoop | None = None
               ) -> Submission:
        """Enqueue an admitted request; raise a TitoError for a duplicate id or a full queue."""
        arrival_time = time.monotonic()
        request_id = admitted.request_id or f"gen-{uuid.uuid4().hex}"
        with self._lock:
            check_can_accept(request_id, live=self._live, waiting=self._waiting_locked(),
                             max_waiting=self.max_waiting_requests, core_lost=self._core_lost, stopping=self._stopping)
            submission = Submission(request_id, next(self._keys), admitted.options.n, deliver, loop)
            self._live[request_id] = submission
            self._by_key[submission.key] = submission
            self._submitted += 1
        # Sent outside the lock (a full pipe must not block the thread that delivers outputs);
        # the core honours an abort that overtakes its add. Media phase 2 (the encoder cache)
        # runs in the core at the add.
        self._core.send(AddRequest(submission.key, request_id, list(admitted.token_ids), admitted.options,
                                   admitted.features or None, arrival_time, admitted.cache_salt, admitted.lora_name,
                                   admitted.kv_pin, admitted.kv_import))
        return submission

    async def encode(self, checked: CheckedFeatures) -> list[EncoderCacheDescriptor]:
        """The Encode RPC: run the encoder on admitted items, keep the outputs in the encoder
        cache, return one descriptor per item."""
        result = await self._call(lambda key: EncodeItems(key, checked))
        assert isinstance(result, EncodeResult)
        return list(result.descriptors)

    async def export_kv(self, transfer_id: str, first_block: int, block_count: int, num_tokens: int) -> KvExport:
        """PullKvBlocks: the pinned blocks of a prefill request, handed out once (kv_transfer.py)."""
        return await self._call(lambda key: ExportKv(key, transfer_id, first_block, block_count, num_tokens))

    async def cached_prompt_blocks(self, token_ids: list[int], cache_salt: str, lora_name: str = "") -> int:
        """Leading blocks of a text prompt (under `lora_name`, "" = the base model) the prefix cache
        holds now (a decode request pulls the rest)."""
        result = await self._call(lambda key: PeekPrefix(key, list(token_ids), cache_salt, lora_name))
        return result.cached_blocks

    async def reset_prefix_cache(self) -> None:
        """Empty the prefix cache; subscribers of kv_events see AllBlocksCleared before this returns."""
        result = await self._call(ResetPrefixCache)
        assert isinstance(result, PrefixCacheReset)

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        """LoadLoraAdapter: the core reads, checks and holds the adapter (core/lora_registry.py)."""
        result = await self._call(lambda key: LoadLora(key, name, path))
        return result.adapters[0]

    async def unload_lora_adapter(self, name: str) -> int:
        """UnloadLoraAdapter: the requests still using the adapter (they finish with it)."""
        result = await self._call(lambda key: UnloadLora(key, name))
        return result.active_requests

    async def list_lora_adapters(self) -> tuple[LoraAdapterInfo, ...]:
        result = await self._call(ListLoras)
        return result.adapters

    async def _call(self, command: Callable[[int], Any]) -> Any:
        """Send `command(key)` to the core and wait for its answer under that key (raised when an error)."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future = loop.create_future()

        def resolve(result: Any) -> None:
            if not future.done():
                future.set_result(result)

        def answer(result: Any) -> None:  # the receiver thread
            try:
                loop.call_soon_threadsafe(resolve, result)
            except RuntimeError:  # the caller's loop is closed: nobody is waiting any more
                pass

        with self._lock:
            if self._core_lost:
                raise Unavailable(CORE_LOST_MESSAGE, reason="ENGINE_CORE_LOST")
            if self._stopping:
                raise Unavailable("the engine is shutting down; retry on another replica", reason="SHUTTING_DOWN")
            key = next(self._keys)
            self._calls[key] = answer
        self._core.send(command(key))
        try:
            result = await future
        finally:
            with self._lock:
                self._calls.pop(key, None)
        if isinstance(result, BaseException):
            raise result
        return result

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort live requests by id (their streams end with ABORT); unknown ids are ignored."""
        found = []
        with self._lock:
            for request_id in request_ids:
                request = self._live.get(request_id)
                if request is not None:
                    found.append(request)
        for request in found:
            self._core.send(AbortRequest(request.key))
        return [request.request_id for request in found]

    def cancel(self, request: Submission) -> None:
        """Drop one request (its caller went away); frees its slot at the next step."""
        with self._lock:
            live = self._by_key.get(request.key) is request
        if live:
            self._core.send(AbortRequest(request.key))

    def _waiting_locked(self) -> int:
        return self._load.waiting_requests + (self._submitted - self._adds_seen)

    @property
    def healthy(self) -> bool:
        """False once the core process has died (the server should be restarted)."""
        return not self._core_lost

    def load(self) -> LoadSnapshot:
        with self._lock:
            return dataclasses.replace(self._load, waiting_requests=self._waiting_locked())

    # ---------------------------------------------------------------- async facade

    async def generate(self, admitted: AdmittedRequest) -> AsyncIterator[ChoiceOutput]:
        """Submit and yield outputs as produced; closing/cancelling the iterator aborts the request.

        Outputs that arrived together are merged per choice, so a consumer that falls behind
        catches up in fewer, larger messages.
        """
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()
        request = self.submit(admitted, outputs.put_nowait, loop)
        remaining = request.choices
        try:
            while remaining:
                pending = [await outputs.get()]
                while not outputs.empty():
                    pending.append(outputs.get_nowait())
                for item in _merge_per_choice(pending):
                    if isinstance(item, BaseException):
                        remaining = 0
                        raise item
                    if item.finished:
                        remaining -= 1
                    yield item
        finally:
            if remaining:
                self.cancel(request)

    # ---------------------------------------------------------------- from the core

    def _on_batch(self, batch: StepBatch) -> None:
        """One step's outputs (core thread or receiver thread): update the load, then deliver."""
        outputs, core_load = batch.outputs, batch.load
        deliveries = []
        with self._lock:
            # Publish the load before delivering, so a caller who saw its stream end never reads
            # a load that still counts it.
            self._load = _published_load(self._counted_before, core_load, self._kv_blocks_total, self._block_size)
            self._adds_seen = core_load.adds_seen
            ended = []
            calls = []
            for key, output, finished in outputs:
                request = self._by_key.get(key)
                if request is None:
                    call = self._calls.pop(key, None)
                    if call is not None:
                        calls.append((call, output))
                    continue
                if finished:
                    ended.append(request)  # after the loop: its other choices may follow in this batch
                deliveries.append((request, output))
            for request in ended:
                self._by_key.pop(request.key, None)
                if self._live.get(request.request_id) is request:
                    del self._live[request.request_id]
        if batch.kv_events:  # before the outputs: a caller whose stream ended finds its blocks in the log
            self.kv_events.append(batch.kv_events, batch.timestamp)
        for call, output in calls:
            call(output)
        self._dispatch(deliveries)

    def _on_core_lost(self) -> None:
        """The core process died: end every live stream with UNAVAILABLE instead of hanging, and
        start a new core (the service recovers by itself; health is NOT_SERVING meanwhile)."""
        with self._lock:
            stopping = self._stopping
            self._core_lost = not stopping
            lost = list(self._by_key.values())
            self._by_key.clear()
            self._live.clear()
            calls, self._calls = list(self._calls.values()), {}
            self._counted_before = self._load
        if not stopping:
            log.error("the engine core process exited; failing %d live requests and starting a new core", len(lost))
            if self.on_core_lost is not None:
                self.on_core_lost()
            if self._spec is not None:
                threading.Thread(target=self._restart_core, name="tito-engine-restart", daemon=True).start()
        if not stopping:  # the prefix cache died with the core process
            self.kv_events.append([AllBlocksCleared()])
        error = Unavailable(CORE_LOST_MESSAGE, reason="ENGINE_CORE_LOST")
        for call in calls:
            call(error)
        self._dispatch([(request, error) for request in lost])

    def _restart_core(self) -> None:
        """Start a new core process like the lost one (retrying with backoff) and serve with it."""
        self._core.stop(1.0)  # its process is gone: this only closes the pipe
        spec = successor_spec(self._spec, self._counted_before.lora_adapters)
        core = _start_core_with_backoff(spec, lambda: self._stopping)
        if core is None:
            return
        with self._lock:
            if self._stopping:
                core.stop(5.0)
                return
            self._core = core
            self._submitted = self._adds_seen = 0  # the new core counts its "add"s from zero
            self._load = _published_load(self._counted_before, CoreLoad(0, 0, 0, 0, 0), self._kv_blocks_total,
                                         self._block_size)
            self._core_lost = False
        core.start(self._on_batch, self._on_core_lost)
        log.info("a new engine core is serving")
        if self.on_core_restored is not None:
            self.on_core_restored()


def successor_spec(spec: CoreProcessSpec, held: tuple[LoraAdapterInfo, ...]) -> CoreProcessSpec:
    """The spec of the core that replaces a lost one which held the adapters `held` (its last
    load): the --lora-modules it still held load as at start, and the adapters loaded at run time
    are loaded again (so GetLoad and ListLoraAdapters name the same adapters after the restart);
    one unloaded before the loss stays unloaded."""
    names = {adapter.name for adapter in held}
    at_start = tuple((name, path) for name, path in spec.lora_modules if name in names)
    started = {name for name, _ in at_start}
    restore = tuple((adapter.name, adapter.path) for adapter in held if adapter.name not in started)
    return dataclasses.replace(spec, lora_modules=at_start, lora_restore=restore)


def _start_core_with_backoff(spec: CoreProcessSpec, stopping: Callable[[], bool]) -> ProcessCore | None:
    """A new core process, retrying with backoff until one starts; None once `stopping()`."""
    return retry(lambda: ProcessCore(spec), stopping, "a new engine core")


def _published_load(before: LoadSnapshot, core_load: CoreLoad, kv_blocks_total: int, block_size: int) -> LoadSnapshot:
    """The load GetLoad reports: the core's counters, plus the "since start" counters of cores
    that died before it (they survive a restart)."""
    return LoadSnapshot(core_load.running_requests, core_load.waiting_requests,
                        before.finished_requests + core_load.finished_requests, kv_blocks_total,
                        core_load.kv_blocks_used, block_size,
                        before.prefix_cache_hit_tokens + core_load.prefix_cache_hit_tokens,
                        before.encoder_cache_hits + core_load.encoder_cache_hits,
                        before.encoder_cache_misses + core_load.encoder_cache_misses,
                        before.encoded_items + core_load.encoded_items,
                        before.encoder_store_loads + core_load.encoder_store_loads, core_load.lora_adapters)


class _Dispatcher:
    """Hands outputs to their requests: directly, or batched per event loop (one hand-over per
    step per loop, through its _LoopChannel)."""

    def __init__(self):
        self._channels: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> _LoopChannel

    def __call__(self, deliveries) -> None:
        by_loop: dict = {}
        for request, output in deliveries:
            if request.loop is not None:
                by_loop.setdefault(request.loop, []).append((request.deliver, output))
                continue
            try:
                request.deliver(output)
            except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
                log.exception("delivering an output failed", extra={"request_id": request.request_id})
        for loop, items in by_loop.items():
            channel = self._channels.get(loop)
            if channel is None:
                channel = self._channels[loop] = _LoopChannel(loop)
            channel.send(items)


class _LoopChannel:
    """Deliveries to one event loop, with at most one hand-over in flight.

    While the loop is still busy with the previous hand-over, new outputs wait here and go
    together next time; the stream then merges them into one message per choice. So a busy loop
    sees fewer, larger messages instead of falling further behind.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop):
        # A weak reference: the engine keys channels weakly by loop, and a strong one here would
        # keep every loop that ever streamed (and its channel) alive.
        self._loop = weakref.ref(loop)
        self.lock = threading.Lock()
        self.pending: list = []
        self.in_flight = False

    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        return self._loop()

    def send(self, deliveries: list) -> None:  # engine side
        loop = self._loop()
        with self.lock:
            if loop is None or loop.is_closed():  # nobody is listening any more
                self.pending, self.in_flight = [], False
                return
            self.pending.extend(deliveries)
            if self.in_flight:
                return
            batch, self.pending = self.pending, []
            self.in_flight = True
        try:
            loop.call_soon_threadsafe(self._deliver, batch)
        except RuntimeError:  # closed in the meantime
            with self.lock:
                self.pending, self.in_flight = [], False

    def _deliver(self, batch: list) -> None:  # the event loop
        for deliver, output in batch:
            deliver(output)
        # Runs after the streams woken above took their turn.
        asyncio.get_running_loop().call_soon(self._done)

    def _done(self) -> None:  # the event loop
        with self.lock:
            if not self.pending:
                self.in_flight = False
                return
            batch, self.pending = self.pending, []
        self._deliver(batch)


def _merge_per_choice(items: list) -> list:
    """One output per choice from a run of outputs (order of first appearance; stops at an error)."""
    merged: dict[int, ChoiceOutput] = {}
    for item in items:
        if isinstance(item, BaseException):
            return [*merged.values(), item]
        previous = merged.get(item.index)
        merged[item.index] = item if previous is None else previous.merged_with(item)
    return list(merged.values())


__all__ = ["Engine", "LoadSnapshot", "FinishReason", "Usage"]
