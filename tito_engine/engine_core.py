"""The engine core: the loop that owns the model runner and the scheduler.

It runs either on a thread of the serving process or alone in a child process. The child process
is what the server uses: a forward pass is dozens of small torch calls, each of which hands the GIL
back and forth with the gRPC event loop when both share a process; measured on 2 cores with the tiny
model, that contention halved throughput. In its own process the core keeps a core to itself and
talks to the server through one pipe: commands in, one batch of outputs per step out.

Commands: ("add", key, request_id, prompt_ids, options, mm, arrival_time, cache_salt) | ("abort", key)
| ("encode", key, checked) | ("stop",).
`mm` / `checked` are `features.CheckedFeatures` (phase 1 of media admission, done in the server) or
None. The core owns the encoder cache, so phase 2 happens here at "add": cache hits, EC
descriptors, MM_TENSORS_REQUIRED. A refusal goes back as the request's only output, a
`CoreRefusal` the server turns into the same TitoError (code, reason, field) before the request
was ever scheduled. Admitted media requests are encoded before the next step, all new items of
the requests that arrived together in one encoder call per modality (an item already in the
encoder cache is not encoded again), and their `forward.MultiModalPrefill` is attached to the
request: n > 1 forks and preemption-recompute reuse it, so the encoder never runs twice for them.
"encode" (the Encode RPC) resolves, encodes what is not cached, stores, and answers with one
`EncoderCacheDescriptor` per item.
(arrival_time is time.monotonic() at submission: one clock for both processes on Linux, so queue
time and TTFT in the finish log include the trip to the core.)
Out: (outputs, load) where outputs is [(key, ChoiceOutput | EngineStepError, request_finished)].
Keys are integers the server assigns per submission, so a late abort never hits a reused request id.
"""

from __future__ import annotations

import logging
import queue
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import tito.errors
from tito.errors import FieldViolation, TitoError

from tito_engine.encoder_cache import EncoderCache
from tito_engine.features import CheckedFeatures, ValidatedFeatures, check_encoder_cache_enabled, resolve_cached
from tito_engine.request import Request
from tito_engine.scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """An unexpected error in the engine core, carried to the request's stream (picklable)."""


class CoreRefusal(Exception):
    """A caller's mistake found in the core (cache-dependent admission), as plain picklable data.

    TitoErrors take keyword-only arguments and so do not survive pickling; this carries their
    class name, message, reason, violations and metadata, and `rebuild()` makes the same error.
    """

    def __init__(self, kind: str, message: str, reason: str, violations: tuple, metadata: dict):
        super().__init__(kind, message, reason, violations, metadata)

    @classmethod
    def of(cls, error: TitoError) -> "CoreRefusal":
        return cls(type(error).__name__, error.message, error.reason,
                   tuple((v.field, v.description) for v in error.violations), dict(error.metadata))

    def rebuild(self) -> TitoError:
        kind, message, reason, violations, metadata = self.args
        error_type = getattr(tito.errors, kind, None)
        if not (isinstance(error_type, type) and issubclass(error_type, TitoError)):
            error_type = tito.errors.InvalidArgument
        return error_type(message, reason=reason, violations=[FieldViolation(f, d) for f, d in violations],
                          metadata=metadata)


@dataclass(frozen=True)
class EncodeResult:
    """The Encode RPC's answer: one serialized tito.v1.EncoderCacheDescriptor per item."""

    descriptors: tuple[bytes, ...]


@dataclass(frozen=True)
class CoreLoad:
    running_requests: int
    waiting_requests: int
    finished_requests: int
    kv_blocks_used: int
    adds_seen: int  # "add" commands taken so far: the server counts the rest as waiting
    prefix_cache_hit_tokens: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0


Batch = tuple[list[tuple[int, Any, bool]], CoreLoad]


