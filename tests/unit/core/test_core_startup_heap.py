"""The start-up heap is frozen out of the garbage collector's walks (tito.startup.freeze_startup_heap)."""

from __future__ import annotations

import subprocess
import sys

# Run in a fresh interpreter: a frozen heap is never collected, which pytest's own process must not get.
PROBE = """
import gc
from tito.startup import freeze_startup_heap

class Node:
    pass

cycle = Node(); cycle.self = cycle; del cycle   # start-up garbage: collected, not frozen
kept = [Node() for _ in range(1000)]            # start-up state: frozen
frozen = freeze_startup_heap()
assert frozen == gc.get_freeze_count(), (frozen, gc.get_freeze_count())
assert frozen > len(kept), frozen
assert not any(type(o) is Node and getattr(o, "self", None) is o for o in gc.get_objects(generation=2))
assert gc.collect() == 0                        # nothing left to walk but what came after
later = Node(); later.self = later; del later
assert gc.collect() == 1                        # garbage made while serving is still collected
print("ok")
"""


def test_start_up_objects_are_frozen_and_later_garbage_is_still_collected():
    done = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "ok"


def test_a_service_freezes_its_heap_once_before_it_waits_for_a_signal(monkeypatch):
    import asyncio
    import os
    import signal

    from tito import serving

    events: list[str] = []
    monkeypatch.setattr(serving, "freeze_startup_heap", lambda: events.append("frozen") or 0)

    class Running:  # what run_until_signal needs of a RunningServer
        grace_seconds = 0.0

        async def stop(self) -> None:
            events.append("stopped")

    async def main() -> None:
        asyncio.get_running_loop().call_later(0.05, os.kill, os.getpid(), signal.SIGTERM)
        await serving.run_until_signal(Running())

    asyncio.run(main())
    assert events == ["frozen", "stopped"]
