"""Linear layers on oneDNN-packed weights (CPU): the same results as F.linear to float32 rounding,
the unpacked path below the work where packing pays, and the forward unchanged in its tokens."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tito_engine.model.linear import PACKED_MIN_MACS, Linear, can_pack, pack_linears

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
