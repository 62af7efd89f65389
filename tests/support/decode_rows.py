"""Decode rows over a runner's cache: each prompt prefilled, then one token to decode per row."""

from __future__ import annotations

from tito_engine.scheduling.plan import RowInput


def prefilled_decode_rows(runner, lengths: list[int]) -> list[RowInput]:
    """For each length, a deterministic prompt of that many tokens prefilled into fresh blocks,
    and the row that decodes the next token after it."""
    block = runner.cache.block_size
    rows = []
    for i, length in enumerate(lengths):
        prompt = [(13 * i + 5 * j) % 900 + 5 for j in range(length)]
        table = runner.cache.allocator.allocate(-(-(length + 1) // block))
        runner.execute([RowInput(prompt, 0, table, True)])
        rows.append(RowInput([7 + i], length, table, True))
    return rows
