"""Decode attention over the paged cache: rows of very different contexts attend in groups of
similar ones, and grouping never changes a row's result."""

from __future__ import annotations

import torch

from tito_engine.model.attention import split_by_context
from tito_engine.model.runner import ModelRunner

from decode_rows import prefilled_decode_rows


def test_decode_rows_of_very_different_contexts_attend_in_groups_of_similar_ones():
    # 30 short rows (2 blocks) and 2 long ones (70 blocks): padding everyone to 70 blocks would gather
    # 2,240 block-rows; two groups gather 60 + 140.
    assert split_by_context([2] * 30 + [70] * 2, call_cost=17) == [list(range(30)), [30, 31]]
    # Three lengths, each group its own; a saving smaller than a call keeps rows together.
    assert split_by_context([1] * 10 + [20] * 10 + [60] * 10, call_cost=17) == [
        list(range(10)), list(range(10, 20)), list(range(20, 30))]
    assert split_by_context([10, 11, 12, 13], call_cost=17) == [[0, 1, 2, 3]]
    assert len(split_by_context(list(range(1, 200, 3)), call_cost=1)) == 4  # at most four calls


def test_grouped_decode_rows_get_the_logits_they_get_alone(tiny_text_model_d64):
    runner = ModelRunner(tiny_text_model_d64, model_id="m", device="cpu", decode_kernel=False)  # the torch path
    rows = prefilled_decode_rows(runner, [3] * 6 + [200] * 3 + [700] * 3)  # three groups of contexts
    plan = runner.decoder.attention._decode_groups(rows, list(range(len(rows))), list(range(len(rows))), True)
    assert sorted(group[2] for group in plan) == [3, 3, 6]  # rows per call
    together = runner.execute(rows)
    alone = torch.cat([runner.execute([row]) for row in rows])
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=0)  # float32 rounding of other paddings
    assert torch.equal(together.argmax(-1), alone.argmax(-1))


def test_rows_of_one_group_keep_their_order(tiny_text_model):
    """Rows out of length order that attend in one call: each row's output stays its own."""
    runner = ModelRunner(tiny_text_model, model_id="m", device="cpu", decode_kernel=False)  # the torch path
    rows = prefilled_decode_rows(runner, [9, 3, 7, 5, 8, 4])
    together = runner.execute(rows)
    alone = torch.cat([runner.execute([row]) for row in rows])
    torch.testing.assert_close(together, alone, atol=1e-4, rtol=0)
