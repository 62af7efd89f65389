"""The engine core: the loop that owns the model runner and the scheduler.

It runs either on a thread of the serving process or alone in a child process. The child process
is what the server uses: a forward pass is dozens of small torch calls, each of which hands the GIL
back and forth with the gRPC event loop when both share a process; measured on 2 cores with the tiny
model, that contention halved throughput. In its own process the core keeps a core to itself and
talks to the server through one pipe: commands in, one batch of outputs per step out.

Commands and answers are the typed messages of `messages.py` beside this module. Media arrive as
`features.CheckedFeatures` (phase 1 of media admission, done in the server). The core owns the
encoder cache, so phase 2 happens here at AddRequest: cache hits, EC
descriptors, MM_TENSORS_REQUIRED. A refusal goes back as the request's only output: the
TitoError itself (it pickles whole: code, reason, field), before the request was ever scheduled.
Admitted media requests are encoded before the next step, all new items of
the requests that arrived together in one encoder call per modality (an item already in the
encoder cache is not encoded again), and their `forward.MultiModalPrefill` is attached to the
request: n > 1 forks and preemption-recompute reuse it, so the encoder never runs twice for them.
EncodeItems (the Encode RPC) resolves, encodes what is not cached, stores, and answers with one
`EncoderCacheDescriptor` per item: of the shared encoder store (`--encoder-store-dir`,
multimodal/encoder_store.py), written here, when the engine has one; else of its own cache.
Phase 2 reads that store too (descriptors of other engines, trusted hashes the local cache
misses) and keeps what it loads in the encoder cache. Out: one `StepBatch` per step.
A request with a structured-output constraint (options.structured_output, plain strings) is
parked at AddRequest while a worker thread compiles its grammar (constraints.GrammarCompiler,
cached by the constraint's hash), and queued once it has it, so the step loop never compiles; a
constraint that fails to compile is refused like a media request, never scheduled.
"""

from __future__ import annotations

import concurrent.futures
import logging
import os
import queue
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from tito.errors import ConfigError, InvalidArgument, TitoError
from tito.supervision import ChildProcess, spawn_context, stop_children

from tito_engine.model.constraints import GrammarCompiler, compile_error, new_matcher
from tito_engine.core.seams import CoreRunner
from tito_engine.core.lora_registry import LoraRegistry
from tito_engine.core.messages import (AbortRequest, AddRequest, Command, CoreFailed, CoreLoad, CoreReady,
                                       CoreStopped, EncodeItems, EncodeResult, ExportKv, ListLoras, LoadLora,
                                       LoraAdapters, LoraUnloaded, PeekPrefix, PrefixCacheReset, PrefixPeek,
                                       ResetPrefixCache, StepBatch, StopCore, UnloadLora)
from tito_engine.core.kv_export import covers_media, export_pinned, pinned_output
from tito import tensors
from tito.errors import Unavailable

from tito_engine.lora_types import lora_disabled
from tito_engine.multimodal.domain import EncoderCacheDescriptor
from tito_engine.multimodal.encoder_cache import CacheKey, EncoderCache
from tito_engine.multimodal.encoder_store import EntryCorrupt, EntryMissing, SharedEncoderStore
from tito_engine.multimodal.items import EC_STORE_UNAVAILABLE, CheckedFeatures, ValidatedFeatures
from tito_engine.multimodal.resolution import check_encoder_cache_enabled, resolve_cached
from tito_engine.request import ChoiceOutput, Request
from tito_engine.limits import SchedulerLimits
from tito_engine.scheduling.blocks import BlockMedia
from tito_engine.scheduling.scheduler import Scheduler, run_step

if TYPE_CHECKING:
    from tito_engine.model.cpu_runtime import CpuPlan

log = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """An unexpected error in the engine core, carried to the request's stream (picklable)."""


