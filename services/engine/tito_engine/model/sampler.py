"""Turns one step's logits into tokens for every row at once, each row with its own options.

One call per step: logit_bias, penalties, min_tokens bans, temperature, top-k, top-p and min-p
are applied in that order (vLLM's: the bias before the penalties) as batched tensor ops; greedy
rows take the argmax; sampled rows draw by the exponential race (argmax of probs / Exp(1) noise,
which samples the categorical exactly). Rows of seeded requests draw their noise from their own
`torch.Generator`, so a seed gives the same tokens whatever else shares the batch; unseeded rows
share one draw from the global generator. A seeded choice's generator is re-seeded before each
draw from (seed, choice, output position) rather than run on from its first state, so a choice
that another engine continues after a failure (request migration: `prior_output_tokens`) draws
exactly what it would have drawn here.

Padding ids (valid ids the tokenizer does not name, tito.vocab) are excluded by default: the
model runner precomputes their index once, and `mask_logits` sets those columns of the step's
logits to -inf before anything else (in place: a few hundred writes per row, not a pass over the
vocabulary), so they are never sampled and carry no probability in logprobs either (the
distribution is the model's over real tokens). With the exclusion off there is no mask and no
cost.

Logprobs are those of the raw model distribution (log_softmax of the logits before the bias,
penalties, bans, temperature and filters), with the sampled token's 1-based rank.

A row's logit_bias (OpenAI's: token id -> bias added to its logit) lives on the choice as two
tensors built once; each step adds every biased row's entries in one scatter, and rows without a
bias cost nothing. A token the engine excludes (padding, grammar, min_tokens) stays at -inf
whatever its bias.
"""

from __future__ import annotations

import hashlib
import secrets
import struct

import torch

from tito_engine.request import PositionLogprobs, TokenLogprob
from tito_engine.scheduling.plan import SampleRow

_SEED_MASK = 2**64 - 1


class ChoiceGenerator:
    """The random source of one seeded choice. Each draw's state is a function of the choice's seed
    and the output position alone, never of the draws before it: the same position draws the same
    noise on any engine, which makes a migrated choice's continuation exact."""

    def __init__(self, seed: int, device: torch.device | str):
        self.seed = seed
        self._generator = torch.Generator(device=device)

    def at(self, position: int) -> torch.Generator:
        """The generator in its state for the draw of output token `position` (0-based)."""
        digest = hashlib.blake2b(struct.pack("<QQ", self.seed, position), digest_size=8).digest()
        self._generator.manual_seed(int.from_bytes(digest, "little"))
        return self._generator


def make_generator(seed: int | None, choice_index: int, device: torch.device | str) -> ChoiceGenerator:
    """A generator for one choice; choices of one seeded request differ but are reproducible."""
    base = secrets.randbits(63) if seed is None else seed
    return ChoiceGenerator((base + choice_index) & _SEED_MASK, device)


