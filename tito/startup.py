"""Start-up phases, each logged with its duration, so an operator sees where a slow start went.

    start-up: config took 0.00s
    start-up: bind took 0.01s
    start-up: warm-up took 0.05s        (engine: one prefill and one decode step, before serving)
    start-up: model load took 4.20s     (the engine's includes its warm-up)
    start-up: core start took 0.00s
    start-up: serving 4.23s after start-up began

A phase that fails logs nothing: the error that stops the server says what went wrong
(`loading_model` makes a model that does not load such an error).

When start-up is done, `freeze_startup_heap` takes what it built out of the garbage collector's
walks.
"""

from __future__ import annotations

import gc
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


def freeze_startup_heap() -> int:
    """Move every object alive now (modules, the tokenizer, the model, the server's own) to the
    garbage collector's permanent generation; the number of objects frozen.

    A served process allocates objects for every message; each time enough of them survive, the
    collector walks the oldest generation, which after start-up holds the hundreds of thousands of
    objects that torch, transformers and grpc bring, and none of which will become garbage. Frozen,
    they are never walked again. vLLM does the same in its API server and engine core
    (vllm/utils/gc_utils.py: freeze_gc_heap). Call once, when start-up is done: what is frozen is
    never collected."""
    gc.collect()  # garbage from start-up goes now instead of staying frozen
    gc.freeze()
    return gc.get_freeze_count()