class EngineCore:
    """Applies commands and runs scheduler steps; `emit` receives each step's batch."""

    def __init__(self, runner: Any, max_running_sequences: int, max_prefill_tokens: int,
                 prefix_caching: bool = True, encoder_cache_bytes: int = 0):
        self.runner = runner
        self.scheduler = Scheduler(runner, max_running_sequences, max_prefill_tokens, prefix_caching)
        self.requests: dict[int, Request] = {}
        self.adds_seen = 0
        self.early_aborts: dict[int, None] = {}  # aborts that overtook their add (insertion-ordered)
        # Encoder outputs by content (features.py decides the keys); None: the engine keeps none.
        self.encoder_cache: EncoderCache | None = None
        if encoder_cache_bytes > 0 and getattr(runner, "mm_spec", None) is not None:
            self.encoder_cache = EncoderCache(max_bytes=encoder_cache_bytes,
                                              store_id=f"engine-{uuid.uuid4().hex[:16]}",
                                              model_fingerprint=runner.info.fingerprint)
        self._to_encode: list[tuple[Request, ValidatedFeatures]] = []  # added, not yet encoded

    def load(self) -> CoreLoad:
        scheduler = self.scheduler
        stats = self.encoder_cache.stats() if self.encoder_cache is not None else None
        return CoreLoad(scheduler.num_running_sequences(), len(scheduler.waiting), scheduler.finished_requests,
                        scheduler.kv_blocks_used(), self.adds_seen, scheduler.prefix_cache_hit_tokens,
                        stats.hits if stats else 0, stats.misses if stats else 0)

    def run(self, receive: Callable[[], Any], receive_ready: Callable[[], list], emit: Callable[[Batch], None]) -> None:
        """Serve until a ("stop",) command; `receive` blocks, `receive_ready` drains without blocking."""
        while True:
            try:
                if self._serve(receive, receive_ready, emit):
                    return
            except Exception as exc:  # noqa: BLE001 - keep serving; fail only what was in flight
                log.exception("engine step failed; failing the requests in flight")
                emit((self._fail_all(exc), self.load()))

    def _serve(self, receive, receive_ready, emit) -> bool:
        scheduler = self.scheduler
        while True:
            # Block when idle; otherwise take whatever arrived and run a step.
            commands = ([receive()] if not scheduler.has_work() else []) + receive_ready()
            outputs: list = []
            for command in commands:
                if command[0] == "stop":
                    outputs.extend(self._abort_all())
                    emit((outputs, self.load()))
                    return True
                self._apply(command, outputs)
            if self._to_encode:
                self._encode_new_media(outputs)
            stepped = scheduler.has_work()
            if stepped:
                for request, output in scheduler.step():
                    outputs.append(self._out(request, output))
            if outputs or commands or stepped:
                emit((outputs, self.load()))

    def _apply(self, command: tuple, outputs: list) -> None:
        kind = command[0]
        if kind == "add":
            _, key, request_id, prompt_ids, options, checked, arrival_time, cache_salt = command
            self.adds_seen += 1
            validated = None
            if checked:
                try:
                    validated = resolve_cached(checked, self.encoder_cache)
                except Exception as error:  # noqa: BLE001 - refused before scheduling; only this request
                    self.early_aborts.pop(key, None)
                    outputs.append((key, _refusal_or_bug(error), True))
                    return
            request = Request(request_id, prompt_ids, options, None)
            request.arrival_time = arrival_time
            request.cache_salt = cache_salt
            request.key = key
            request.has_media = validated is not None
            self.requests[key] = request
            if validated is not None:
                self._to_encode.append((request, validated))
            self.scheduler.add(request)
            if key in self.early_aborts:
                del self.early_aborts[key]
                self._to_encode = [(r, v) for r, v in self._to_encode if r is not request]
                outputs.extend(self._out(request, output) for output in self.scheduler.abort(request))
        elif kind == "encode":
            _, key, checked = command
            try:
                outputs.append((key, self._encode_request(checked), True))
            except Exception as error:  # noqa: BLE001 - fails this Encode call only, never the generations
                outputs.append((key, _refusal_or_bug(error), True))
        elif kind == "abort":
            request = self.requests.get(command[1])
            if request is not None:
                outputs.extend(self._out(request, output) for output in self.scheduler.abort(request))
            else:
                # Either finished already or its add is still behind this abort; remember a bounded few.
                self.early_aborts[command[1]] = None
                if len(self.early_aborts) > 4096:
                    del self.early_aborts[next(iter(self.early_aborts))]

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

    def _fail_waiting(self, request: Request, error: BaseException, outputs: list) -> None:
        request.failed = True  # the scheduler drops failed requests from its queue
        if request in self.scheduler.waiting:
            self.scheduler.waiting.remove(request)
        self.requests.pop(request.key, None)
        outputs.append((request.key, _portable(error), True))

    def _encode_request(self, checked: CheckedFeatures) -> EncodeResult:
        """The Encode RPC in the core: resolve, encode what is missing, store, describe."""
        cache = check_encoder_cache_enabled(self.encoder_cache)
        validated = resolve_cached(checked, cache)
        self._run_encoder([validated])
        return EncodeResult(tuple(cache.descriptor_for(item.cache_key).SerializeToString()
                                  for item in validated.items))

    def _out(self, request: Request, output: Any) -> tuple[int, Any, bool]:
        if isinstance(output, BaseException):
            output = _portable(output)
            request.failed = True
        finished = request.failed or request.finished
        if finished:
            self.requests.pop(request.key, None)
        return request.key, output, finished

    def _abort_all(self) -> list:
        outputs = []
        for request in list(self.requests.values()):
            outputs.extend(self._out(request, output) for output in self.scheduler.abort(request))
            self.requests.pop(request.key, None)
        return outputs

    def _fail_all(self, error: BaseException) -> list:
        """After an unexpected error: end every request with it and free its state."""
        portable = _portable(error)
        outputs = []
        for request in list(self.requests.values()):
            request.failed = True
            self.scheduler.abort(request)  # frees the KV; the caller sees the error, not an ABORT
            outputs.append((request.key, portable, True))
        self.requests.clear()
        return outputs