class EngineCore:
    """Applies commands and runs scheduler steps; `emit` receives each step's batch."""

    def __init__(self, runner: CoreRunner, limits: SchedulerLimits, encoder_cache_bytes: int = 0,
                 encoder_store_dir: str = "", encoder_store_bytes: int = 0, lora_dir: str = "",
                 lora_modules: tuple[tuple[str, str], ...] = (), lora_restore: tuple[tuple[str, str], ...] = ()):
        """`lora_dir`: the root LoRA adapters are loaded from, with `lora_modules` (name, path)
        loaded at start (a bad one is a ConfigError) and `lora_restore` (a lost core's run-time
        loads: one that cannot be loaded again is logged and left out); the runner's `lora` slots
        serve them."""
        self.runner = runner
        self.scheduler = Scheduler.for_runner(runner, limits)
        self.scheduler.kv.take_events()  # record the prefix cache's KV events from here on
        self.requests: dict[int, Request] = {}
        self.adds_seen = 0
        self.early_aborts: dict[int, None] = {}  # aborts that overtook their add (insertion-ordered)
        # Encoder outputs by content (features.py decides the keys); None: the engine keeps none.
        self.encoder_cache: EncoderCache | None = None
        if encoder_cache_bytes > 0 and getattr(runner, "mm_spec", None) is not None:
            self.encoder_cache = EncoderCache(max_bytes=encoder_cache_bytes,
                                              store_id=f"engine-{uuid.uuid4().hex[:16]}",
                                              model_fingerprint=runner.info.fingerprint)
        # Encoder outputs shared with other engines through a directory (Encode writes, Generate reads).
        self.encoder_store: SharedEncoderStore | None = None
        if encoder_store_dir and self.encoder_cache is not None:
            try:
                self.encoder_store = SharedEncoderStore(encoder_store_dir, max_bytes=encoder_store_bytes,
                                                        model_fingerprint=runner.info.fingerprint)
            except (OSError, ValueError) as exc:
                raise ConfigError(f"--encoder-store-dir {encoder_store_dir!r} cannot be used: {exc}") from None
        self.encoded_items = 0  # items the encoder ran on
        self.store_loads = 0  # items whose output came from the shared store
        self._to_encode: list[tuple[Request, ValidatedFeatures]] = []  # added, not yet encoded
        self._preemptions_seen = 0  # the scheduler's count when preempted media were last re-queued
        self.grammars = GrammarCompiler(getattr(runner, "model_dir", None), runner.info.vocab_size,
                                        runner.info.eos_token_ids)
        self._compiling: dict[int, tuple[Request, concurrent.futures.Future]] = {}  # key -> parked request
        self.lora = _lora_registry(runner, lora_dir, lora_modules, lora_restore)

    def load(self) -> CoreLoad:
        scheduler = self.scheduler
        stats = self.encoder_cache.stats() if self.encoder_cache is not None else None
        waiting = len(scheduler.waiting) + len(self._compiling)  # parked while their grammar compiles
        return CoreLoad(scheduler.num_running_sequences(), waiting, scheduler.finished_requests,
                        scheduler.kv_blocks_used(), self.adds_seen, scheduler.prefix_cache_hit_tokens,
                        stats.hits if stats else 0, stats.misses if stats else 0, self.encoded_items,
                        self.store_loads, self.lora.infos if self.lora is not None else ())

    def run(self, receive: Callable[[], Any], receive_ready: Callable[[], list],
            emit: Callable[[StepBatch], None]) -> None:
        """Serve until a StopCore command; `receive(timeout=None)` blocks (None when the timeout
        passed first), `receive_ready` drains without blocking."""
        if self.lora is not None and self.lora.infos:
            emit(self._batch([]))  # the load names the --lora-modules adapters before any request
        while True:
            try:
                if self._serve(receive, receive_ready, emit):
                    return
            except Exception as exc:  # noqa: BLE001 - keep serving; fail only what was in flight
                log.exception("engine step failed; failing the requests in flight")
                emit(self._batch(self._fail_all(exc)))

    def _serve(self, receive, receive_ready, emit) -> bool:
        scheduler = self.scheduler
        while True:
            # Block when idle; otherwise take whatever arrived and run a step. While grammars
            # compile with nothing else to do, wait on them a moment instead of on the pipe.
            if self._compiling and not scheduler.has_work():
                concurrent.futures.wait([future for _, future in self._compiling.values()], timeout=0.005,
                                        return_when=concurrent.futures.FIRST_COMPLETED)
                commands = receive_ready()
            elif scheduler.has_work():
                commands = receive_ready()
            else:  # idle: wake for a command, or for the next pinned KV's deadline (kv_pins.py)
                deadline = scheduler.kv.pins.next_deadline()
                first = receive(max(0.0, deadline - time.monotonic()) + 0.001 if deadline is not None else None)
                commands = ([first] if first is not None else []) + receive_ready()
            expired = scheduler.kv.expire_pins(time.monotonic()) if len(scheduler.kv.pins) else 0
            outputs: list = []
            for command in commands:
                if isinstance(command, StopCore):
                    outputs.extend(self._abort_all())
                    emit(self._batch(outputs))
                    return True
                self._apply(command, outputs)
            if self._compiling:
                self._queue_compiled(outputs)
            if self.scheduler.preemptions != self._preemptions_seen:
                self._preemptions_seen = self.scheduler.preemptions
                self._encode_preempted()
            if self._to_encode:
                self._encode_new_media(outputs)
            stepped = scheduler.has_work()
            if stepped:
                for request, output in run_step(scheduler, self.runner):
                    outputs.append(self._out(request, output))
            batch = self._batch(outputs)
            if outputs or commands or stepped or batch.kv_events or expired:
                emit(batch)

    def _batch(self, outputs: list) -> StepBatch:
        """The step's outputs, the load after it and the KV events it caused."""
        events = tuple(self.scheduler.kv.take_events())
        return StepBatch(outputs, self.load(), events, time.time() if events else 0.0)

    def _apply(self, command: Command, outputs: list) -> None:
        match command:
            case AddRequest():
                self._add(command, outputs)
            case EncodeItems(key=key, features=checked):
                try:
                    outputs.append((key, self._encode_request(checked), True))
                except Exception as error:  # noqa: BLE001 - fails this Encode call only, never the generations
                    outputs.append((key, _refusal_or_bug(error), True))
            case ExportKv(key=key):
                try:
                    outputs.append((key, export_pinned(self.scheduler.kv, command, time.monotonic()), True))
                except Exception as error:  # noqa: BLE001 - fails this pull only
                    outputs.append((key, _refusal_or_bug(error), True))
            case PeekPrefix(key=key):
                outputs.append((key, self._peek_prefix(command), True))
            case ResetPrefixCache(key=key):
                self.scheduler.kv.clear_prefix_cache()
                outputs.append((key, PrefixCacheReset(), True))
            case LoadLora() | UnloadLora() | ListLoras():
                try:
                    outputs.append((command.key, self._lora_command(command), True))
                except Exception as error:  # noqa: BLE001 - fails this call only
                    outputs.append((command.key, _refusal_or_bug(error), True))
            case AbortRequest(key=key):
                request = self.requests.get(key)
                if request is not None:
                    outputs.extend(self._abort(request))
                else:
                    # Either finished already or its add is still behind this abort; remember a bounded few.
                    self.early_aborts[key] = None
                    if len(self.early_aborts) > 4096:
                        del self.early_aborts[next(iter(self.early_aborts))]
            case _:
                raise TypeError(f"unknown core command {command!r}")

    def _add(self, command: AddRequest, outputs: list) -> None:
        key = command.key
        self.adds_seen += 1
        validated = None
        if command.features:
            try:
                validated = self._resolve(command.features)
            except Exception as error:  # noqa: BLE001 - refused before scheduling; only this request
                self.early_aborts.pop(key, None)
                outputs.append((key, _refusal_or_bug(error), True))
                return
        request = Request(command.request_id, command.prompt_ids, command.options)
        if command.lora_name:
            try:
                self._take_adapter(request, command.lora_name)
            except Exception as error:  # noqa: BLE001 - refused before scheduling; only this request
                self.early_aborts.pop(key, None)
                outputs.append((key, _refusal_or_bug(error), True))
                return
        request.arrival_time = command.arrival_time
        request.cache_salt = command.cache_salt
        request.key = key
        request.has_media = validated is not None
        request.kv_pin, request.imported_kv = command.kv_pin, command.kv_import
        if validated is not None and all(item.content_id for item in validated.items):
            request.prefix_media = tuple(BlockMedia(item.offset, item.length, item.content_id, item.mm_hash)
                                         for item in validated.items)
        self.requests[key] = request
        if validated is not None:
            self._to_encode.append((request, validated))
        if command.options.structured_output is not None:
            self._compiling[key] = (request, self.grammars.submit(command.options.structured_output))
        else:
            self.scheduler.add(request)
        if key in self.early_aborts:
            del self.early_aborts[key]
            self._to_encode = [(r, v) for r, v in self._to_encode if r is not request]
            outputs.extend(self._abort(request))

    def _peek_prefix(self, command: PeekPrefix) -> PrefixPeek:
        """The prompt keyed as `_add` keys a request: its salt and its adapter."""
        probe = Request("", command.prompt_ids, None)
        probe.cache_salt = command.cache_salt
        if command.lora_name:
            lora_key = self.lora.prefix_key(command.lora_name) if self.lora is not None else None
            if lora_key is None:  # not held here: no block of it can be cached
                return PrefixPeek(0)
            probe.lora_key = lora_key
        return PrefixPeek(self.scheduler.kv.peek_cached_blocks(probe))

    def _abort(self, request: Request) -> list:
        if self._compiling.pop(request.key, None) is not None:
            self.scheduler.add(request)  # so that the scheduler ends its choices with ABORT like any other
        return [self._out(request, output) for output in self.scheduler.abort(request)]

    # ------------------------------------------------------------------ structured outputs

    def _queue_compiled(self, outputs: list) -> None:
        """Queue the parked requests whose grammar is compiled; refuse those whose compile failed."""
        for key, (request, future) in list(self._compiling.items()):
            if not future.done():
                continue
            del self._compiling[key]
            error = future.exception()
            if error is None and request.options.prior_output_tokens:
                error = _prior_output_refused(future.result(), request)
            if error is not None:
                self._forget(request)
                self._to_encode = [(r, v) for r, v in self._to_encode if r is not request]
                outputs.append((key, _refusal_or_bug(compile_error(error, request.options.structured_output)), True))
                continue
            request.grammar = future.result()
            self.scheduler.add(request)

    # ------------------------------------------------------------------ media

    def _run_encoder(self, features: list[ValidatedFeatures]) -> dict[int, Any]:
        """Encode every item of `features` that needs it, in one encoder call per modality; store
        the outputs in the encoder cache. Returns rows by id(item). Items with the same cache key
        are encoded once."""
        unique: dict[Any, Any] = {}
        for validated in features:
            for item in validated.to_encode:
                unique.setdefault(item.cache_key if item.cache_key is not None else id(item), item)
        if not unique:
            return {}
        encoded = self.runner.encode(list(unique.values()))
        self.encoded_items += len(unique)
        rows_by_key: dict[Any, Any] = {}
        for group_key, item, rows in zip(unique, unique.values(), encoded):
            rows = rows.detach().clone()  # one tensor per item: the cache accounts its own bytes
            if self.encoder_cache is not None and item.cache_key is not None:
                self.encoder_cache.put(item.cache_key, rows)
            rows_by_key[group_key] = rows
        return {id(item): rows_by_key[item.cache_key if item.cache_key is not None else id(item)]
                for validated in features for item in validated.to_encode}

    def _encode_new_media(self, outputs: list) -> None:
        """Encode the media of the requests added since the last step and attach their prefill."""
        pending = [(request, validated) for request, validated in self._to_encode
                   if self.requests.get(request.key) is request and not request.failed]
        self._to_encode = []
        pending = [(request, validated) for request, validated in pending if not self._skip_encoder(request, validated)]
        if not pending:
            return
        try:
            rows = self._run_encoder([validated for _, validated in pending])
        except Exception as exc:  # noqa: BLE001 - fail the requests it was encoding for, serve the rest
            encoding = [request for request, validated in pending if validated.to_encode]
            log.exception("the encoder failed; failing the %d requests whose media it was encoding", len(encoding))
            for request in encoding:
                self._fail_waiting(request, exc, outputs)
            pending = [(request, validated) for request, validated in pending if not validated.to_encode]
            rows = {}
        for request, validated in pending:
            try:
                items_with_rows = [(item, item.encoder_rows if item.encoder_rows is not None else rows[id(item)])
                                   for item in validated.items]
                request.mm = self.runner.multimodal_prefill(request.prompt_ids, items_with_rows)
            except Exception as exc:  # noqa: BLE001
                log.exception("building the multimodal prefill failed", extra={"request_id": request.request_id})
                self._fail_waiting(request, exc, outputs)

    def _skip_encoder(self, request: Request, validated: ValidatedFeatures) -> bool:
        """A media prompt whose whole KV was pulled (prefill/decode) needs no encoder rows: only
        its last token is computed here. It gets the items' positions alone; True when so."""
        if not covers_media(request, validated, self.runner.cache):
            return False
        request.mm = self.runner.multimodal_positions(request.prompt_ids, list(validated.items))
        request.media_unencoded = validated
        return True

    def _encode_preempted(self) -> None:
        """Queue the items of preempted prompts that skipped the encoder: they now recompute."""
        for request in self.scheduler.waiting:
            if request.awaiting_media_rows and request.media_unencoded is not None:
                self._to_encode.append((request, request.media_unencoded))
                request.media_unencoded = None

    def _fail_waiting(self, request: Request, error: BaseException, outputs: list) -> None:
        request.failed = True  # the scheduler drops failed requests from its queue
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        self._forget(request)
        outputs.append((request.key, _portable(error), True))

    def _resolve(self, checked: CheckedFeatures) -> ValidatedFeatures:
        validated = resolve_cached(checked, self.encoder_cache, self.encoder_store)
        self.store_loads += sum(1 for item in validated.items if item.from_store)
        return validated

    def _encode_request(self, checked: CheckedFeatures) -> EncodeResult:
        """The Encode RPC in the core: resolve, encode what is missing, store, describe (the
        shared store's descriptor when the engine has one, else this engine's own)."""
        cache = check_encoder_cache_enabled(self.encoder_cache)
        validated = self._resolve(checked)
        self._run_encoder([validated])
        descriptors = []
        for item in validated.items:
            descriptor = self._store_output(item.cache_key) if self.encoder_store is not None else None
            descriptors.append(descriptor if descriptor is not None else cache.descriptor_for(item.cache_key))
        return EncodeResult(tuple(descriptors))

    def _store_output(self, key: CacheKey) -> EncoderCacheDescriptor | None:
        """Write `key`'s cached output to the shared store (kept when there already) and describe
        the entry there; None when it exceeds the store's bound (the local descriptor serves)."""
        store = self.encoder_store
        try:
            try:
                header = store.header(key.text)
            except (EntryMissing, EntryCorrupt):
                entry = self.encoder_cache.peek(key)
                if entry is None:  # larger than the whole encoder cache: not kept anywhere
                    return None
                wire = tensors.from_torch(entry.rows)
                header = store.put(key.text, wire.dtype, tuple(wire.shape), wire.data)
        except OSError as exc:
            log.error("the shared encoder store at %s cannot be written: %s", store.root, exc)
            raise Unavailable(f"the shared encoder store cannot be written ({exc.strerror or exc}); retry on "
                              f"another replica", reason=EC_STORE_UNAVAILABLE) from None
        if header is None:
            return None
        return EncoderCacheDescriptor(
            store_id=store.store_id, uri=store.uri, key=key.text, dtype=header.dtype, shape=tuple(header.shape),
            byte_size=header.byte_size, checksum=header.checksum, model_fingerprint=header.model_fingerprint)

    # ------------------------------------------------------------------ LoRA adapters

    def _lora_command(self, command: LoadLora | UnloadLora | ListLoras) -> LoraAdapters | LoraUnloaded:
        if self.lora is None:
            if isinstance(command, ListLoras):
                return LoraAdapters(())  # an engine without adapters holds none
            raise lora_disabled()
        match command:
            case LoadLora(name=name, path=path):
                return LoraAdapters((self.lora.load(name, path),))
            case UnloadLora(name=name):
                return LoraUnloaded(self.lora.unload(name))
        return LoraAdapters(self.lora.infos)

    def _take_adapter(self, request: Request, name: str) -> None:
        """Hold `name` for `request` (NOT_FOUND, or LORA_SLOTS_BUSY when no slot can take it)."""
        if self.lora is None:
            raise lora_disabled()
        request.lora_slot, request.lora_key = self.lora.acquire(name)
        request.lora_name = name

    def _forget(self, request: Request) -> None:
        """The core is done with `request`: out of the registry, its adapter let go."""
        if self.requests.pop(request.key, None) is not None and request.lora_name:
            self.lora.release(request.lora_name)

    def _out(self, request: Request, output: Any) -> tuple[int, Any, bool]:
        if isinstance(output, BaseException):
            output = _portable(output)
            request.failed = True
        finished = request.failed or request.finished
        if finished:
            self._forget(request)
            if isinstance(output, ChoiceOutput):
                output.timings = request.timings()  # the server derives latencies and spans from them
                if request.pinned is not None:
                    output.kv_pinned = pinned_output(request.pinned, self.runner.cache)
        return request.key, output, finished

    def _abort_all(self) -> list:
        outputs = []
        for request in list(self.requests.values()):
            outputs.extend(self._abort(request))
            self._forget(request)
        return outputs

    def _fail_all(self, error: BaseException) -> list:
        """After an unexpected error: end every request with it and free its state."""
        portable = _portable(error)
        outputs = []
        for request in list(self.requests.values()):
            request.failed = True
            self.scheduler.abort(request)  # frees the KV; the caller sees the error, not an ABORT
            outputs.append((request.key, portable, True))
            self._forget(request)
        self._compiling.clear()
        return outputs


