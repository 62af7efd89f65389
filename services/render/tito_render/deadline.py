"""Stopping a chat template that runs too long, in the thread that runs it.

A template is a program (the caller may send one): `{% for a in x %}{% for b in x %}{% endfor %}
{% endfor %}` computes nothing and allocates nothing, so no sandbox bound catches it, and a thread
cannot be killed from outside. `TemplateWatchdog` interrupts it instead: each run registers its
thread and deadline, and one watchdog thread raises `TemplateTimeout` inside a run whose deadline
passed (CPython's PyThreadState_SetAsyncExc: the exception arrives at the template's next bytecode,
which for Jinja's compiled Python code is within microseconds). The thread unwinds normally and goes
back to its pool; render answers RESOURCE_EXHAUSTED `TEMPLATE_TIMEOUT`. A call that runs templates
says so with `owned_by(token)`; `expire(token)` then ends its run at once, when its caller went away
(keyed by the call, not the thread: the thread may already serve another call).

An interrupt that was sent but had not arrived when the run ended is withdrawn before the thread
does anything else, so it never fires outside a template.
"""

from __future__ import annotations

import ctypes
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

def _set_async_exc(thread_id: int, exception: type[BaseException] | None) -> None:
    """Raise `exception` in `thread_id` at its next bytecode; None withdraws a pending one (NULL)."""
    ctypes.pythonapi.PyThreadState_SetAsyncExc(
        ctypes.c_ulong(thread_id), ctypes.py_object(exception) if exception is not None else None)


class TemplateTimeout(BaseException):
    """Raised inside a template run past its deadline. A BaseException, so that no `except
    Exception` in template or library code swallows it."""


@dataclass
class _Run:
    thread_id: int
    deadline: float
    owner: object = None  # the call the run belongs to (see owned_by)
    fired: bool = False


class TemplateWatchdog:
    """Deadlines for template runs, one watchdog thread for all of them (started on first use)."""

    def __init__(self) -> None:
        self._lock = threading.Condition()
        self._runs: dict[int, _Run] = {}
        self._thread: threading.Thread | None = None
        self._owner = threading.local()

    @contextmanager
    def owned_by(self, token: object) -> Iterator[None]:
        """Template runs in the body (this thread) belong to `token`, for `expire(token)`."""
        self._owner.token = token
        try:
            yield
        finally:
            self._owner.token = None

    @contextmanager
    def limit(self, seconds: float) -> Iterator[None]:
        """Run the body (in this thread) for at most `seconds`; past that it raises TemplateTimeout."""
        run = _Run(threading.get_ident(), time.monotonic() + seconds, getattr(self._owner, "token", None))
        with self._lock:
            self._runs[run.thread_id] = run
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="render-template-watchdog", daemon=True)
                self._thread.start()
            elif run.deadline < self._next_deadline_locked(exclude=run):
                self._lock.notify()
        try:
            yield
        finally:
            with self._lock:
                self._runs.pop(run.thread_id, None)
                if run.fired:
                    _set_async_exc(run.thread_id, None)  # withdraw it if it has not arrived yet

    def expire(self, token: object) -> None:
        """End the run of the call `token` now (its caller went away); no-op when there is none."""
        with self._lock:
            for run in self._runs.values():
                if run.owner is token:
                    run.deadline = 0.0
                    self._lock.notify()

    def _next_deadline_locked(self, exclude: _Run | None = None) -> float:
        return min((r.deadline for r in self._runs.values() if r is not exclude and not r.fired), default=float("inf"))

    def _watch(self) -> None:
        with self._lock:
            while True:
                now = time.monotonic()
                for run in self._runs.values():
                    if not run.fired and run.deadline <= now:
                        run.fired = True
                        _set_async_exc(run.thread_id, TemplateTimeout)
                wait = self._next_deadline_locked() - now
                self._lock.wait(None if wait == float("inf") else max(wait, 0.0))


WATCHDOG = TemplateWatchdog()
