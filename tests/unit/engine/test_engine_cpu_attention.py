"""The CPU attention kernels (model/cpu_attention.py): the attention the decode kernel writes
equals softmax(qK)V over each row's own context (GQA, sliding windows, any head size, rows anywhere
in the step), and so does the prefill kernel's for each query of a chunk (causal, windows, chunks
after cached ones, groups larger than a row block); the model's logits equal the torch path's,
the kernels are built once per machine and cached, a missing compiler leaves the torch path, and
loading them leaves the process's float environment alone."""

from __future__ import annotations

import logging
import os
import shutil

import pytest
import torch

from tito_engine.model import cpu_attention
from tito_engine.model import runner as runner_module
from tito_engine.model.cpu_attention import AttentionKernel, DecodeRows, PrefillChunk, load_attention_kernel
from tito_engine.model.runner import KVCacheSpec, ModelRunner
from tito_engine.scheduling.plan import RowInput

from decode_rows import prefilled_decode_rows

pytestmark = pytest.mark.skipif(shutil.which(os.environ.get("CC") or "cc") is None,
                                reason="the decode kernel is built with the machine's C compiler (cc)")


def reference(q, keys, values, tables, lengths, block_size, window):
    """softmax(q K^T * scale) V per row and head over the row's own positions, in float64."""
    heads, dim = q.shape[1], q.shape[2]
    kv_heads = keys.shape[2]
    out = []
    for b, (table, length) in enumerate(zip(tables, lengths)):
        k = keys[table].reshape(-1, kv_heads, dim)[:length].double()
        v = values[table].reshape(-1, kv_heads, dim)[:length].double()
        first = max(0, length - window) if window else 0
        k, v = k[first:].repeat_interleave(heads // kv_heads, 1), v[first:].repeat_interleave(heads // kv_heads, 1)
        scores = torch.einsum("hd,thd->ht", q[b].double(), k) * dim ** -0.5
        out.append(torch.einsum("ht,thd->hd", scores.softmax(-1), v).reshape(-1))
    return torch.stack(out).float()


@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [
    (8, 2, 64, 16),  # grouped query heads, a head size with its own compiled copy
    (4, 4, 48, 16),  # one query head per KV head, the generic copy
    (6, 3, 32, 1),  # blocks of one token
    (2, 1, 128, 5),  # a block size that divides nothing
])
@pytest.mark.parametrize("window", [None, 7])
def test_the_kernel_attends_each_row_over_its_own_context(heads, kv_heads, dim, block_size, window):
    kernel = load_attention_kernel()
    assert kernel is not None
    generator = torch.Generator().manual_seed(heads * dim + block_size)
    num_blocks = 300
    keys = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    values = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    lengths = [1, block_size, block_size + 1, 3 * block_size - 1, 57, 200]
    order = torch.randperm(num_blocks, generator=generator).tolist()  # blocks scattered over the cache
    tables = []
    for length in lengths:
        count = -(-length // block_size)
        tables.append(order[:count])
        order = order[count:]
    # The step's packed queries: q and k of each token side by side (a strided view, as the forward
    # slices them), the decode rows at scattered token indices among other tokens.
    qk = torch.randn(20, heads + kv_heads, dim, generator=generator) * 3  # peaked scores too
    q = qk[:, :heads]
    token_index = [19, 0, 4, 7, 8, 13]
    out = torch.full((20, heads * dim), 123.0)
    kernel(q, out, DecodeRows(token_index, tables, lengths), keys, values, heads, kv_heads, dim, dim ** -0.5,
           window)
    expected = reference(q[token_index], keys, values, tables, lengths, block_size, window)
    torch.testing.assert_close(out[token_index], expected, atol=2e-5, rtol=1e-4)
    others = [i for i in range(20) if i not in token_index]
    assert bool((out[others] == 123.0).all())  # the other tokens' rows are left to the prefill path


def prefill_reference(q, keys, values, table, start, block_size, window):
    """Query i (position start + i) over keys at positions (p - window, p], or [0, p], in float64."""
    count, heads, dim = q.shape
    kv_heads = keys.shape[2]
    k = keys[table].reshape(-1, kv_heads, dim)[:start + count].double().repeat_interleave(heads // kv_heads, 1)
    v = values[table].reshape(-1, kv_heads, dim)[:start + count].double().repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,thd->hqt", q.double(), k) * dim ** -0.5
    query_pos = torch.arange(start, start + count)[:, None]
    key_pos = torch.arange(start + count)[None, :]
    allowed = key_pos <= query_pos
    if window:
        allowed &= key_pos > query_pos - window
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.einsum("hqt,thd->qhd", scores.softmax(-1), v).reshape(count, heads * dim).float()


def prefill_kernel():
    kernel = load_attention_kernel()
    assert kernel is not None
    if not kernel.prefills(64):
        pytest.skip("the prefill kernel needs AVX-512; this CPU runs prefill chunks on the torch path")
    return kernel


@pytest.mark.parametrize("heads, kv_heads, dim, block_size", [
    (4, 2, 64, 16),  # the benchmark model's shape
    (12, 1, 32, 16),  # a group wider than a row block (8 rows): heads split 8 + 4
    (6, 3, 48, 5),  # the generic copy, a block size that divides nothing
    (2, 2, 128, 1),  # blocks of one token
    (8, 2, 256, 16),
])
@pytest.mark.parametrize("start, count, window", [
    (0, 1, None),  # a one-token prompt
    (0, 37, None),  # a first chunk, not a multiple of 16
    (50, 70, None),  # a later chunk over cached blocks
    (0, 90, 20),  # a sliding window inside the chunk
    (45, 40, 17),  # a later chunk whose window starts inside the cached part
])
def test_the_prefill_kernel_attends_each_query_causally(heads, kv_heads, dim, block_size, start, count, window):
    kernel = prefill_kernel()
    generator = torch.Generator().manual_seed(heads * dim + block_size + start)
    num_blocks = 200 if block_size > 1 else 400
    keys = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    values = torch.randn(num_blocks, block_size, kv_heads, dim, generator=generator)
    table = torch.randperm(num_blocks, generator=generator)[:-(-(start + count) // block_size)].tolist()
    # The chunk sits among other tokens of the step, its q a strided view as the forward slices it.
    offset, total = 3, count + 8
    qk = torch.randn(total, heads + kv_heads, dim, generator=generator) * 3  # peaked scores too
    q = qk[:, :heads]
    out = torch.full((total, heads * dim), 123.0)
    kernel.prefill(q, out, PrefillChunk(offset, count, start, table), keys, values, heads, kv_heads, dim,
                   dim ** -0.5, window)
    expected = prefill_reference(q[offset:offset + count], keys, values, table, start, block_size, window)
    torch.testing.assert_close(out[offset:offset + count], expected, atol=2e-5, rtol=1e-4)
    assert bool((out[:offset] == 123.0).all()) and bool((out[offset + count:] == 123.0).all())


def test_the_prefill_kernel_takes_head_sizes_in_steps_of_16():
    kernel = prefill_kernel()
    assert [d for d in (8, 16, 40, 64, 80, 256, 272) if kernel.prefills(d)] == [16, 64, 80, 256]
    q, out = torch.zeros(2, 1, 40), torch.zeros(2, 40)
    cache = torch.zeros(4, 16, 1, 40)
    with pytest.raises(ValueError, match="head size 40"):
        kernel.prefill(q, out, PrefillChunk(0, 2, 0, [0]), cache, cache, 1, 1, 40, 1.0, None)


@pytest.fixture(scope="module")
def runners(tiny_text_model_d64):
    return {kernel: ModelRunner(tiny_text_model_d64, model_id="m", device="cpu", cpu_threads=1, decode_kernel=kernel,
                                kv_cache=KVCacheSpec(block_size=16, num_blocks=256))
            for kernel in (True, False)}


def test_the_model_decodes_as_on_the_torch_path(runners):
    assert runners[True].decoder.attention._kernel is not None
    assert runners[False].decoder.attention._kernel is None
    lengths = [3, 16, 17, 100, 250, 31]
    logits = {}
    for kernel, runner in runners.items():
        rows = prefilled_decode_rows(runner, lengths)
        whole_batch = runner.execute(rows)
        # A mixed step: a prompt's later chunk among the decodes, which the torch path attends.
        prompt = [(3 * j) % 500 + 9 for j in range(40)]
        table = runner.cache.allocator.allocate(3)
        runner.execute([RowInput(prompt[:24], 0, table, False)])
        mixed = runner.execute(rows[:3] + [RowInput(prompt[24:], 24, table, True)] + rows[3:])
        logits[kernel] = whole_batch, mixed
        for row in rows:
            runner.cache.allocator.release(row.block_table)
        runner.cache.allocator.release(table)
    for with_kernel, torch_path in zip(logits[True], logits[False]):
        torch.testing.assert_close(with_kernel, torch_path, atol=1e-4, rtol=0)
        assert torch.equal(with_kernel.argmax(-1), torch_path.argmax(-1))
    torch.testing.assert_close(logits[True][1][[0, 1, 2, 4, 5, 6]], logits[True][0], atol=1e-4, rtol=0)


def test_prefill_chunks_with_bidirectional_spans_stay_on_the_torch_path(runners, monkeypatch):
    """The prefill kernel is causal only: a chunk with a bidirectional span (Gemma3's image soft
    tokens) gets the torch path's mask, the others go to the kernel."""
    attention = runners[True].decoder.attention
    if not attention._kernel.prefills(attention.head_dim):
        pytest.skip("the prefill kernel needs AVX-512")
    rows = [RowInput(list(range(5, 25)), 0, [0, 1], True), RowInput(list(range(5, 15)), 0, [2], True)]
    spans = {id(rows[0]): [(3, 9)]}
    monkeypatch.setattr(attention, "_row_spans", lambda row, end: spans.get(id(row), []))
    plan = attention.plan(rows, [0, 20], [], [0, 1], None)
    assert [(chunk.offset, chunk.count, chunk.start) for chunk in plan.kernel_prefills] == [(20, 10, 0)]
    assert [spec[:2] for spec in plan.prefill_specs] == [(0, 20)]
    assert plan.prefill_specs[0][3][0] is not None  # the span's mask, not plain causal


def test_the_kernel_is_used_where_the_core_runs_one_thread_unless_told(tiny_text_model, monkeypatch):
    def kernel_of(**kwargs) -> bool:
        runner = ModelRunner(tiny_text_model, model_id="m", device="cpu", kv_cache=KVCacheSpec(num_blocks=8), **kwargs)
        return runner.decoder.attention._kernel is not None

    threads = torch.get_num_threads()
    try:
        assert kernel_of(cpu_threads=1) is True
        assert kernel_of(cpu_threads=2) is False  # SDPA spreads over the threads; the kernel does not
        assert kernel_of(cpu_threads=2, decode_kernel=True) is True
        assert kernel_of(cpu_threads=1, decode_kernel=False) is False
        # float32 caches only. The probe is stubbed so every CPU class runs this: an AVX2 CPU has
        # no native bf16, and the engine refuses --dtype bfloat16 there.
        monkeypatch.setattr(runner_module, "cpu_supports", lambda dtype: True)
        assert kernel_of(cpu_threads=1, dtype="bfloat16") is False
    finally:
        torch.set_num_threads(threads)


def test_the_kernel_is_built_once_and_then_loaded_from_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert load_attention_kernel.__wrapped__() is not None
    built = list((tmp_path / "tito" / "kernels").glob("paged_attention_*.so"))
    assert len(built) == 1
    stamp = built[0].stat().st_mtime_ns
    monkeypatch.setattr(cpu_attention, "_build", lambda *args: pytest.fail("rebuilt a cached kernel"))
    assert load_attention_kernel.__wrapped__() is not None
    assert built[0].stat().st_mtime_ns == stamp
    assert not [p for p in (tmp_path / "tito" / "kernels").iterdir() if p not in built]  # no leftovers


def test_cflags_cap_the_kernels_as_an_avx2_machine_builds_them(tmp_path, monkeypatch):
    """`$CFLAGS` comes after -march=native and is part of the cache key, so `-mno-avx512f` builds
    (and keeps apart) what an AVX2 CPU gets: decode only, prefill chunks on the torch path."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CFLAGS", "-mno-avx512f")
    capped = load_attention_kernel.__wrapped__()
    assert capped is not None and not capped.prefills(64)
    monkeypatch.delenv("CFLAGS")
    assert load_attention_kernel.__wrapped__() is not None
    assert len(list((tmp_path / "tito" / "kernels").glob("paged_attention_*.so"))) == 2


def test_without_a_compiler_the_torch_path_runs_and_says_why(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("CC", str(tmp_path / "no-such-cc"))
    with caplog.at_level(logging.WARNING, logger=cpu_attention.__name__):
        assert load_attention_kernel.__wrapped__() is None
    assert "no C compiler" in caplog.text and "--no-cpu-decode-kernel" in caplog.text
    broken = tmp_path / "broken-cc"
    broken.write_text("#!/bin/sh\necho 'cc: error: nothing works' >&2\nexit 1\n")
    broken.chmod(0o755)
    monkeypatch.setenv("CC", str(broken))
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger=cpu_attention.__name__):
        assert load_attention_kernel.__wrapped__() is None
    assert "could not be built" in caplog.text and "nothing works" in caplog.text


def test_loading_the_kernel_keeps_subnormal_floats():
    """The kernel is compiled with -ffast-math but not linked with it: gcc's fast-math link would
    turn on flush-to-zero for the whole process, and every subnormal elsewhere would become 0."""
    assert load_attention_kernel() is not None
    tiny = torch.tensor([1e-40], dtype=torch.float32)
    assert float(tiny * 1.0) != 0.0 and float(tiny / 2) != 0.0


def test_the_kernel_supports_float32_on_cpu_only():
    assert AttentionKernel.supports(torch.float32, torch.device("cpu"))
    assert not AttentionKernel.supports(torch.bfloat16, torch.device("cpu"))
    assert not AttentionKernel.supports(torch.float32, torch.device("cuda", 0))
