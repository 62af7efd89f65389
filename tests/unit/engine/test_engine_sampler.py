"""The batched sampler: per-row options inside one call, seeded rows independent of the batch."""

import math

import pytest
import torch

from tito_engine.request import LogitBias, SamplingOptions, Sequence
from tito_engine.model.sampler import make_generator, sample_batch
from tito_engine.scheduling.plan import SampleRow

VOCAB = 200


def logits(rows=1, seed=0):
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed))


def row(options, seed=None, index=0, output_ids=(), prompt_ids=(1, 2), banned=frozenset()):
    seq = Sequence(index, make_generator(seed, index, "cpu") if seed is not None else None)
    seq.output_ids = list(output_ids)
    return SampleRow(options, seq, list(prompt_ids), banned)


def draw(options, seed, steps=20, index=0, neighbours=0):
    target = row(options, seed, index)
    tokens = []
    for step in range(steps):
        rows = [row(SamplingOptions(max_tokens=1, temperature=1.0)) for _ in range(neighbours)] + [target]
        values = logits(1, seed=step).expand(len(rows), -1).contiguous()
        tokens.append(sample_batch(values, rows)[0][-1])
        target.seq.output_ids.append(tokens[-1])  # as the scheduler does: the next draw is the next position
    return tokens


def test_greedy_is_argmax_and_bans_apply():
    values = logits(2)
    options = SamplingOptions(max_tokens=1, temperature=0.0)
    best = values.argmax(-1).tolist()
    assert sample_batch(values, [row(options), row(options)])[0] == best
    tokens, _ = sample_batch(values, [row(options, banned=frozenset({best[0]})), row(options)])
    assert tokens[0] != best[0] and tokens[1] == best[1]


def test_same_seed_same_tokens_whatever_shares_the_batch():
    options = SamplingOptions(max_tokens=1, temperature=1.0)
    alone = draw(options, 42)
    assert draw(options, 42, neighbours=5) == alone
    assert draw(options, 43) != alone
    assert draw(options, 42, index=1) != alone


def test_sampling_follows_the_distribution():
    values = torch.tensor([[0.0, math.log(3.0)] + [-1e9] * (VOCAB - 2)])
    options = SamplingOptions(max_tokens=1, temperature=1.0)
    rows = [row(options, seed=7)]
    ones = 0
    for _ in range(2000):  # one seeded choice drawing 2,000 positions
        token = sample_batch(values, rows)[0][0]
        rows[0].seq.output_ids.append(token)
        ones += token
    assert 0.70 < ones / 2000 < 0.80  # p(token 1) = 0.75


def test_a_continued_choice_draws_what_the_uninterrupted_one_would_have():
    """Request migration: another engine continues a seeded choice from its 5th token (the first
    5 at the end of its prompt, prior_output_tokens=5) and draws the same tokens as the choice that
    was never interrupted, because each draw derives from (seed, position), not from the draws before."""
    options = SamplingOptions(max_tokens=12, temperature=1.0, top_k=50)
    whole = draw(options, 42, steps=12)
    continued_options = SamplingOptions(max_tokens=7, temperature=1.0, top_k=50, prior_output_tokens=5)
    continued = row(continued_options, seed=42, prompt_ids=(1, 2, *whole[:5]))
    tokens = []
    for step in range(5, 12):
        tokens.append(sample_batch(logits(1, seed=step), [continued])[0][0])
        continued.seq.output_ids.append(tokens[-1])
    assert tokens == whole[5:]
    fresh = row(SamplingOptions(max_tokens=7, temperature=1.0, top_k=50), seed=42, prompt_ids=(1, 2, *whole[:5]))
    assert [sample_batch(logits(1, seed=step), [fresh])[0][0] for step in range(5, 12)] != whole[5:]


def test_presence_and_frequency_penalties_count_a_continued_choices_earlier_output():
    values = torch.zeros(1, VOCAB)
    values[0, 7] = 1.0
    values[0, 8] = 0.9
    options = SamplingOptions(max_tokens=1, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5)
    assert sample_batch(values, [row(options, output_ids=(7,))])[0] == [8]  # 7 was said: penalised
    continued = SamplingOptions(max_tokens=1, temperature=0.0, presence_penalty=0.5, frequency_penalty=0.5,
                                prior_output_tokens=1)
    assert sample_batch(values, [row(continued, prompt_ids=(1, 7))])[0] == [8]  # the same 7, said elsewhere
    assert sample_batch(values, [row(options, prompt_ids=(1, 7))])[0] == [7]  # a prompt's 7 is not output


def test_top_k_top_p_min_p_restrict_the_support_per_row():
    values = logits(4)
    top3 = [set(torch.topk(values[i], 3).indices.tolist()) for i in range(4)]
    rows = [row(SamplingOptions(max_tokens=1, temperature=5.0, top_k=3), seed=1),
            row(SamplingOptions(max_tokens=1, temperature=1.0, top_p=1e-6), seed=2),
            row(SamplingOptions(max_tokens=1, temperature=1.0, min_p=1.0), seed=3),
            row(SamplingOptions(max_tokens=1, temperature=50.0), seed=4)]
    seen = [set() for _ in rows]
    for _ in range(60):  # 60 positions of each seeded choice
        for i, token in enumerate(sample_batch(values, rows)[0]):
            seen[i].add(token)
            rows[i].seq.output_ids.append(token)
    best = values.argmax(-1).tolist()
    assert seen[0] <= top3[0] and len(seen[0]) > 1
    assert seen[1] == {best[1]} and seen[2] == {best[2]}
    assert len(seen[3]) > 10  # the unfiltered hot row really samples


