"""Expand the chat template's image and video markers into placeholder spans and find the spans in the ids.

Render does what the Hugging Face processor does (replace each marker in the prompt text with the
item's span text, then tokenize the whole text), so ids equal the processor path even where the
span's surroundings are ordinary text that BPE merges with its neighbours (Gemma3's "\\n\\n").
Then it finds each item's span in the ids, in order, and refuses prompts where placeholder tokens
appear outside the spans render made (typed into the text by a client): such tokens would make an
engine read encoder output for positions no item covers.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

from tito.errors import InvalidArgument

from tito_render.media.processors import ProcessedImage


def check_marker_count(text: str, marker: str, images: int, template_field: str, kind: str = "image") -> None:
    found = text.count(marker)
    if found == images:
        return
    if found > images:
        raise InvalidArgument(
            f"the prompt holds {found} {kind} placeholders {marker!r} for {images} {kind} part(s): do not type "
            f"{marker!r} in message text; send {kind}s as {kind} content parts",
            reason="PLACEHOLDER_IN_TEXT", field="messages")
    raise InvalidArgument(
        f"the chat template rendered {found} {kind} placeholder(s) {marker!r} for {images} {kind} part(s): "
        f"it must render every {kind} part", reason="TEMPLATE_DROPS_IMAGES", field=template_field)


def expand_media_markers(text: str, processed: Mapping[str, Sequence[ProcessedImage]]
                         ) -> tuple[str, list[tuple[str, int]]]:
    """Replace the i-th occurrence of each marker (image, video: distinct strings) with
    processed[marker][i].span_text. Returns the text and the items in prompt order as
    (marker, index) pairs (the order their spans appear in the ids)."""
    markers = [m for m in processed if m]
    pattern = re.compile("|".join(re.escape(m) for m in sorted(markers, key=len, reverse=True)))
    order: list[tuple[str, int]] = []
    used = dict.fromkeys(markers, 0)

    def replace(match: re.Match) -> str:
        marker = match.group(0)
        index = used[marker]
        if index >= len(processed[marker]):
            raise ValueError(f"more {marker!r} markers than items")  # counts are checked before: a bug
        used[marker] = index + 1
        order.append((marker, index))
        return processed[marker][index].span_text

    expanded = pattern.sub(replace, text) if markers else text
    if any(used[m] != len(processed[m]) for m in markers):
        raise ValueError("fewer markers than items")  # counts are checked before: a bug
    return expanded, order


def _find(token_ids: list[int], span: list[int], start: int) -> int:
    first, length = span[0], len(span)
    while True:
        try:
            offset = token_ids.index(first, start)
        except ValueError:
            return -1
        if token_ids[offset:offset + length] == span:
            return offset
        start = offset + 1


def locate_spans(token_ids: list[int], processed: Sequence[ProcessedImage],
                 reserved_token_ids: frozenset[int], field: str = "messages") -> list[int]:
    """Offset of each item's span in `token_ids` (in order). Placeholder tokens outside the spans
    are a caller error (naming `field`, the request field holding the prompt)."""
    offsets: list[int] = []
    cursor = 0
    for index, item in enumerate(processed):
        span = list(item.span_token_ids)
        # The first place from `cursor` holding the whole span (a span may begin with ordinary
        # text, e.g. Qwen3-VL's "<0.5 seconds>", which the message text can hold too).
        offset = _find(token_ids, span, cursor)
        if offset < 0:
            raise InvalidArgument(f"media item {index}'s placeholder span is not intact in the tokenized prompt: "
                                  f"do not type image placeholder tokens in message text",
                                  reason="PLACEHOLDER_IN_TEXT", field="messages")
        offsets.append(offset)
        cursor = offset + len(span)
    if reserved_token_ids:
        inside = sum(1 for item in processed for t in item.span_token_ids if t in reserved_token_ids)
        total = sum(1 for t in token_ids if t in reserved_token_ids)
        if total != inside:
            raise InvalidArgument(
                f"the prompt holds {total - inside} image/video placeholder token(s) outside any image: do not "
                f"type placeholder tokens in the prompt; send media as content parts",
                reason="PLACEHOLDER_IN_TEXT", field=field)
    return offsets
