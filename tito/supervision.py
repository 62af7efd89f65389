"""Child processes, supervised one way everywhere.

Three places in tito run child processes: `tito serve all` (the three services, each as its own
process), render's worker pool (`--workers N` processes on one port) and the native engine's core
process. They share one lifecycle, written here once:

- **spawn, never fork**: every parent holds gRPC threads, and a forked copy of a threaded process
  can deadlock on a lock another thread held (`spawn_context`);
- **a ready handshake**: a child counts as *ready* once it says so (`Supervisor.mark_ready`); until
  then it is *starting*;
- **restart with backoff** for a child that dies after it was ready (`Backoff`, `retry`), so a
  crash loop costs a bounded rate of restarts instead of a busy loop; a child that dies *while
  starting* is not restarted (a replacement would fail the same way) and is reported instead;
- **graceful stop**: ask (SIGTERM, or the caller's own stop message), wait for the grace period,
  then SIGKILL what is left (`stop_children`);
- **no orphans**: a child started from its parent's main thread may ask the kernel to send it
  SIGTERM when the parent dies, even by SIGKILL (`exit_with_parent`), so nothing keeps a port; one
  that talks to its parent over a pipe ends at the pipe's EOF instead.

Only the standard library is used: the derender and render services import this too.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from multiprocessing.context import SpawnContext
from multiprocessing.process import BaseProcess
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Seconds a stopping child gets beyond its grace period before it is killed.
KILL_MARGIN_SECONDS = 10.0
_POLL_SECONDS = 0.1


def spawn_context() -> SpawnContext:
    """The multiprocessing context every tito child uses: spawned, never forked."""
    return multiprocessing.get_context("spawn")


def exit_with_parent(parent_pid: int) -> None:
    """Linux: get SIGTERM when the parent dies (even by SIGKILL), so no orphan keeps a port.

    Call it first thing in the child. Elsewhere it does nothing: the parent's own stop still ends
    its children. The kernel sends the signal when the parent *thread* that started the child ends,
    so only children started from a thread that lives as long as the parent (its main thread) may
    use it."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


class Backoff:
    """Delays between restarts: `initial` seconds, doubling up to `maximum`; `reset` after a child
    has run long enough to count as healthy again."""

    def __init__(self, initial: float = 0.5, maximum: float = 30.0) -> None:
        if initial <= 0 or maximum < initial:
            raise ValueError(f"Backoff needs 0 < initial <= maximum (got {initial}, {maximum})")
        self.initial, self.maximum = initial, maximum
        self._next = initial

    def next_delay(self) -> float:
        delay = self._next
        self._next = min(self._next * 2, self.maximum)
        return delay

    def reset(self) -> None:
        self._next = self.initial


def retry(start: Callable[[], T], stopping: Callable[[], bool], what: str, backoff: Backoff | None = None,
          sleep: Callable[[float], None] = time.sleep) -> T | None:
    """`start()` until it returns, sleeping by `backoff` after each failure; None once `stopping()`.

    For a child whose start-up can fail for reasons that pass (memory, a port in TIME_WAIT): the
    service keeps trying, logging each failure with the delay before the next try."""
    backoff = backoff or Backoff()
    while not stopping():
        try:
            return start()
        except Exception:  # noqa: BLE001 - keep trying: the caller has nothing better to do
            delay = backoff.next_delay()
            log.exception("starting %s failed; retrying in %.1fs", what, delay)
            sleep(delay)
    return None


@dataclass
class ChildProcess:
    """One child, whether started as a command (`subprocess.Popen`) or as a Python function in a
    spawned interpreter (`multiprocessing` Process): the few things supervision needs of either."""

    name: str
    handle: subprocess.Popen | BaseProcess

    @property
    def pid(self) -> int | None:
        return self.handle.pid

    @property
    def exit_code(self) -> int | None:
        """None while it runs; its exit status (negative: the signal that ended it) once it ended."""
        if isinstance(self.handle, subprocess.Popen):
            return self.handle.poll()
        return self.handle.exitcode

    def send_signal(self, sig: int) -> None:
        if self.exit_code is not None:
            return
        try:
            os.kill(self.handle.pid, sig)
        except ProcessLookupError:
            pass

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)

    def wait(self, timeout: float) -> None:
        if isinstance(self.handle, subprocess.Popen):
            try:
                self.handle.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        else:
            self.handle.join(timeout)