def test_penalties():
    values = torch.zeros(1, VOCAB)
    values[0, 5], values[0, 6], values[0, 7] = 3.0, 2.9, -1.0
    greedy = dict(max_tokens=1, temperature=0.0)
    # Frequency: token 5 seen twice drops below 6.
    assert sample_batch(values, [row(SamplingOptions(**greedy, frequency_penalty=0.1), output_ids=[5, 5])])[0] == [6]
    assert sample_batch(values, [row(SamplingOptions(**greedy, presence_penalty=0.2), output_ids=[5])])[0] == [6]
    # Repetition (HF): 5 is in the prompt, 3.0 / 1.1 < 2.9.
    assert sample_batch(values, [row(SamplingOptions(**greedy, repetition_penalty=1.1), prompt_ids=[5])])[0] == [6]
    # A negative logit gets multiplied: the seen token 7 stays last.
    penalised = values.clone()
    penalised[0, :5] = -5.0
    penalised[0, 8:] = -5.0
    penalised[0, 5] = penalised[0, 6] = -5.0
    assert sample_batch(penalised, [row(SamplingOptions(**greedy, repetition_penalty=2.0), prompt_ids=[7])])[0] == [7]


def test_logprobs_are_raw_log_softmax_with_ranks_and_alternatives():
    values = logits(2)
    options = SamplingOptions(max_tokens=1, temperature=0.0, logprobs=True, top_logprobs=3)
    plain = SamplingOptions(max_tokens=1, temperature=0.0)
    tokens, logprobs = sample_batch(values, [row(options), row(plain)])
    expected = torch.log_softmax(values[0], -1)
    entry = logprobs[0]
    assert entry.sampled.token_id == tokens[0] and entry.sampled.rank == 1
    assert entry.sampled.logprob == pytest.approx(float(expected[tokens[0]]), abs=1e-5)
    assert [alt.rank for alt in entry.top] == [1, 2, 3]
    assert [alt.token_id for alt in entry.top] == torch.topk(expected, 3).indices.tolist()
    assert logprobs[1] is None
    # A banned best token: the sampled one ranks 2 under the raw distribution.
    banned = row(SamplingOptions(max_tokens=1, temperature=0.0, logprobs=True), banned=frozenset({tokens[0]}))
    _, logprobs = sample_batch(values[:1], [banned])
    assert logprobs[0].sampled.rank == 2 and logprobs[0].top == ()


def biased(bias, **options):
    return SamplingOptions(max_tokens=1, logit_bias=LogitBias.from_mapping(bias), **options)


def test_logit_bias_bans_and_forces_a_token_in_its_own_row_only():
    values = logits(3)
    best = values.argmax(-1).tolist()
    forced = int(values[1].argmin())  # the least likely token of row 1
    rows = [row(biased({best[0]: -100.0}, temperature=0.0)), row(biased({forced: 100.0}, temperature=0.0)),
            row(SamplingOptions(max_tokens=1, temperature=0.0))]
    tokens, _ = sample_batch(values, rows)
    assert tokens[0] != best[0] and tokens[0] == int(values[0].topk(2).indices[1])
    assert tokens[1] == forced
    assert tokens[2] == best[2]  # an unbiased row beside them is plain argmax


def test_a_forced_token_wins_sampling_too_and_a_ban_empties_it():
    values = logits(1)
    forced = int(values[0].argmin())
    assert {sample_batch(values, [row(biased({forced: 100.0}, temperature=1.0), seed=s)])[0][0]
            for s in range(20)} == {forced}
    best = int(values[0].argmax())
    drawn = {sample_batch(values, [row(biased({best: -100.0}, temperature=0.01), seed=s)])[0][0] for s in range(20)}
    assert best not in drawn


def test_logit_bias_comes_before_penalties_as_in_vllm():
    # Token 5 (logit 1.0) biased by -2 reaches -1.0; a repetition penalty of 2 then multiplies it
    # to -2.0, below token 6 (-1.5). Penalty first would give 0.5 - 2 = -1.5, tying token 6.
    values = torch.full((1, VOCAB), -10.0)
    values[0, 5], values[0, 6] = 1.0, -1.5
    options = biased({5: -2.0}, temperature=0.0, repetition_penalty=2.0)
    assert sample_batch(values, [row(options, prompt_ids=[5])])[0] == [6]


def test_logit_bias_leaves_excluded_tokens_out_and_logprobs_raw():
    values = logits(1)
    excluded, unlikely = values[0].argsort()[:2].tolist()
    values[0, excluded] = float("-inf")  # as padding or a grammar masks it
    options = biased({excluded: 100.0, unlikely: 50.0}, temperature=0.0, logprobs=True)
    tokens, logprobs = sample_batch(values, [row(options)])
    assert tokens == [unlikely]
    raw = torch.log_softmax(values[0], -1)  # the model's distribution, before the bias
    assert logprobs[0].sampled.logprob == pytest.approx(float(raw[unlikely]), abs=1e-5)
    assert logprobs[0].sampled.rank == VOCAB - 1


def test_a_biased_choice_builds_its_bias_tensors_once():
    values = logits(1)
    target = row(biased({3: 100.0}, temperature=0.0))
    assert sample_batch(values, [target])[0] == [3]
    built = target.seq.logit_bias
    assert sample_batch(values, [target])[0] == [3] and target.seq.logit_bias is built
