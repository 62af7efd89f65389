"""Stop strings, matched on the detokenized text as it streams (vLLM's semantics).

- The output ends at the first point of the text where any stop string is complete. When
  several complete at the same character the one that starts earliest (the longest) wins, so
  the result never depends on how the engine split the tokens into messages.
- The stop string is cut from the output, or kept when include_stop_str_in_output.
- Text is held back only while it could still be the start of a stop string: after each piece,
  the longest suffix that is a proper prefix of some stop string waits for the next piece.
- Stop strings apply to the whole output text, reasoning included (as vLLM does): they are
  matched before the reasoning and tool-call parsers split the text.

Work per piece is bounded by the stop strings' lengths, never by the output's.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class StopMatch:
    """The text to emit before the choice ends, and the stop string that ended it."""

    text: str
    stop: str


class StopStringMatcher:
    """Per-choice stop-string state: `feed(text)` returns the text now safe to emit, or a
    StopMatch once a stop string is complete (feed nothing after that)."""

    def __init__(self, stops: Sequence[str], include_stop_in_output: bool = False) -> None:
        self._stops = tuple(dict.fromkeys(s for s in stops if s))  # empty strings never match
        self._include = include_stop_in_output
        self._held = ""

    @property
    def held(self) -> str:
        """Text waiting because it could be the start of a stop string (for tests)."""
        return self._held

    def feed(self, text: str) -> str | StopMatch:
        if not self._stops:
            return text
        search = self._held + text
        best: tuple[int, int, str] | None = None  # (end, start, stop)
        for stop in self._stops:
            start = search.find(stop)
            if start >= 0:
                candidate = (start + len(stop), start, stop)
                if best is None or candidate[:2] < best[:2]:
                    best = candidate
        if best is not None:
            end, start, stop = best
            self._held = ""
            return StopMatch(search[:end] if self._include else search[:start], stop)
        keep = self._partial_suffix_length(search)
        self._held = search[len(search) - keep:] if keep else ""
        return search[:len(search) - keep]

    def flush(self) -> str:
        """The choice ended without a stop string: the held text is output after all."""
        held, self._held = self._held, ""
        return held

    def _partial_suffix_length(self, text: str) -> int:
        """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
        longest = 0
        for stop in self._stops:
            for length in range(min(len(stop) - 1, len(text)), longest, -1):
                if text.endswith(stop[:length]):
                    longest = length
                    break
        return longest
