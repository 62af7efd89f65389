"""The template watchdog: a run past its deadline is interrupted in its own thread, and nothing else."""

from __future__ import annotations

import threading
import time

import pytest

from tito_render.deadline import TemplateTimeout, TemplateWatchdog


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:  # pure Python, like Jinja's compiled loops
        pass


def test_a_run_past_its_deadline_is_interrupted_promptly():
    watchdog = TemplateWatchdog()
    start = time.monotonic()
    with pytest.raises(TemplateTimeout):
        with watchdog.limit(0.2):
            _spin(10)
    assert time.monotonic() - start < 0.6


def test_a_run_that_ends_in_time_is_never_interrupted_later():
    watchdog = TemplateWatchdog()
    for _ in range(50):
        with watchdog.limit(0.01):
            pass
    _spin(0.1)  # any stray interrupt would land here


def test_expire_ends_only_the_call_it_names():
    watchdog = TemplateWatchdog()
    mine, other = object(), object()
    outcomes: dict[str, str] = {}

    def run(name: str, token: object, seconds: float) -> None:
        with watchdog.owned_by(token):
            try:
                with watchdog.limit(30):
                    _spin(seconds)
                outcomes[name] = "finished"
            except TemplateTimeout:
                outcomes[name] = "stopped"

    threads = [threading.Thread(target=run, args=("mine", mine, 10)),
               threading.Thread(target=run, args=("other", other, 0.5))]
    for thread in threads:
        thread.start()
    time.sleep(0.1)
    watchdog.expire(mine)
    for thread in threads:
        thread.join(5)
    assert outcomes == {"mine": "stopped", "other": "finished"}