def _lora_registry(runner: CoreRunner, lora_dir: str, modules: tuple[tuple[str, str], ...],
                   restore: tuple[tuple[str, str], ...] = ()) -> LoraRegistry | None:
    """The core's adapters when its runner has slots, with `modules` loaded (ConfigError naming
    --lora-modules for one that cannot be), then `restore`."""
    slots = getattr(runner, "lora", None)
    if slots is None or not lora_dir:
        return None
    registry = LoraRegistry(slots, Path(lora_dir))
    for name, path in modules:
        try:
            registry.load(name, path)
        except TitoError as exc:
            raise ConfigError(f"--lora-modules {name}={path}: {exc.message}") from None
    for name, path in restore:
        try:
            registry.load(name, path)
        except TitoError as exc:  # its files changed or went away since: the engine serves on without it
            log.warning("LoRA adapter %s, loaded from %s before the engine core restarted, cannot be loaded "
                        "again: %s", name, path, exc.message)
    return registry


def _prior_output_refused(grammar: Any, request: Request) -> Exception | None:
    """A migrated choice whose earlier output its grammar does not take: refused before queueing,
    as a grammar that does not compile is."""
    try:
        new_matcher(grammar, request.prior_output_ids)
    except InvalidArgument as error:
        return error
    return None


def _refusal_or_bug(error: Exception) -> Exception:
    """A caller's mistake crosses the pipe as itself (TitoErrors pickle whole: same code, reason,
    field for the caller); anything else is a bug in tito, logged here and carried as an
    EngineStepError (INTERNAL)."""
    if isinstance(error, TitoError):
        return error
    log.exception("media admission or encoding failed unexpectedly")
    return _portable(error)


