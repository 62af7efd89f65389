"""Finding markup (e.g. "<think>", "<tool_call>") in text that arrives in pieces."""

from __future__ import annotations


def partial_marker_length(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker`: text that must
    wait for the next piece because it may be the start of the marker."""
    for length in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:length]):
            return length
    return 0


def split_at_marker(text: str, marker: str) -> tuple[str, bool, str]:
    """(before, found, after) for the first `marker` in `text`; when absent, `after` is the part
    of the text that may be the start of the marker (hold it back) and `before` the rest."""
    position = text.find(marker)
    if position >= 0:
        return text[:position], True, text[position + len(marker):]
    keep = partial_marker_length(text, marker)
    return text[:len(text) - keep], False, text[len(text) - keep:]
