"""Waiting on observable state in tests, never on a clock alone."""

from __future__ import annotations

import time
from collections.abc import Callable


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 30.0, poll: float = 0.02) -> None:
    """Return once `predicate()` is true; AssertionError naming `what` after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(poll)
    raise AssertionError(f"never happened within {timeout:g} s: {what}")
