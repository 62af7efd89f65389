"""Linear layers on oneDNN-packed weights (CPU): the same results as F.linear to float32 rounding,
the unpacked path below the work where packing pays, and the forward unchanged in its tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tito_engine.model.linear import PACKED_MIN_MACS, WIDE_MIN_ROWS, Linear, can_pack, pack_linears, wide_linears

pytestmark = pytest.mark.skipif(not can_pack(torch.empty(1)), reason="this torch build has no packed linears")


@pytest.mark.parametrize("bias", [True, False])
def test_packed_linears_agree_with_f_linear_for_every_row_count(bias):
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(512, 256, generator=generator) * 0.05
    offset = torch.randn(512, generator=generator) if bias else None
    linear = Linear(weight, offset)
    assert pack_linears([linear]) == (512 * 256 * 4, 0)  # small: the plain copy stays for few-row calls
    with torch.inference_mode():
        for rows in (1, 2, 7, 8, 32, 300):
            x = torch.randn(rows, 256, generator=generator)
            expected = F.linear(x, weight, offset)
            got = linear(x)
            if rows * 512 * 256 < PACKED_MIN_MACS:
                assert torch.equal(got, expected)  # below the threshold: F.linear itself
            else:
                assert torch.allclose(got, expected, rtol=1e-5, atol=1e-5)


def test_an_unpacked_linear_is_f_linear():
    weight = torch.randn(64, 32)
    x = torch.randn(40, 32)
    assert torch.equal(Linear(weight)(x), F.linear(x, weight))


def test_the_forward_gives_the_same_greedy_tokens_packed_or_not(tiny_text_model_d64):
    from tito_engine.scheduling.plan import RowInput
    from tito_engine.model.runner import ModelRunner

    runners = [ModelRunner(tiny_text_model_d64, model_id="m", device="cpu", packed_linears=packed)
               for packed in (False, True)]
    assert runners[0].decoder.packed_linear_bytes == 0 and runners[1].decoder.packed_linear_bytes > 0
    results = []
    for runner in runners:
        block = runner.cache.block_size
        prompts = [[(7 * i + j) % 900 + 5 for j in range(10 + 9 * i)] for i in range(24)]
        rows = []
        for prompt in prompts:
            table = runner.cache.allocator.allocate(-(-(len(prompt) + 1) // block))
            rows.append(RowInput(token_ids=prompt, start=0, block_table=table, needs_logits=True))
        prefill = runner.decoder.forward(rows)  # 24 prompts in one step: hundreds of rows per linear
        decode = runner.decoder.forward([RowInput(token_ids=[int(t)], start=len(p), block_table=row.block_table,
                                                  needs_logits=True)
                                         for t, p, row in zip(prefill.argmax(-1), prompts, rows)])
        results.append((prefill, decode))
    (prefill_plain, decode_plain), (prefill_packed, decode_packed) = results
    assert torch.allclose(prefill_plain, prefill_packed, rtol=1e-4, atol=1e-4)
    assert torch.allclose(decode_plain, decode_packed, rtol=1e-4, atol=1e-4)
    assert torch.equal(prefill_plain.argmax(-1), prefill_packed.argmax(-1))
    assert torch.equal(decode_plain.argmax(-1), decode_packed.argmax(-1))


def test_inside_wide_linears_only_calls_of_enough_rows_take_the_wider_thread_count(monkeypatch):
    counts: list[int] = []
    real = torch.set_num_threads
    monkeypatch.setattr(torch, "set_num_threads", lambda n: (counts.append(n), real(n)))
    usual = torch.get_num_threads()
    weight = torch.randn(512, 256)
    linear = Linear(weight)
    pack_linears([linear])
    big, small = torch.randn(WIDE_MIN_ROWS, 256), torch.randn(WIDE_MIN_ROWS - 1, 256)
    with torch.inference_mode():
        narrow = linear(big)
        assert counts == []  # outside the block: the usual count, nothing set
        with wide_linears(usual + 2):
            linear(small)
            assert counts == []  # a decode-sized call keeps the usual count
            wide = linear(big)
            assert counts == [usual + 2, usual]  # for the call only, then back
        linear(big)
        assert counts == [usual + 2, usual]  # the block ended
    assert torch.equal(wide, narrow)  # split by rows and columns: the same sums, the same bits
    assert torch.get_num_threads() == usual


def test_the_usual_thread_count_comes_back_after_a_failed_wide_call(monkeypatch):
    usual = torch.get_num_threads()
    linear = Linear(torch.randn(16, 8))
    with wide_linears(usual + 1), pytest.raises(RuntimeError):
        linear(torch.randn(WIDE_MIN_ROWS, 9))  # the wrong width
    assert torch.get_num_threads() == usual


def test_a_runner_widens_the_linears_of_a_lone_row_only():
    from tito_engine.model import linear as linear_module
    from tito_engine.model.runner import ModelRunner
    from tito_engine.scheduling.plan import RowInput

    seen: list[int] = []

    class Decoder:
        def forward(self, rows):
            seen.append(linear_module._wide.threads)
            return torch.zeros(len(rows), 4)

    runner = object.__new__(ModelRunner)  # the forward is stubbed: only the choice is under test
    runner.decoder, runner.lone_prefill_threads = Decoder(), 3
    row = RowInput(token_ids=list(range(100)), start=0, block_table=[0], needs_logits=True)
    decode = RowInput(token_ids=[1], start=100, block_table=[0], needs_logits=True)
    runner.execute([row])
    runner.execute([row, decode])  # another request is running: the server has tokens to stream
    runner.lone_prefill_threads = 0
    runner.execute([row])  # nothing borrowed
    assert seen == [3, 0, 0]
    assert linear_module._wide.threads == 0
