"""Padding ids (embedding rows the tokenizer does not name) in the native engine: the model
runner describes them, and one precomputed mask row keeps them out of sampling and logprobs
unless the exclusion is switched off (then there is no mask at all)."""

from __future__ import annotations

import pytest
import torch

from tito_models.tiny import PADDED_VOCAB_ROWS
from tito_engine.model.runner import ModelRunner, padding_mask
from tito_engine.request import SamplingOptions, Sequence
from tito_engine.model.sampler import make_generator, mask_logits, sample_batch
from tito_engine.scheduling.plan import SampleRow

TOKENS = 1013


def test_mask_and_no_mask_without_padding():
    assert padding_mask((), "cpu") is None
    mask = padding_mask((3, 7, 8, 9), "cpu")
    logits = torch.zeros(2, 10)
    masked = mask_logits(logits, mask)
    assert masked[:, [3, 7, 8, 9]].eq(float("-inf")).all()
    assert masked[:, [0, 1, 2, 4, 5, 6]].eq(0).all()
    untouched = torch.zeros(2, 10)
    assert mask_logits(untouched, None) is untouched and untouched.eq(0).all()  # off: no work


@pytest.mark.parametrize("options", [
    SamplingOptions(max_tokens=1, temperature=0.0),
    SamplingOptions(max_tokens=1, temperature=2.0),
    SamplingOptions(max_tokens=1, temperature=2.0, top_k=50, top_p=0.99, logprobs=True, top_logprobs=20),
], ids=["greedy", "hot", "filtered+logprobs"])
def test_masked_rows_never_give_a_padding_id(options):
    vocab, padding = 64, tuple(range(48, 64))
    mask = padding_mask(padding, "cpu")
    logits = torch.randn(32, vocab, generator=torch.Generator().manual_seed(0))
    logits[:, 48:] += 5.0  # the padding rows would win without the mask
    rows = [SampleRow(options, Sequence(0, make_generator(i, 0, "cpu")), [1]) for i in range(32)]
    tokens, logprobs = sample_batch(mask_logits(logits.clone(), mask), rows)
    assert max(tokens) < 48
    for position in logprobs or ():
        assert len(position.top) == 20 and all(alt.token_id < 48 for alt in position.top)
    unmasked, _ = sample_batch(logits, rows)
    assert max(unmasked) >= 48  # the test would see a padding id if the mask did nothing


@pytest.fixture(scope="module", params=[True, False], ids=["excluded", "sampled"])
def runner(request, tiny_padded_model):
    runner = ModelRunner(tiny_padded_model, model_id="tiny-qwen2-padded", device="cpu",
                         exclude_padding_ids=request.param)
    assert (runner.logits_mask is not None) == request.param
    return runner


def test_runner_describes_the_padded_vocabulary(runner):
    info = runner.info
    assert info.vocab_size == PADDED_VOCAB_ROWS and info.tokenizer_vocab_size == TOKENS
    assert info.padding_ids == tuple(range(TOKENS, PADDED_VOCAB_ROWS))
    excluded = runner.logits_mask is not None
    if excluded:
        assert runner.logits_mask.tolist() == list(range(TOKENS, PADDED_VOCAB_ROWS))


def test_no_mask_for_a_model_without_padding(tiny_text_model):
    runner = ModelRunner(tiny_text_model, model_id="tiny-qwen2", device="cpu")
    assert runner.logits_mask is None and runner.info.padding_ids == ()
    assert runner.info.tokenizer_vocab_size == runner.info.vocab_size == TOKENS
