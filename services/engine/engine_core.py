"""The engine core: the loop that owns the model runner and the scheduler.

It runs either on a thread of the serving process or alone in a child process. The child process
is what the server uses: a forward pass is dozens of small torch calls, each of which hands the GIL
back and forth with the gRPC event loop when both share a process; measured on 2 cores with the tiny
model, that contention halved throughput. In its own process the core keeps a core to itself and
talks to the server through one pipe: commands in, one batch of outputs per step out.

Commands: ("add", key, request_id, prompt_ids, options, mm, arrival_time, cache_salt) | ("abort", key)
| ("stop",).
(arrival_time is time.monotonic() at submission: one clock for both processes on Linux, so queue
time and TTFT in the finish log include the trip to the core.)
Out: (outputs, load) where outputs is [(key, ChoiceOutput | EngineStepError, request_finished)].
Keys are integers the server assigns per submission, so a late abort never hits a reused request id.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .request import Request
from .scheduler import Scheduler

log = logging.getLogger(__name__)


class EngineStepError(RuntimeError):
    """An unexpected error in the engine core, carried to the request's stream (picklable)."""


@dataclass(frozen=True)
class CoreLoad:
    running_requests: int
    waiting_requests: int
    finished_requests: int
    kv_blocks_used: int
    adds_seen: int  # "add" commands taken so far: the server counts the rest as waiting
    prefix_cache_hit_tokens: int = 0


Batch = tuple[list[tuple[int, Any, bool]], CoreLoad]


class EngineCore:
    """Applies commands and runs scheduler steps; `emit` receives each step's batch."""

    def __init__(self, runner: Any, max_running_sequences: int, max_prefill_tokens: int,
                 prefix_caching: bool = True):
        self.runner = runner
        self.scheduler = Scheduler(runner, max_running_sequences, max_prefill_tokens, prefix_caching)
        self.requests: dict[int, Request] = {}
        self.adds_seen = 0
        self.early_aborts: dict[int, None] = {}  # aborts that overtook their add (insertion-ordered)

    def load(self) -> CoreLoad:
        scheduler = self.scheduler
        return CoreLoad(scheduler.num_running_sequences(), len(scheduler.waiting), scheduler.finished_requests,
                        scheduler.kv_blocks_used(), self.adds_seen, scheduler.prefix_cache_hit_tokens)

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
            stepped = scheduler.has_work()
            if stepped:
                for request, output in scheduler.step():
                    outputs.append(self._out(request, output))
            if outputs or commands or stepped:
                emit((outputs, self.load()))

    def _apply(self, command: tuple, outputs: list) -> None:
        kind = command[0]
        if kind == "add":
            _, key, request_id, prompt_ids, options, mm, arrival_time, cache_salt = command
            self.adds_seen += 1
            request = Request(request_id, prompt_ids, options, None, mm=mm)
            request.arrival_time = arrival_time
            request.cache_salt = cache_salt
            request.key = key
            self.requests[key] = request
            self.scheduler.add(request)
            if key in self.early_aborts:
                del self.early_aborts[key]
                outputs.extend(self._out(request, output) for output in self.scheduler.abort(request))
        elif kind == "abort":
            request = self.requests.get(command[1])
            if request is not None:
                outputs.extend(self._out(request, output) for output in self.scheduler.abort(request))
            else:
                # Either finished already or its add is still behind this abort; remember a bounded few.
                self.early_aborts[command[1]] = None
                if len(self.early_aborts) > 4096:
                    del self.early_aborts[next(iter(self.early_aborts))]

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


def _portable(error: BaseException) -> EngineStepError:
    if isinstance(error, EngineStepError):
        return error
    return EngineStepError(f"{type(error).__name__}: {error}")


# ------------------------------------------------------------------------------------ hosting

class ThreadCore:
    """Hosts an EngineCore on a thread of this process (tests, or when a child process is unwanted)."""

    def __init__(self, runner: Any, max_running_sequences: int, max_prefill_tokens: int,
                 prefix_caching: bool = True):
        self.core = EngineCore(runner, max_running_sequences, max_prefill_tokens, prefix_caching)
        self.info = runner.info
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


def _child_main(spec: CoreProcessSpec, conn: Any) -> None:
    from pathlib import Path

    from tito.logs import setup_logging

    from .model_runner import ModelRunner

    setup_logging(spec.log_level, "engine")
    try:
        runner = ModelRunner(Path(spec.model_dir), model_id=spec.model_id, device=spec.device,
                             max_model_len=spec.max_model_len, kv_cache=spec.kv_cache, cpu_threads=spec.cpu_threads)
    except BaseException as exc:  # noqa: BLE001 - report why the engine could not start
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", runner.info, runner.cache.num_blocks, runner.cache.block_size))
    core = EngineCore(runner, spec.max_running_sequences, spec.max_prefill_tokens, spec.prefix_caching)

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
        _, self.info, self.kv_blocks_total, self.block_size = message

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