def stop_children(children: Iterable[ChildProcess], grace_seconds: float,
                  ask: Callable[[ChildProcess], None] | None = None,
                  kill_margin: float = KILL_MARGIN_SECONDS) -> None:
    """Ask every running child to stop (SIGTERM unless `ask` says how), wait up to
    `grace_seconds + kill_margin` for all of them, then SIGKILL the rest and reap them."""
    alive = [child for child in children if child.exit_code is None]
    for child in alive:
        (ask or (lambda c: c.send_signal(signal.SIGTERM)))(child)
    deadline = time.monotonic() + grace_seconds + kill_margin
    while any(child.exit_code is None for child in alive) and time.monotonic() < deadline:
        time.sleep(_POLL_SECONDS)
    for child in alive:
        if child.exit_code is None:
            log.warning("%s (pid %s) did not stop in time; killing it", child.name, child.pid)
            child.kill()
        child.wait(5)


@dataclass(frozen=True)
class ChildExit:
    """A child that ended and will not be restarted: who, how, and whether it had become ready."""

    name: str
    exit_code: int
    was_ready: bool


@dataclass
class _Slot:
    spawn: Callable[[], ChildProcess]
    child: ChildProcess
    ready: bool = False
    ready_since: float | None = None
    backoff: Backoff = field(default_factory=Backoff)
    restart_at: float | None = None  # when a dead child's replacement is due


class Supervisor:
    """Children by name, each started by its own `spawn` callable; the caller polls `check()`.

    With `restart=True` a child that dies after it became ready is replaced, after a backoff delay
    (reset once a replacement has stayed ready for `healthy_after` seconds); with `restart=False`, or
    for a child that dies while starting, `check()` returns the exit for the caller to act on (stop
    everything, report a start-up error). Not thread-safe: one caller drives it."""

    def __init__(self, *, restart: bool, healthy_after: float = 60.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.restart = restart
        self.healthy_after = healthy_after
        self._clock = clock
        self._slots: dict[str, _Slot] = {}

    def start(self, name: str, spawn: Callable[[], ChildProcess]) -> ChildProcess:
        child = spawn()
        self._slots[name] = _Slot(spawn, child)
        log.debug("started %s (pid %s)", name, child.pid)
        return child

    def children(self) -> list[ChildProcess]:
        return [slot.child for slot in self._slots.values()]

    def mark_ready(self, name: str, pid: int | None = None) -> None:
        """`name` finished starting (`pid`, when given, must be the current child's: a late report
        from a replaced child is ignored)."""
        slot = self._slots.get(name)
        if slot is None or (pid is not None and slot.child.pid != pid):
            return
        slot.ready, slot.ready_since = True, self._clock()

    def all_ready(self) -> bool:
        return bool(self._slots) and all(slot.ready for slot in self._slots.values())

    def check(self) -> ChildExit | None:
        """Restart what is due; the first child that ended and will not be restarted, or None."""
        now = self._clock()
        for name, slot in self._slots.items():
            if slot.restart_at is not None:
                if now >= slot.restart_at:
                    slot.restart_at = None
                    slot.child = slot.spawn()
                    log.info("started a replacement %s (pid %s)", name, slot.child.pid)
                continue
            code = slot.child.exit_code
            if code is None:
                if slot.ready and slot.ready_since is not None and now - slot.ready_since >= self.healthy_after:
                    slot.backoff.reset()
                continue
            if not (self.restart and slot.ready):
                return ChildExit(name, code, slot.ready)
            delay = slot.backoff.next_delay()
            log.error("%s (pid %s) died with exit code %s; starting a replacement in %.1fs",
                      name, slot.child.pid, code, delay)
            slot.ready, slot.ready_since = False, None
            slot.restart_at = now + delay
        return None

    def stop(self, grace_seconds: float, ask: Callable[[ChildProcess], None] | None = None,
             kill_margin: float = KILL_MARGIN_SECONDS) -> None:
        """Stop every child gracefully (see `stop_children`); no restart is due afterwards."""
        for slot in self._slots.values():
            slot.restart_at = None
        stop_children(self.children(), grace_seconds, ask, kill_margin)
