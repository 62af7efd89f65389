"""How the parser tests stream a model output and read the tool calls back.

A parser must give the same result however the output is cut into messages, so the tests feed it
in many splittings (`chunkings`, `random_pieces`) and compare; `merge` reassembles the streamed
tool-call deltas per call, checking the OpenAI delta shape on the way.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence

from tito_derender.domain import ToolCallDelta


def random_pieces(items: Sequence, rng: random.Random, most: int) -> list:
    """`items` cut into consecutive pieces of 1 to `most` items each, at random."""
    pieces, position = [], 0
    while position < len(items):
        size = rng.randint(1, most)
        pieces.append(items[position:position + size])
        position += size
    return pieces


def chunkings(text: str, seed: int, most: int = 7) -> Iterator[list[str]]:
    """`text` whole, one character at a time, then in four random splittings (pieces of 1 to `most`)."""
    rng = random.Random(seed)
    yield [text]
    yield list(text)
    for _ in range(4):
        yield random_pieces(text, rng, most)


def merge(deltas: list[ToolCallDelta], id_prefix: str = "") -> list[tuple[str, str, str]]:
    """(id, name, concatenated arguments) per call, checking the OpenAI delta shape: a call's first
    delta carries its index, type, id (starting with `id_prefix`) and name only, the rest carry
    argument fragments and nothing else."""
    calls: list[list[str]] = []
    for delta in deltas:
        if delta.name:
            assert delta.index == len(calls) and delta.type == "function" and delta.id, delta
            assert delta.id.startswith(id_prefix), delta
            assert delta.arguments == "", delta  # the first delta carries the name only
            calls.append([delta.id, delta.name, ""])
        else:
            assert not delta.id and not delta.type and delta.index < len(calls), delta
            calls[delta.index][2] += delta.arguments
    return [tuple(call) for call in calls]