def mask_logits(logits: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    """`logits` [R, vocab] (the step's own tensor) with the precomputed padding columns set to
    -inf, in place; untouched when there is no mask."""
    if mask is None:
        return logits
    with torch.inference_mode():  # the forward's logits are inference tensors: update them as such
        return logits.index_fill_(1, mask, float("-inf"))


def sample_batch(logits: torch.Tensor, rows: list[SampleRow], raw_logits: torch.Tensor | None = None
                 ) -> tuple[list[int], list[PositionLogprobs | None] | None]:
    """Pick one token per row of `logits` [R, vocab]; return the ids and (if any row asked) logprobs.

    `raw_logits`: the model's logits when `logits` were already masked (structured outputs);
    logprobs are computed from them.
    """
    if all(row.options.plain_greedy and not row.banned for row in rows):
        return logits.max(dim=-1).indices.tolist(), None  # max: faster than argmax on CPU
    processed = logits
    biased = [i for i, row in enumerate(rows) if row.options.logit_bias is not None]
    penalised = [i for i, row in enumerate(rows) if row.options.has_penalties]
    banned = [i for i, row in enumerate(rows) if row.banned]
    if biased or penalised or banned:
        processed = logits.clone()
        if biased:
            _add_logit_bias(processed, [rows[i] for i in biased], biased)
        for i in penalised:
            _apply_penalties(processed[i], rows[i])
        for i in banned:
            processed[i, list(rows[i].banned)] = float("-inf")
    tokens = processed.argmax(dim=-1)
    sampled_rows = [i for i, row in enumerate(rows) if not row.options.greedy]
    if sampled_rows:
        tokens[sampled_rows] = _draw(processed[sampled_rows], [rows[i] for i in sampled_rows])
    token_list = tokens.tolist()
    logprob_rows = [i for i, row in enumerate(rows) if row.options.wants_logprobs]
    if not logprob_rows:
        return token_list, None
    return token_list, _logprobs(logits if raw_logits is None else raw_logits, rows, token_list, logprob_rows)


def _add_logit_bias(logits: torch.Tensor, rows: list[SampleRow], indices: list[int]) -> None:
    """In place: add each row's logit_bias to `logits[indices[j]]`, all rows in one index_put_."""
    device = logits.device
    ids, biases = zip(*(_bias_tensors(row, device) for row in rows))
    counts = torch.tensor([len(row_ids) for row_ids in ids], device=device)
    row_index = torch.repeat_interleave(torch.tensor(indices, device=device), counts)
    logits.index_put_((row_index, torch.cat(ids)), torch.cat(biases).to(logits.dtype), accumulate=True)


def _bias_tensors(row: SampleRow, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The choice's logit_bias as (ids, biases) tensors, built on its first step and kept."""
    seq = row.seq
    if seq.logit_bias is None:
        bias = row.options.logit_bias
        seq.logit_bias = (torch.tensor(bias.token_ids, dtype=torch.long, device=device),
                          torch.tensor(bias.biases, dtype=torch.float32, device=device))
    return seq.logit_bias


def _apply_penalties(row_logits: torch.Tensor, row: SampleRow) -> None:
    """In place on one row: repetition (HF: prompt + output), presence/frequency (OpenAI: output)."""
    options, seq = row.options, row.seq
    vocab = row_logits.shape[0]
    device = row_logits.device
    prior = options.prior_output_tokens  # a migrated choice's earlier output sits at the prompt's end
    output_ids = row.prompt_ids[len(row.prompt_ids) - prior:] + seq.output_ids if prior else seq.output_ids
    output = torch.tensor(output_ids, dtype=torch.long, device=device)
    counts = torch.bincount(output, minlength=vocab)[:vocab] if output_ids else torch.zeros(
        vocab, dtype=torch.long, device=device)
    if options.repetition_penalty != 1.0:
        if seq.prompt_mask is None:
            mask = torch.zeros(vocab, dtype=torch.bool, device=device)
            mask[torch.tensor(row.prompt_ids, dtype=torch.long, device=device)] = True
            seq.prompt_mask = mask
        seen = seq.prompt_mask | (counts > 0)
        penalty = options.repetition_penalty
        adjusted = torch.where(row_logits > 0, row_logits / penalty, row_logits * penalty)
        row_logits.copy_(torch.where(seen, adjusted, row_logits))
    if options.frequency_penalty or options.presence_penalty:
        counts_f = counts.to(row_logits.dtype)
        row_logits -= options.frequency_penalty * counts_f + options.presence_penalty * (counts_f > 0).to(
            row_logits.dtype)


def _draw(logits: torch.Tensor, rows: list[SampleRow]) -> torch.Tensor:
    """Sample one token per row of `logits` [S, vocab] under each row's temperature and filters."""
    device = logits.device
    count, vocab = logits.shape
    temperatures = torch.tensor([row.options.temperature for row in rows], dtype=logits.dtype, device=device)
    logits = logits / temperatures[:, None]
    top_ks = [row.options.top_k if 0 < row.options.top_k < vocab else vocab for row in rows]
    top_ps = [row.options.top_p for row in rows]
    if any(k < vocab for k in top_ks) or any(p < 1.0 for p in top_ps):
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        ranks = torch.arange(vocab, device=device)[None, :]
        drop = ranks >= torch.tensor(top_ks, device=device)[:, None]
        sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
        if any(p < 1.0 for p in top_ps):
            probs = torch.softmax(sorted_logits, dim=-1)
            # Drop a token when the mass strictly before it already reaches top_p (the top one stays).
            mass_before = torch.cumsum(probs, dim=-1) - probs
            drop = drop | (mass_before >= torch.tensor(top_ps, dtype=probs.dtype, device=device)[:, None])
        logits = logits.masked_fill(torch.zeros_like(drop).scatter(1, order, drop), float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    min_ps = [row.options.min_p for row in rows]
    if any(min_ps):
        floor = torch.tensor(min_ps, dtype=probs.dtype, device=device)[:, None] * probs.max(dim=-1, keepdim=True).values
        probs = probs.masked_fill(probs < floor, 0.0)
    noise = torch.empty_like(probs)
    seeded = [i for i, row in enumerate(rows) if row.seq.generator is not None]
    if len(seeded) < count:
        noise.exponential_()
    for i in seeded:
        row = rows[i]
        generator = row.seq.generator.at(row.options.prior_output_tokens + len(row.seq.output_ids))
        noise[i] = torch.empty(vocab, dtype=probs.dtype, device=device).exponential_(generator=generator)
    return (probs / noise.clamp_min_(1e-20)).argmax(dim=-1)


def _logprobs(logits: torch.Tensor, rows: list[SampleRow], tokens: list[int],
              wanted: list[int]) -> list[PositionLogprobs | None]:
    device = logits.device
    logprobs = torch.log_softmax(logits[wanted].float(), dim=-1)
    chosen = torch.tensor([tokens[i] for i in wanted], dtype=torch.long, device=device)
    chosen_lp = logprobs.gather(1, chosen[:, None])
    ranks = ((logprobs > chosen_lp).sum(dim=-1) + 1).tolist()
    chosen_values = chosen_lp[:, 0].tolist()
    most = max(rows[i].options.top_logprobs for i in wanted)
    top_values = top_ids = None
    if most:
        top = torch.topk(logprobs, most, dim=-1)
        top_values, top_ids = top.values.tolist(), top.indices.tolist()
    result: list[PositionLogprobs | None] = [None] * len(rows)
    for j, i in enumerate(wanted):
        k = rows[i].options.top_logprobs
        alternatives = ()
        if k:
            alternatives = tuple(TokenLogprob(top_ids[j][r], top_values[j][r], r + 1) for r in range(k))
        result[i] = PositionLogprobs(TokenLogprob(tokens[i], chosen_values[j], ranks[j]), alternatives)
    return result
