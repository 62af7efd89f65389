"""Tokenizing long text without stalling the server.

The Rust tokenizer holds the GIL for a whole `encode` (measured here: 3.3 M characters took 2.9 s,
during which the event loop ran once), so in the server process a long prompt would freeze health
checks and every other call. Text up to `IN_PROCESS_CHARS` (tens of milliseconds to encode) is
encoded in place; longer text goes to a helper process with its own copy of the same tokenizer,
which gives the same ids, while the render thread waits without holding the GIL. The helper starts
on first use and serves the process's renders one at a time.
"""

from __future__ import annotations

import multiprocessing
import threading
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Any

#: Characters encoded in the server process (~50 ms of the tiny tokenizer's time, at most).
IN_PROCESS_CHARS = 64 * 1024

_TOKENIZER: Any = None


def _load(path: str) -> None:
    global _TOKENIZER
    from transformers import AutoTokenizer

    _TOKENIZER = AutoTokenizer.from_pretrained(path)


def _encode(text: str, add_special_tokens: bool) -> list[int]:
    from tito_render.chat_template import encode_prompt_text

    return encode_prompt_text(_TOKENIZER, text, add_special_tokens)


class LongTextEncoder:
    """`encode(text)`: the tokenizer's ids, long text encoded in a helper process."""

    def __init__(self, tokenizer: Any, path: Path):
        self._tokenizer = tokenizer
        self._path = str(path)
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()

    def encode(self, text: str, add_special_tokens: bool) -> list[int]:
        from tito_render.chat_template import encode_prompt_text

        if len(text) <= IN_PROCESS_CHARS:
            return encode_prompt_text(self._tokenizer, text, add_special_tokens)
        return self._helper().submit(_encode, text, add_special_tokens).result()

    def _helper(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                # spawn: never fork a process that holds gRPC threads.
                self._pool = ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                                                 initializer=_load, initargs=(self._path,))
            return self._pool

    def close(self) -> None:
        """Stop the helper and wait for it to exit (at most the one encode it may be running).

        Not waiting is a hang at exit: multiprocessing's exit handler joins every child, and when
        it closes the pool's call queue before the pool's manager thread has sent the helper its
        stop sentinel, the helper never learns it should exit."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
