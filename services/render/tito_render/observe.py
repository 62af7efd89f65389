"""Render's metrics: how long renders take by kind, the prompt tokens they make, and the time
spent processing images and videos (tito.metrics; only built with --metrics-port)."""

from __future__ import annotations

import time
from typing import Any

#: What a render call was: RenderChat, RenderCompletion or Tokenize.
KINDS = ("chat", "completion", "tokenize")


class RenderMetrics:
    def __init__(self, metrics: Any) -> None:
        self.render_seconds = metrics.histogram(
            "render_duration_seconds", "Time to render one successful call, by kind (chat, completion, tokenize)",
            ("kind",))
        self.prompt_tokens = metrics.counter(
            "render_prompt_tokens", "Token ids rendered (prompts, or tokenized text), by kind", ("kind",))
        self.media_seconds = metrics.histogram(
            "render_media_processing_seconds",
            "Time to load, hash and process one request's images (or videos), by modality", ("modality",))
        self.media_items = metrics.counter(
            "render_media_items", "Images and videos processed, by modality", ("modality",))
        for kind in KINDS:  # every kind is listed from the first scrape, at 0
            self.render_seconds.labels(kind)
            self.prompt_tokens.labels(kind)

    def rendered(self, kind: str, started: float, tokens: int) -> None:
        """A call of `kind` that began at perf_counter() `started` produced `tokens` token ids."""
        self.render_seconds.labels(kind).observe(time.perf_counter() - started)
        self.prompt_tokens.labels(kind).inc(tokens)

    def media_processed(self, modality: str, items: int, seconds: float) -> None:
        self.media_seconds.labels(modality).observe(seconds)
        self.media_items.labels(modality).inc(items)
