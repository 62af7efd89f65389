"""The LoRA add in the batched forward (model/lora.py), on the tiny Qwen2 with packed linears as
the engine runs it: in one step mixing the base model and two adapters, the base rows' logits are
the same bits as an engine without adapters gives for the same step, and each adapter row's are
those of that row alone under its adapter, whether the step adds the adapters one matmul pair
each, in two batched matmuls over padded groups, in place over a prefill row's own tokens, or in
the C kernel (which adds what the batched matmuls add); a slot cleared adds nothing."""

from __future__ import annotations

import pytest
import torch

from lora_adapters import ADAPTERS, make_adapter
from tito_engine.model import lora
from tito_engine.model.lora_kernel import load_lora_kernel
from tito_engine.model.runner import KVCacheSpec, ModelRunner
from tito_engine.scheduling.plan import RowInput

PROMPTS = ([11, 42, 97, 310, 5, 66, 71], [200, 3, 3, 18, 999], [7, 7, 8, 1000, 12, 13, 14, 15, 16], [64, 128, 256])


def _runner(model_dir, **lora) -> ModelRunner:
    return ModelRunner(model_dir, model_id="tiny", device="cpu", kv_cache=KVCacheSpec(block_size=4, num_blocks=64),
                       **lora)


@pytest.fixture(scope="module")
def runners(tiny_text_model, tmp_path_factory):
    root = tmp_path_factory.mktemp("lora-forward")
    with_lora = _runner(tiny_text_model, max_loras=3, max_lora_rank=16)
    for slot, spec in enumerate(ADAPTERS, 1):
        with_lora.lora.write(slot, with_lora.lora.read(make_adapter(tiny_text_model, spec, root / spec.name)))
    return _runner(tiny_text_model), with_lora


def _step(runner: ModelRunner, slots: list[int]) -> list[torch.Tensor]:
    """A prefill of every prompt, then one decode row each (slot per row): both steps' logits."""
    tables = [list(range(index * 4, index * 4 + 4)) for index in range(len(PROMPTS))]
    prefill = [RowInput(prompt, 0, table, True, None, slot) for prompt, table, slot in zip(PROMPTS, tables, slots)]
    first = runner.execute(prefill)
    decode = [RowInput([int(token)], len(prompt), table, True, None, slot)
              for prompt, table, slot, token in zip(PROMPTS, tables, slots, first.argmax(-1))]
    return [first, runner.execute(decode)]


@pytest.fixture(params=["per adapter", "batched", "in place", "kernel"])
def add_path(request, monkeypatch, runners):
    """Every step takes one path: without the C kernel, PADDING_LIMIT 0 pads nothing (one matmul
    pair per adapter) and a large one batches every mixed step; RUN_MIN_TOKENS 1 adds every row
    over its own run; with the kernel (where it builds), every short row is listed for it."""
    if request.param == "kernel":
        if runners[1].lora.kernel is None:
            pytest.skip("the LoRA kernel does not build here (no C compiler, or no AVX2)")
    else:
        monkeypatch.setattr(runners[1].lora, "kernel", None)
    monkeypatch.setattr(lora, "PADDING_LIMIT", 0 if request.param == "per adapter" else 100)
    monkeypatch.setattr(lora, "RUN_MIN_TOKENS", 1 if request.param == "in place" else 1000)
    return request.param


def test_each_add_path_is_taken_where_it_is_cheapest(runners, monkeypatch):
    slots = runners[1].lora
    monkeypatch.setattr(slots, "kernel", None)
    decode = [RowInput([5], 7, [0, 1], True, None, slot) for slot in (1, 2, 3, 0, 1, 2, 3, 3)]
    slots.begin_step(decode)
    plan = slots.step.batched
    assert (plan.lo, plan.hi, plan.width) == (1, 4, 3) and plan.padding.tolist() == [2, 5]
    assert plan.tokens.tolist() == [0, 4, 0, 1, 5, 1, 2, 6, 7]  # slot 3 has three tokens, slots 1 and 2 pad
    slots.begin_step([RowInput(list(range(40)), 0, list(range(10)), True, None, 1), decode[1], decode[2]])
    step = slots.step
    assert step.runs == [(1, 0, 40)]  # a prefill chunk adds in place over its own tokens
    assert step.batched.tokens.tolist() == [40, 41] and not step.segments  # the decode tokens beside it
    uneven = [RowInput([5], 7, [0, 1], True, None, slot) for slot in (1, 3, 3, 3)]
    slots.begin_step([RowInput(list(range(40)), 0, list(range(10)), True, None, 0), *uneven])
    segments = [(slot, positions.tolist()) for slot, positions in slots.step.segments]
    assert segments == [(1, [40]), (3, [41, 42, 43])]  # groups too uneven to pad: one product pair each
    slots.begin_step([RowInput([5], 7, [0, 1], True, None, 2)] * 3)
    assert slots.step.runs == [(2, 0, 3)] and not slots.step.segments  # one adapter, every token
    slots.end_step()


