import torch

from tito_engine.request import SamplingOptions
from tito_engine.sampler import make_generator, sample


def logits():
    return torch.randn(200, generator=torch.Generator().manual_seed(0))


def draw(options, seed, steps=20, index=0):
    generator = make_generator(seed, index, "cpu")
    return [sample(logits(), options, generator) for _ in range(steps)]


def test_greedy_is_argmax_and_respects_bans():
    values = logits()
    options = SamplingOptions(max_tokens=1, temperature=0.0)
    best = int(values.argmax())
    assert sample(values, options, None) == best
    assert sample(values, options, None, banned_token_ids=[best]) != best


def test_same_seed_same_tokens_and_choices_differ():
    options = SamplingOptions(max_tokens=1, temperature=1.0)
    assert draw(options, 42) == draw(options, 42)
    assert draw(options, 42) != draw(options, 43)
    assert draw(options, 42, index=0) != draw(options, 42, index=1)


def test_top_k_and_top_p_restrict_the_support():
    values = logits()
    top3 = set(torch.topk(values, 3).indices.tolist())
    generator = make_generator(1, 0, "cpu")
    options = SamplingOptions(max_tokens=1, temperature=5.0, top_k=3)
    assert {sample(values, options, generator) for _ in range(50)} <= top3
    # A tiny top_p keeps only the most likely token.
    options = SamplingOptions(max_tokens=1, temperature=1.0, top_p=1e-6)
    assert {sample(values, options, generator) for _ in range(20)} == {int(values.argmax())}
    options = SamplingOptions(max_tokens=1, temperature=1.0, min_p=1.0)
    assert {sample(values, options, generator) for _ in range(20)} == {int(values.argmax())}