def _portable(error: BaseException) -> EngineStepError:
    if isinstance(error, EngineStepError):
        return error
    return EngineStepError(f"{type(error).__name__}: {error}")


# ------------------------------------------------------------------------------------ hosting

class ThreadCore:
    """Hosts an EngineCore on a thread of this process (tests, or when a child process is unwanted)."""

    def __init__(self, runner: CoreRunner, limits: SchedulerLimits, encoder_cache_bytes: int = 0,
                 encoder_store_dir: str = "", encoder_store_bytes: int = 0, lora_dir: str = "",
                 lora_modules: tuple[tuple[str, str], ...] = ()):
        self.core = EngineCore(runner, limits, encoder_cache_bytes, encoder_store_dir, encoder_store_bytes, lora_dir,
                               lora_modules)
        slots = getattr(runner, "lora", None) if lora_dir else None
        self.max_loras, self.max_lora_rank = (slots.max_loras, slots.max_rank) if slots is not None else (0, 0)
        self.info = runner.info
        self.mm_spec = getattr(runner, "mm_spec", None)
        self.kv_blocks_total = runner.cache.num_blocks
        self.block_size = runner.cache.block_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, on_batch: Callable[[StepBatch], None], on_lost: Callable[[], None] | None = None) -> None:
        """Run the core on a thread (`on_lost` is never called: the thread lives as long as this process)."""
        def drain() -> list:
            items = []
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    return items

        def receive(timeout: float | None = None) -> Any:
            try:
                return self._inbox.get(timeout=timeout)
            except queue.Empty:
                return None

        self._thread = threading.Thread(target=self.core.run, args=(receive, drain, on_batch),
                                        name="tito-engine", daemon=True)
        self._thread.start()

    def send(self, command: Command) -> None:
        self._inbox.put(command)

    def stop(self, timeout: float) -> None:
        self._inbox.put(StopCore())
        if self._thread is not None:
            self._thread.join(timeout)


