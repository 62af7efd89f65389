"""Where a prefill chunk may end: never inside a span of the prompt whose tokens attend to each
other in both directions (Gemma3's image soft tokens), since such a span is exact only when one
chunk holds all of it. Torch-free; the spans come from the request's media (`PrefillMedia`)."""

from __future__ import annotations

from typing import Protocol


class PrefillMedia(Protocol):
    """What scheduling needs of a multimodal prompt (`tito_engine.model.forward.MultiModalPrefill`)."""

    bidirectional_spans: list[tuple[int, int]] | None

    def chunk_spans(self) -> list[tuple[int, int]]:
        """Half-open (start, end) prompt ranges a chunk must not split."""


def _known_spans(prefill: PrefillMedia | None) -> list[tuple[int, int]]:
    return [] if prefill is None else prefill.chunk_spans()


def chunk_boundaries_ok(prefill: PrefillMedia | None, start: int, end: int) -> bool:
    """Whether the prefill chunk [start, end) splits no bidirectional span (needed for exactness)."""
    return not any(s < cut < e for s, e in _known_spans(prefill) for cut in (start, end))


def fit_chunk_end(prefill: PrefillMedia | None, start: int, end: int) -> int:
    """The chunk end a scheduler should use instead of `end` (the budget's end) for a chunk at
    `start`: `end` itself when it cuts no span, else the start of the span it would cut; when that
    span begins at (or before) `start`, the span's end: the whole span in one chunk, over budget
    (the caller either accepts the overshoot or defers the row to a later step)."""
    for s, e in _known_spans(prefill):
        if s < end < e:
            return s if s > start else e
    return end
