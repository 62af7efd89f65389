"""The engine's start-up warm-up runs one full prefill step and a decode through the real forward
and leaves the KV cache as it found it."""

import pytest
import torch

from tito_engine.model.runner import KVCacheSpec, ModelRunner


@pytest.mark.parametrize("block_size, step_tokens, prefill", [
    (16, 64, 64),  # the scheduler's whole prefill budget
    (1, 64, 7),  # no more than the cache holds (8 blocks of 1 token, one kept for the decode)
])
def test_warm_up_runs_the_forward_and_leaves_the_cache_as_it_was(tiny_text_model, block_size, step_tokens, prefill,
                                                                 monkeypatch):
    runner = ModelRunner(tiny_text_model, model_id="tiny", device="cpu",
                         kv_cache=KVCacheSpec(block_size=block_size, num_blocks=8))
    seen = []
    execute = runner.execute
    monkeypatch.setattr(runner, "execute", lambda rows: seen.append(rows) or execute(rows))
    keys_before = [keys.clone() for keys in runner.cache.keys]
    runner.warm_up(step_tokens)
    assert [[(row.start, len(row.token_ids)) for row in rows] for rows in seen] == [[(0, prefill)], [(prefill, 1)]]
    assert runner.cache.allocator.num_free == 8 and runner.cache.allocator.num_used == 0
    assert all(torch.equal(before, after) for before, after in zip(keys_before, runner.cache.keys))
    assert all(not values.any() for values in runner.cache.values)
