"""tito.supervision: the one lifecycle of every child process (serve all, render workers, engine core)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest

from tito.supervision import Backoff, ChildProcess, Supervisor, retry, spawn_context, stop_children


def _python(code: str, name: str = "child") -> ChildProcess:
    return ChildProcess(name, subprocess.Popen([sys.executable, "-c", code]))


def _wait_exited(child: ChildProcess, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while child.exit_code is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert child.exit_code is not None


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_backoff_doubles_up_to_its_cap_and_resets():
    backoff = Backoff(0.5, 3.0)
    assert [backoff.next_delay() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]
    backoff.reset()
    assert backoff.next_delay() == 0.5
    with pytest.raises(ValueError, match="initial"):
        Backoff(0, 1)


def test_retry_sleeps_by_the_backoff_until_start_succeeds():
    attempts, slept = [], []

    def start():
        attempts.append(1)
        if len(attempts) < 3:
            raise OSError("port busy")
        return "started"

    assert retry(start, lambda: False, "a thing", Backoff(0.5, 30), sleep=slept.append) == "started"
    assert slept == [0.5, 1.0]


def test_retry_gives_up_once_stopping():
    def start():
        raise OSError("never")

    calls = []
    assert retry(start, lambda: len(calls) >= 2, "a thing", sleep=calls.append) is None


def test_a_child_that_dies_while_starting_is_reported_not_restarted():
    supervisor = Supervisor(restart=True)
    supervisor.start("worker", lambda: _python("raise SystemExit(3)"))
    _wait_exited(supervisor.children()[0])
    ended = supervisor.check()
    assert ended is not None and (ended.name, ended.exit_code, ended.was_ready) == ("worker", 3, False)


def test_a_ready_child_that_dies_is_replaced_after_the_backoff():
    clock = FakeClock()
    spawned: list[ChildProcess] = []

    def spawn() -> ChildProcess:
        spawned.append(_python("raise SystemExit(1)" if not spawned else "import time; time.sleep(60)"))
        return spawned[-1]

    supervisor = Supervisor(restart=True, clock=clock)
    first = supervisor.start("worker", spawn)
    supervisor.mark_ready("worker", pid=first.pid)
    _wait_exited(first)
    assert supervisor.check() is None and len(spawned) == 1  # due after 0.5 s, not at once
    clock.now = 0.6
    assert supervisor.check() is None and len(spawned) == 2
    assert not supervisor.all_ready()  # the replacement starts over: ready when it says so
    supervisor.mark_ready("worker", pid=first.pid)  # a late report from the dead child changes nothing
    assert not supervisor.all_ready()
    supervisor.mark_ready("worker", pid=spawned[1].pid)
    assert supervisor.all_ready()
    supervisor.stop(5.0)
    assert spawned[1].exit_code == -signal.SIGTERM


def test_without_restart_any_exit_is_reported_with_its_readiness():
    supervisor = Supervisor(restart=False)
    child = supervisor.start("engine", lambda: _python("raise SystemExit(4)"))
    supervisor.mark_ready("engine")
    _wait_exited(child)
    ended = supervisor.check()
    assert ended is not None and (ended.exit_code, ended.was_ready) == (4, True)


def test_stop_kills_a_child_that_ignores_sigterm_after_the_grace_period():
    stubborn = _python("import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
                       "print('armed', flush=True); time.sleep(60)")
    time.sleep(1.0)  # let it install its handler
    polite = _python("import time; time.sleep(60)")
    started = time.monotonic()
    stop_children([stubborn, polite], grace_seconds=0.5, kill_margin=0)
    assert stubborn.exit_code == -signal.SIGKILL and polite.exit_code == -signal.SIGTERM
    assert time.monotonic() - started < 10


def _sleep_forever() -> None:
    time.sleep(60)


def test_a_spawned_python_function_is_supervised_like_a_command():
    process = spawn_context().Process(target=_sleep_forever, daemon=True)
    process.start()
    child = ChildProcess("function", process)
    assert child.exit_code is None and child.pid == process.pid
    stop_children([child], grace_seconds=5.0)
    assert child.exit_code == -signal.SIGTERM