def _refusal_or_bug(error: Exception) -> Exception:
    """A caller's mistake as a CoreRefusal (same code, reason, field for the caller); anything
    else is a bug in tito, logged here and carried as an EngineStepError (INTERNAL)."""
    if isinstance(error, TitoError):
        return CoreRefusal.of(error)
    log.exception("media admission or encoding failed unexpectedly")
    return _portable(error)


def _portable(error: BaseException) -> EngineStepError:
    if isinstance(error, EngineStepError):
        return error
    return EngineStepError(f"{type(error).__name__}: {error}")


# ------------------------------------------------------------------------------------ hosting

class ThreadCore:
    """Hosts an EngineCore on a thread of this process (tests, or when a child process is unwanted)."""

    def __init__(self, runner: Any, max_running_sequences: int, max_prefill_tokens: int,
                 prefix_caching: bool = True, encoder_cache_bytes: int = 0):
        self.core = EngineCore(runner, max_running_sequences, max_prefill_tokens, prefix_caching,
                               encoder_cache_bytes)
        self.info = runner.info
        self.mm_spec = getattr(runner, "mm_spec", None)
        self.kv_blocks_total = runner.cache.num_blocks
        self.block_size = runner.cache.block_size
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None

    def start(self, on_batch: Callable[[Batch], None]) -> None:
        def drain() -> list:
            items = []
            while True:
                try:
                    items.append(self._inbox.get_nowait())
                except queue.Empty:
                    return items

        self._thread = threading.Thread(target=self.core.run, args=(self._inbox.get, drain, on_batch),
                                        name="tito-engine", daemon=True)
        self._thread.start()

    def send(self, command: tuple) -> None:
        self._inbox.put(command)

    def stop(self, timeout: float) -> None:
        self._inbox.put(("stop",))
        if self._thread is not None:
            self._thread.join(timeout)


