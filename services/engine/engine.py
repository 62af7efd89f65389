"""The engine: a dedicated thread that owns the model and runs scheduler steps.

Callers (the async servicer) submit requests from any thread; commands reach the engine thread
through a thread-safe queue, and outputs go back through each request's `deliver` callback (the
async facade turns that into `loop.call_soon_threadsafe`). The gRPC event loop never runs a
forward pass.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tito.errors import InvalidArgument, ResourceExhausted, Unavailable

from .model_runner import ModelRunner
from .request import ChoiceOutput, GenerateInput, Request
from .scheduler import Scheduler
from .validation import ModelLimits, validate_generate

log = logging.getLogger(__name__)

Deliver = Callable[[ChoiceOutput | BaseException], None]


@dataclass(frozen=True)
class LoadSnapshot:
    running_requests: int
    waiting_requests: int
    finished_requests: int


class Engine:
    def __init__(self, runner: ModelRunner, *, max_running_requests: int = 64,
                 max_waiting_requests: int = 1024, max_choices_per_request: int = 16):
        self.runner = runner
        self.info = runner.info
        self.max_running_requests = max_running_requests
        self.max_waiting_requests = max_waiting_requests
        self.limits = ModelLimits(vocab_size=runner.info.vocab_size,
                                  max_context_length=runner.info.max_context_length,
                                  max_choices=min(max_choices_per_request, max_running_requests),
                                  modalities=frozenset(runner.info.modalities))
        self._scheduler = Scheduler(runner, max_running_requests)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._live: dict[str, Request] = {}  # request id -> request, until its last output
        self._pending = 0  # submitted, not yet counted in a published load snapshot
        self._seen_unpublished = 0  # engine thread only: taken from the inbox since the last publish
        self._load = LoadSnapshot(0, 0, 0)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="tito-engine", daemon=True)

    # ---------------------------------------------------------------- lifecycle

    def start(self) -> None:
        self._thread.start()

    def stop(self, timeout: float = 10.0) -> None:
        """Abort everything still live and join the engine thread."""
        with self._lock:
            self._stopping = True
        self._inbox.put(("stop", None))
        self._thread.join(timeout)

    # ---------------------------------------------------------------- called from any thread

    def submit(self, generate: GenerateInput, deliver: Deliver) -> Request:
        """Validate and enqueue a request; raise a TitoError for a caller mistake or a full queue."""
        options = validate_generate(generate, self.limits)
        request_id = generate.request_id or f"gen-{uuid.uuid4().hex}"
        request = Request(request_id, list(generate.token_ids), options, deliver)
        with self._lock:
            if self._stopping:
                raise Unavailable("the engine is shutting down; retry on another replica", reason="SHUTTING_DOWN")
            if request_id in self._live:
                raise InvalidArgument(f"request_id {request_id!r} is already live; ids must be unique among "
                                      f"running requests", reason="DUPLICATE_REQUEST_ID", field="request_id")
            if self._pending + self._load.waiting_requests >= self.max_waiting_requests:
                raise ResourceExhausted(f"the engine's waiting queue is full ({self.max_waiting_requests} "
                                        f"requests); retry later", reason="QUEUE_FULL")
            self._live[request_id] = request
            self._pending += 1
        self._inbox.put(("add", request))
        return request

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort live requests by id (their streams end with ABORT); unknown ids are ignored."""
        found = []
        with self._lock:
            for request_id in request_ids:
                request = self._live.get(request_id)
                if request is not None:
                    found.append(request_id)
                    self._inbox.put(("abort", request))
        return found

    def cancel(self, request: Request) -> None:
        """Drop one request (its caller went away); frees its slot at the next step."""
        self._inbox.put(("abort", request))

    def load(self) -> LoadSnapshot:
        with self._lock:
            snapshot = self._load
            return LoadSnapshot(snapshot.running_requests, snapshot.waiting_requests + self._pending,
                                snapshot.finished_requests)

    # ---------------------------------------------------------------- async facade

    async def generate(self, generate: GenerateInput) -> AsyncIterator[ChoiceOutput]:
        """Submit and yield outputs as produced; closing/cancelling the iterator aborts the request."""
        loop = asyncio.get_running_loop()
        outputs: asyncio.Queue = asyncio.Queue()

        def deliver(item: ChoiceOutput | BaseException) -> None:
            try:
                loop.call_soon_threadsafe(outputs.put_nowait, item)
            except RuntimeError:
                pass  # the caller's loop is closed: nobody is listening any more

        request = self.submit(generate, deliver)
        remaining = request.options.n
        try:
            while remaining:
                item = await outputs.get()
                if isinstance(item, BaseException):
                    remaining = 0
                    raise item
                if item.finished:
                    remaining -= 1
                yield item
        finally:
            if remaining:
                self.cancel(request)

    # ---------------------------------------------------------------- the engine thread

    def _run(self) -> None:
        while True:
            try:
                if self._run_until_stopped():
                    return
            except Exception as exc:  # noqa: BLE001 - keep serving; fail only what was in flight
                log.exception("engine step failed; failing the requests in flight")
                self._fail_all(exc)

    def _run_until_stopped(self) -> bool:
        scheduler = self._scheduler
        while True:
            # Block when idle; otherwise take whatever arrived and run a step.
            commands = [self._inbox.get()] if not scheduler.has_work() else []
            while True:
                try:
                    commands.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            outputs = []
            for kind, request in commands:
                if kind == "stop":
                    self._publish_load()
                    self._dispatch(outputs)
                    self._abort_all()
                    return True
                if kind == "add":
                    self._seen_unpublished += 1
                    if not request.failed:
                        scheduler.add(request)
                elif kind == "abort":
                    outputs.extend((request, output) for output in scheduler.abort(request))
            if scheduler.has_work():
                outputs.extend(scheduler.step())
            # Publish the load before delivering, so a caller who saw its stream end never reads
            # a load that still counts it.
            self._publish_load()
            self._dispatch(outputs)

    def _dispatch(self, outputs) -> None:
        for request, output in outputs:
            if request.finished or isinstance(output, BaseException):
                with self._lock:
                    if self._live.get(request.request_id) is request:
                        del self._live[request.request_id]
            try:
                request.deliver(output)
            except Exception:  # noqa: BLE001 - a broken consumer must not stop the engine
                log.exception("delivering an output failed", extra={"request_id": request.request_id})

    def _publish_load(self) -> None:
        """Swap in a new load snapshot; requests the scheduler took since move out of pending."""
        scheduler = self._scheduler
        snapshot = LoadSnapshot(scheduler.num_running_sequences(), len(scheduler.waiting),
                                scheduler.finished_requests)
        with self._lock:
            self._pending -= self._seen_unpublished
            self._seen_unpublished = 0
            self._load = snapshot

    def _fail_all(self, error: BaseException) -> None:
        """After an unexpected engine error: end every live request with it and free its state."""
        with self._lock:
            live = list(self._live.values())
        for request in live:
            request.failed = True  # a later "add" from the inbox is then skipped
            self._scheduler.abort(request)  # frees caches; the caller sees the error, not an ABORT
            self._dispatch([(request, error)])
        self._publish_load()

    def _abort_all(self) -> None:
        scheduler = self._scheduler
        for request in list(scheduler.running) + list(scheduler.waiting):
            self._dispatch([(request, output) for output in scheduler.abort(request)])
        while True:
            try:
                kind, request = self._inbox.get_nowait()
            except queue.Empty:
                break
            if kind == "add":
                self._seen_unpublished += 1
                scheduler.add(request)
                self._dispatch([(request, output) for output in scheduler.abort(request)])
        self._publish_load()
