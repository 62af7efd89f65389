"""What flows through one engine step, in one direction: the scheduler's `StepPlan` goes to the
model runner, which answers with `SampledTokens`; the scheduler's `update` applies them.

    plan = scheduler.schedule()          # who runs, which tokens, which blocks
    sampled = runner.run(plan)           # one batched forward, one batched sampling call
    outputs = scheduler.update(plan, sampled)   # append tokens, finish, free, fork
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tito_engine.request import PositionLogprobs, Request, SamplingOptions, Sequence
from tito_engine.scheduling.spans import PrefillMedia


@dataclass
class RowInput:
    """One sequence's work in a step: compute K/V for `token_ids` at positions start.."""

    token_ids: list[int]
    start: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # covers at least start + len(token_ids) tokens
    needs_logits: bool  # sample after this row (its chunk reaches the end of the known tokens)
    mm: PrefillMedia | None = None  # model.forward.MultiModalPrefill
    lora_slot: int = 0  # the slot of the request's LoRA adapter (model/lora.py); 0: the base model


@dataclass
class SampleRow:
    """One row of the step's logits and whose choice it decides."""

    options: SamplingOptions
    seq: Sequence
    prompt_ids: list[int]
    banned: frozenset[int] = frozenset()  # EOS/stop ids while min_tokens is not reached




@dataclass
class StepPlan:
    """One step's work.

    `rows[i]` is the forward input of the choice `owners[i]`. `samples[j]` says how to pick the
    next token of `targets[j]` from logits row `logit_rows[j]` (the forward returns logits only for
    rows with `needs_logits`, in order); choices that fork from choice 0 this step sample from its
    row, so several targets may read one logits row."""

    rows: list[RowInput] = field(default_factory=list)
    owners: list[tuple[Request, Sequence]] = field(default_factory=list)
    targets: list[tuple[Request, Sequence]] = field(default_factory=list)
    samples: list[SampleRow] = field(default_factory=list)
    logit_rows: list[int] = field(default_factory=list)
    #: Targets whose choice is under a structured-output grammar (their `seq.matcher`).
    constrained: list[int] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.rows)

    @property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits decides every target (the sampler's fast path)."""
        return all(sample.options.plain_greedy and not sample.banned for sample in self.samples)


@dataclass
class SampledTokens:
    """The runner's answer to a plan: one token per target, and logprobs when any target asked."""

    token_ids: list[int]
    logprobs: list[PositionLogprobs | None] | None = None
    #: Targets whose grammar is complete after this token (they finish with STOP).
    structure_complete: frozenset[int] = frozenset()