def test_with_the_kernel_every_adapter_token_is_listed_by_slot(runners):
    slots = runners[1].lora
    if slots.kernel is None:
        pytest.skip("the LoRA kernel does not build here (no C compiler, or no AVX2)")
    decode = [RowInput([5], 7, [0, 1], True, None, slot) for slot in (3, 1, 0, 3, 1)]
    slots.begin_step([*decode, RowInput(list(range(40)), 0, list(range(10)), True, None, 2)])
    positions, listed_slots = slots.step.listed
    assert positions.tolist() == [1, 4, *range(5, 45), 0, 3]  # sorted by slot, each slot's in order
    assert listed_slots.tolist() == [1, 1, *[2] * 40, 3, 3]
    assert not slots.step.runs and slots.step.batched is None and not slots.step.segments
    slots.end_step()


@pytest.mark.parametrize("rank", [16, 32])
def test_the_kernel_adds_what_the_batched_matmuls_add(rank):
    """Random stacks in lora.py's layout (q/k/v under grouped-query attention: 4 chunks), tokens of
    three slots in tiles of every size (1 to 4 of a slot, then a partial tile), x with a row stride
    wider than its row: y changes on the listed rows only, by (x A^T) B of each row's slot."""
    kernel = load_lora_kernel()
    if kernel is None:
        pytest.skip("the LoRA kernel does not build here (no C compiler, or no AVX2)")
    generator = torch.Generator().manual_seed(7)
    slots, in_features, parts, chunk, chunk_parts = 4, 96, 3, 32, [0, 0, 1, 2]
    a = torch.randn(slots, in_features, parts * rank, generator=generator)
    b = torch.randn(slots, len(chunk_parts), rank, chunk, generator=generator)
    wide = torch.randn(12, in_features + 16, generator=generator)
    x, y = wide[:, :in_features], torch.randn(12, len(chunk_parts) * chunk, generator=generator)
    positions = torch.tensor([9, 0, 4, 2, 7, 11, 1, 5])
    token_slots = torch.tensor([1, 2, 2, 2, 2, 2, 3, 3])
    expected = y.clone()
    for position, slot in zip(positions.tolist(), token_slots.tolist()):
        xa = x[position] @ a[slot]
        for index, part in enumerate(chunk_parts):
            expected[position, index * chunk:(index + 1) * chunk] += xa[part * rank:(part + 1) * rank] @ b[slot, index]
    kernel.add(y, x, a, b, torch.tensor(chunk_parts), positions, token_slots)
    torch.testing.assert_close(y, expected, atol=1e-3, rtol=1e-4)
    untouched = [row for row in range(12) if row not in positions.tolist()]
    assert torch.equal(y[untouched], expected[untouched])


def test_base_rows_are_the_same_bits_as_without_adapters(runners, add_path):
    plain, with_lora = runners
    mixed = [0, 1, 0, 3]
    for expected, got in zip(_step(plain, [0] * 4), _step(with_lora, mixed)):
        for row, slot in enumerate(mixed):
            if slot == 0:
                assert torch.equal(got[row], expected[row])
            else:
                assert not torch.allclose(got[row], expected[row], atol=1e-3)  # the adapter is applied


def test_adapter_rows_in_a_mixed_step_equal_their_rows_alone(runners, add_path):
    _, with_lora = runners
    mixed = _step(with_lora, [2, 1, 0, 3])
    for slot in (1, 2, 3):
        alone = _step(with_lora, [slot] * 4)
        for step_mixed, step_alone in zip(mixed, alone):
            row = [2, 1, 0, 3].index(slot)
            torch.testing.assert_close(step_mixed[row], step_alone[row], atol=1e-4, rtol=1e-4)


def test_a_cleared_slot_adds_nothing(tiny_text_model, tmp_path):
    plain = _runner(tiny_text_model)
    runner = _runner(tiny_text_model, max_loras=1, max_lora_rank=16)
    runner.lora.write(1, runner.lora.read(make_adapter(tiny_text_model, ADAPTERS[2], tmp_path / "a")))
    runner.lora.clear(1)
    for expected, got in zip(_step(plain, [0] * 4), _step(runner, [1] * 4)):
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