@dataclass(frozen=True)
class CoreProcessSpec:
    """Everything a core host needs to load its runner and build its core, made once at start-up
    (tito_engine.startup_plan) and passed down whole; picklable, for the child process."""

    model_dir: str
    model_id: str
    device: str
    max_model_len: int | None
    kv_cache: Any  # model_runner.KVCacheSpec
    limits: SchedulerLimits
    #: Threads and CPUs on CPU (model/cpu_runtime.CpuPlan), the plan the server pinned itself by;
    #: None: not on CPU, or no plan (the runner then chooses its threads from the model's work).
    cpu_plan: CpuPlan | None = None
    log_level: str = "info"
    encoder_cache_bytes: int = 0
    exclude_padding_ids: bool = True
    packed_linears: bool = True
    decode_kernel: bool | None = None  # decode attention in the CPU kernel (model/cpu_attention.py); None: auto
    dtype: str = "auto"
    quantization: str = "none"
    encoder_store_dir: str = ""  # the shared encoder store's directory ("" = none)
    encoder_store_bytes: int = 0
    lora_dir: str = ""  # the root LoRA adapters are read from ("" = the engine serves no adapters)
    lora_modules: tuple[tuple[str, str], ...] = ()  # (name, path under lora_dir) loaded at start
    #: (name, path) loaded at run time into a core that died, loaded again by the one that replaces it
    lora_restore: tuple[tuple[str, str], ...] = ()
    max_loras: int = 0  # adapter slots in the model (0 unless lora_dir)
    max_lora_rank: int = 16

    @property
    def cpus(self) -> frozenset[int] | None:
        """The CPUs the core process runs on (None: not pinned)."""
        return self.cpu_plan.core_cpus if self.cpu_plan is not None else None

    def load_runner(self) -> Any:
        """Load the model this spec names (in whichever process hosts the core)."""
        from pathlib import Path

        from tito_engine.model.runner import ModelRunner

        plan = self.cpu_plan
        return ModelRunner(Path(self.model_dir), model_id=self.model_id, device=self.device,
                           max_model_len=self.max_model_len, kv_cache=self.kv_cache,
                           cpu_threads=plan.threads if plan is not None else None,
                           exclude_padding_ids=self.exclude_padding_ids, packed_linears=self.packed_linears,
                           dtype=self.dtype, decode_kernel=self.decode_kernel,
                           lone_prefill_cpus=plan.lone_prefill_cpus if plan is not None else None,
                           quantization=self.quantization,
                           max_loras=self.max_loras if self.lora_dir else 0, max_lora_rank=self.max_lora_rank)


