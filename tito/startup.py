"""Start-up phases, each logged with its duration, so an operator sees where a slow start went.

    start-up: config took 0.00s
    start-up: bind took 0.01s
    start-up: warm-up took 0.05s        (engine: one prefill and one decode step, before serving)
    start-up: model load took 4.20s     (the engine's includes its warm-up)
    start-up: core start took 0.00s
    start-up: serving 4.23s after start-up began

A phase that fails logs nothing: the error that stops the server says what went wrong
(`loading_model` makes a model that does not load such an error).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from contextlib import contextmanager

from tito.errors import ConfigError

log = logging.getLogger("tito.startup")


class StartupPhases:
    """Times the phases of one server's start-up (the clock starts at construction)."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.durations: dict[str, float] = {}

    @contextmanager
    def phase(self, name: str, detail: str = "") -> Iterator[None]:
        began = time.monotonic()
        yield
        self.durations[name] = took = time.monotonic() - began
        log.info("start-up: %s took %.2fs%s", name, took, f" ({detail})" if detail else "")

    def serving(self) -> None:
        log.info("start-up: serving %.2fs after start-up began", time.monotonic() - self.started)


@contextmanager
def loading_model(model: str) -> Iterator[None]:
    """Turn any failure to load `model` into a ConfigError (one line, exit status 2) that names it;
    the traceback goes to the debug log. ConfigErrors pass unchanged (they already say what to do)."""
    try:
        yield
    except ConfigError:
        raise
    except Exception as exc:  # noqa: BLE001 - whatever the loader raised, the operator needs one line
        log.debug("loading %s failed", model, exc_info=True)
        raise ConfigError(f"--model {model}: cannot be loaded ({type(exc).__name__}: {exc})") from None