@dataclass(frozen=True)
class CoreProcessSpec:
    """Everything the child process needs to build its runner and core (picklable)."""

    model_dir: str
    model_id: str
    device: str
    max_model_len: int | None
    kv_cache: Any  # model_runner.KVCacheSpec
    cpu_threads: int | None
    max_running_sequences: int
    max_prefill_tokens: int
    log_level: str = "info"
    prefix_caching: bool = True
    encoder_cache_bytes: int = 0


def _child_main(spec: CoreProcessSpec, conn: Any) -> None:
    from pathlib import Path

    from tito.logs import setup_logging

    from tito_engine.model_runner import ModelRunner, warm_up_or_warn

    setup_logging(spec.log_level, "engine")
    try:
        runner = ModelRunner(Path(spec.model_dir), model_id=spec.model_id, device=spec.device,
                             max_model_len=spec.max_model_len, kv_cache=spec.kv_cache, cpu_threads=spec.cpu_threads)
    except BaseException as exc:  # noqa: BLE001 - report why the engine could not start
        try:
            conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass  # the server stopped while the model was loading: nobody is left to tell
        _exit_now(1)
    warm_up_or_warn(runner)
    conn.send(("ready", runner.info, runner.cache.num_blocks, runner.cache.block_size, runner.mm_spec))
    core = EngineCore(runner, spec.max_running_sequences, spec.max_prefill_tokens, spec.prefix_caching,
                      spec.encoder_cache_bytes)

    def receive() -> Any:
        try:
            return conn.recv()
        except (EOFError, OSError):  # the server process is gone: stop (aborting what is left)
            return ("stop",)

    def drain() -> list:
        items = []
        try:
            while conn.poll():
                items.append(conn.recv())
        except (EOFError, OSError):
            items.append(("stop",))
        return items

    def emit(batch: Batch) -> None:
        try:
            conn.send(("batch", batch))
        except (BrokenPipeError, OSError):
            raise SystemExit(0) from None  # nobody to serve any more

    core.run(receive, drain, emit)
    try:
        conn.send(("stopped",))
    except (BrokenPipeError, OSError):
        pass
    _exit_now(0)


def _exit_now(code: int) -> None:
    """Leave without the interpreter's teardown: with torch and a model loaded it takes a second
    or more, and this process holds nothing that needs it (the OS frees the memory and the pipe)."""
    import os

    logging.shutdown()
    os._exit(code)


class ProcessCore:
    """Hosts an EngineCore in a child process; one receiver thread here turns its batches into calls."""

    def __init__(self, spec: CoreProcessSpec, start_timeout: float = 300.0):
        import multiprocessing

        context = multiprocessing.get_context("spawn")  # never fork a process that holds gRPC threads
        self._conn, child_conn = context.Pipe()
        self._process = context.Process(target=_child_main, args=(spec, child_conn), name="tito-engine-core",
                                        daemon=True)
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
            message = ("failed", f"the engine core process exited with code {self._process.exitcode}")
        if message[0] != "ready":
            self._process.join(5)
            from tito.config import ConfigError

            raise ConfigError(f"the engine core could not start: {message[1]}")
        _, self.info, self.kv_blocks_total, self.block_size, self.mm_spec = message

    def start(self, on_batch: Callable[[Batch], None], on_lost: Callable[[], None] | None = None) -> None:
        def receive() -> None:
            while True:
                try:
                    message = self._conn.recv()
                except (EOFError, OSError):
                    if on_lost is not None:
                        on_lost()
                    return
                if message[0] == "batch":
                    on_batch(message[1])
                elif message[0] == "stopped":
                    return

        self._receiver = threading.Thread(target=receive, name="tito-engine-receiver", daemon=True)
        self._receiver.start()

    def send(self, command: tuple) -> None:
        with self._send_lock:
            try:
                self._conn.send(command)
            except (OSError, ValueError):
                pass  # the child is gone; the receiver reports it

    def stop(self, timeout: float) -> None:
        self.send(("stop",))
        if self._receiver is not None:
            self._receiver.join(timeout)
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()