def _child_main(spec: CoreProcessSpec, conn: Any) -> None:
    # No exit_with_parent here: the kernel's parent-death signal follows the *thread* that started
    # the child, and cores are started from short-lived threads (a restart); the child ends at the
    # pipe's EOF instead (receive below), which comes however the server ends.
    from tito.logs import setup_logging
    from tito.startup import freeze_startup_heap

    from tito_engine.model.runner import warm_up_or_warn

    setup_logging(spec.log_level, "engine")
    _run_on_planned_cpus(spec)
    try:
        runner = spec.load_runner()
    except BaseException as exc:  # noqa: BLE001 - report why the engine could not start
        try:
            conn.send(CoreFailed(str(exc), config_error=True) if isinstance(exc, ConfigError)
                      else CoreFailed(f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass  # the server stopped while the model was loading: nobody is left to tell
        _exit_now(1)
    warm_up_or_warn(runner, spec.limits.max_prefill_tokens)
    try:
        core = EngineCore(runner, spec.limits, spec.encoder_cache_bytes, spec.encoder_store_dir,
                          spec.encoder_store_bytes, spec.lora_dir, spec.lora_modules, spec.lora_restore)
    except ConfigError as exc:  # the shared encoder store's directory, a --lora-modules adapter
        conn.send(CoreFailed(str(exc), config_error=True))
        _exit_now(1)
    freeze_startup_heap()  # the model's objects: never walked by the collector while serving
    conn.send(CoreReady(runner.info, runner.cache.num_blocks, runner.cache.block_size, runner.mm_spec))

    def receive(timeout: float | None = None) -> Any:
        try:
            if timeout is not None and not conn.poll(timeout):
                return None  # a pinned KV's deadline came first
            return conn.recv()
        except (EOFError, OSError):  # the server process is gone: stop (aborting what is left)
            return StopCore()

    def drain() -> list:
        items = []
        try:
            while conn.poll():
                items.append(conn.recv())
        except (EOFError, OSError):
            items.append(StopCore())
        return items

    def emit(batch: StepBatch) -> None:
        try:
            conn.send(batch)
        except (BrokenPipeError, OSError):
            raise SystemExit(0) from None  # nobody to serve any more

    core.run(receive, drain, emit)
    try:
        conn.send(CoreStopped())
    except (BrokenPipeError, OSError):
        pass
    _exit_now(0)


def _run_on_planned_cpus(spec: CoreProcessSpec) -> None:
    """Pin this process to the core's CPUs of the server's plan, if any: before torch starts its
    threads, which inherit them."""
    if spec.cpus is not None:
        from tito.cpu_affinity import format_cpu_list, run_on

        run_on(spec.cpus)
        log.info("engine core process on CPUs %s", format_cpu_list(spec.cpus))


def _set_core_environment(spec: CoreProcessSpec) -> None:
    """Put what the core's plan asks of its environment (cpu_runtime.core_omp_environment) into this
    process's, which a spawned child starts with; kept for the cores that replace it."""
    if spec.cpu_plan is None:
        return
    from tito_engine.model.cpu_runtime import core_omp_environment

    updates = core_omp_environment(spec.cpu_plan, os.environ)
    if updates:
        os.environ.update(updates)
        log.info("engine core process: %s (its threads share CPUs: they sleep between parallel regions)",
                 " ".join(f"{name}={value}" for name, value in updates.items()))


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: with torch and a model loaded it takes a second
    or more, and this process holds nothing that needs it (the OS frees the memory and the pipe)."""
    logging.shutdown()
    os._exit(code)


class ProcessCore:
    """Hosts an EngineCore in a child process; one receiver thread here turns its batches into calls."""

    def __init__(self, spec: CoreProcessSpec, start_timeout: float = 300.0):
        context = spawn_context()  # never fork a process that holds gRPC threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child_main, args=(spec, child_conn),
                                        name="tito-engine-core", daemon=True)
        _set_core_environment(spec)
        self._process.start()
        child_conn.close()
        self._send_lock = threading.Lock()
        self._receiver: threading.Thread | None = None
        if not self._conn.poll(start_timeout):
            self._process.kill()
            raise RuntimeError("the engine core process did not start in time")
        try:
            message = self._conn.recv()
        except EOFError:
            message = CoreFailed(f"the engine core process exited with code {self._process.exitcode}")
        if not isinstance(message, CoreReady):
            self._process.join(5)
            if message.config_error:
                raise ConfigError(message.reason)
            raise ConfigError(f"the engine core could not start: {message.reason}")
        self.info, self.kv_blocks_total = message.info, message.kv_blocks_total
        self.block_size, self.mm_spec = message.block_size, message.mm_spec
        self.max_loras, self.max_lora_rank = (spec.max_loras, spec.max_lora_rank) if spec.lora_dir else (0, 0)

    def start(self, on_batch: Callable[[StepBatch], None], on_lost: Callable[[], None] | None = None) -> None:
        def receive() -> None:
            while True:
                try:
                    message = self._conn.recv()
                except (EOFError, OSError):
                    if on_lost is not None:
                        on_lost()
                    return
                if isinstance(message, StepBatch):
                    on_batch(message)
                elif isinstance(message, CoreStopped):
                    return

        self._receiver = threading.Thread(target=receive, name="tito-engine-receiver", daemon=True)
        self._receiver.start()

    def send(self, command: Command) -> None:
        with self._send_lock:
            try:
                self._conn.send(command)
            except (OSError, ValueError):
                pass  # the child is gone; the receiver reports it

    def stop(self, timeout: float) -> None:
        self.send(StopCore())
        if self._receiver is not None:
            self._receiver.join(timeout)
        # StopCore asked it to stop; what is still running after `timeout` is killed.
        stop_children([ChildProcess("the engine core", self._process)], timeout, ask=lambda _child: None,
                      kill_margin=0)
        self._conn.close()
