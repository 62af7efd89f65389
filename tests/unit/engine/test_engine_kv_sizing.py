"""The KV cache's size from memory (tito_engine/kv_sizing.py): one rule, both backends."""

from __future__ import annotations

import logging

import pytest
import torch

from tito.config import ConfigError
from tito_engine.kv_sizing import (DEFAULT_KV_MEMORY_FRACTION, KV_MEMORY_RESERVE_BYTES, available_host_memory,
                                   kv_budget)
from tito_engine.model.runner import KVCacheSpec, ModelRunner, choose_dtype
from tito_models.real_shape import SHAPES

GIB = 1 << 30


def test_the_budget_is_a_fraction_of_the_free_memory_less_the_reserve():
    budget = kv_budget(9 * GIB, 1024, max_sequences=64, context_length=1 << 20)
    assert budget.bytes == int((9 * GIB - KV_MEMORY_RESERVE_BYTES) * DEFAULT_KV_MEMORY_FRACTION) == 4 * GIB
    assert "0.5 x (9.00 GiB free after loading the model - 1 GiB reserve)" in budget.why
    assert kv_budget(9 * GIB, 1024, max_sequences=64, context_length=1 << 20, fraction=0.25).bytes == 2 * GIB
    assert budget.describe(1024) == f"4.00 GiB = {4 * GIB // 1024:,} tokens of context ({budget.why})"


def test_the_budget_stops_at_what_the_running_sequences_hold_at_once():
    budget = kv_budget(9 * GIB, 1024, max_sequences=64, context_length=2048)
    assert budget.bytes == 64 * 2048 * 1024
    assert "64 running sequences of 2048 tokens" in budget.why


def test_no_room_left_is_refused_with_the_flag_that_sizes_it():
    with pytest.raises(ConfigError, match="--kv-cache-bytes"):
        kv_budget(KV_MEMORY_RESERVE_BYTES, 1024, max_sequences=64, context_length=2048)


def test_available_memory_reads_meminfo_and_a_cgroup_limit(tmp_path):
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24683584 kB\nMemFree:  100 kB\nMemAvailable:   8388608 kB\n")
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    assert available_host_memory(meminfo, cgroup) == 8 * GIB  # no cgroup files: the host's figure
    (cgroup / "memory.max").write_text("max\n")
    (cgroup / "memory.current").write_text(str(GIB))
    assert available_host_memory(meminfo, cgroup) == 8 * GIB
    (cgroup / "memory.max").write_text(str(3 * GIB))
    assert available_host_memory(meminfo, cgroup) == 2 * GIB  # the cgroup leaves less than the host
    meminfo.write_text("MemTotal: 1 kB\n")
    with pytest.raises(ConfigError, match="--kv-cache-bytes"):
        available_host_memory(meminfo, cgroup)


def test_this_machine_gives_the_0_5b_shape_32_contexts_of_2048_tokens():
    shape = SHAPES["qwen2.5-0.5b"]
    head_dim = shape["hidden_size"] // shape["num_attention_heads"]
    # The bf16 checkpoint computes (and caches) in bf16 where this CPU has it, else in float32.
    compute, _ = choose_dtype(torch.device("cpu"), "auto", torch.bfloat16)
    itemsize = torch.empty((), dtype=compute).element_size()
    per_token = 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim * itemsize
    weights = 494_000_000 * itemsize  # what loading the checkpoint takes from the free memory
    budget = kv_budget(available_host_memory() - weights, per_token, max_sequences=64,
                       context_length=shape["max_position_embeddings"])
    assert per_token == 6_144 * itemsize  # 12,288 bytes in bf16, 24,576 in float32
    assert budget.bytes // per_token >= 32 * 2048, budget.describe(per_token)


def test_the_native_runner_sizes_from_memory_and_logs_bytes_and_tokens(tiny_text_model, caplog):
    with caplog.at_level(logging.INFO, logger="tito_engine.model.runner"):
        runner = ModelRunner(tiny_text_model, model_id="tiny-qwen2", device="cpu",
                             kv_cache=KVCacheSpec(max_sequences=8))
    layout = runner.cache.layout
    expected = kv_budget(available_host_memory(), layout.bytes_per_token, max_sequences=8,
                         context_length=runner.info.max_context_length)
    # The tiny model's cap (8 x 2048 tokens) is far below half of any machine's free memory.
    assert runner.cache.capacity_tokens == expected.bytes // layout.bytes_per_token == 8 * 2048
    line = next(record.getMessage() for record in caplog.records if record.getMessage().startswith("KV cache:"))
    assert "16,384 tokens of context" in line and "GiB" in line and "8 running sequences" in line


def test_a_fixed_size_wins(tiny_text_model):
    runner = ModelRunner(tiny_text_model, model_id="tiny-qwen2", device="cpu",
                         kv_cache=KVCacheSpec(cache_bytes=1 << 20))
    assert runner.cache.capacity_tokens * runner.cache.layout.bytes_per_token <= 1 << 20
    assert runner.cache.layout.dtype == torch.float32
