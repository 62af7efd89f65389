"""Turns one position's logits into a token: greedy, or seeded temperature/top-k/top-p/min-p.

Each choice samples with its own `torch.Generator`, so a seed gives the same tokens whatever
else shares the batch.
"""

from __future__ import annotations

import secrets
from collections.abc import Iterable

import torch

from .request import SamplingOptions

_SEED_MASK = 2**64 - 1


def make_generator(seed: int | None, choice_index: int, device: torch.device | str) -> torch.Generator:
    """A generator for one choice; choices of one seeded request differ but are reproducible."""
    generator = torch.Generator(device=device)
    base = secrets.randbits(63) if seed is None else seed
    generator.manual_seed((base + choice_index) & _SEED_MASK)
    return generator


def sample(logits: torch.Tensor, options: SamplingOptions, generator: torch.Generator | None,
           banned_token_ids: Iterable[int] = ()) -> int:
    """Pick the next token from `logits` (shape [vocab])."""
    logits = logits.float()
    banned = list(banned_token_ids)
    if banned:
        logits = logits.clone()
        logits[banned] = float("-inf")
    if options.greedy:
        return int(torch.argmax(logits))
    logits = logits / options.temperature
    if options.top_k > 0 and options.top_k < logits.numel():
        kth_largest = torch.topk(logits, options.top_k).values[-1]
        logits = logits.masked_fill(logits < kth_largest, float("-inf"))
    if options.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        sorted_probs = torch.softmax(sorted_logits, dim=-1)
        # Drop a token when the mass strictly before it already reaches top_p (the top one stays).
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        drop_sorted = mass_before >= options.top_p
        logits = logits.masked_fill(torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if options.min_p > 0:
        probs = probs.masked_fill(probs < options.min_p * probs.max(), 0.0)
    return int(torch.multinomial(probs, 1, generator=generator))
