"""A fake model runner for scheduler policy tests: a "model" whose next token is a function of the
whole context, and whose KV cache holds the token ids themselves: it writes each row's tokens into
the slots the row's block table names and reads the context back through the block table. So a
wrong block table, a missing fork copy, a prefix block registered under the wrong tokens or a
block transferred wrongly changes the output, and the expected output is simply `next_token`
applied to prompt + generated tokens."""

from __future__ import annotations

import torch

from tito_engine.model.choices import ModelChoiceState
from tito_engine.model.kv_cache import KVLayout, PagedKVCache
from tito_engine.limits import SchedulerLimits
from tito_engine.scheduling.plan import SampledTokens, StepPlan
from tito_engine.request import Request, SamplingOptions
from tito_engine.scheduling.scheduler import Scheduler, run_step


EOS = 1


def next_token(context: list[int]) -> int:
    """The fake model: deterministic in the whole context, never EOS (unless a test asks)."""
    return sum((i + 1) * token for i, token in enumerate(context)) % 89 + 10


class FakeRunner:
    def __init__(self, num_blocks: int, block_size: int):
        layout = KVLayout(num_layers=1, kv_heads=1, head_dim=1, dtype=torch.float64)
        self.cache = PagedKVCache(layout, num_blocks, block_size, torch.device("cpu"))
        self.choice_state = ModelChoiceState(torch.device("cpu"))
        self.plans: list[StepPlan] = []

    def _slot(self, table: list[int], position: int) -> tuple[int, int]:
        return table[position // self.cache.block_size], position % self.cache.block_size

    def run(self, plan: StepPlan) -> SampledTokens:
        self.plans.append(plan)
        keys = self.cache.keys[0]
        logits_rows = []
        for row in plan.rows:
            for offset, token in enumerate(row.token_ids):
                keys[self._slot(row.block_table, row.start + offset)] = token
            if row.needs_logits:
                end = row.start + len(row.token_ids)
                context = [int(keys[self._slot(row.block_table, p)].item()) for p in range(end)]
                logits_rows.append(next_token(context))
        return SampledTokens([logits_rows[row] for row in plan.logit_rows])


def scheduler_with(runner: FakeRunner, max_running: int = 8, budget: int = 64, prefix_caching: bool = True):
    return Scheduler(runner.cache, {EOS}, runner.choice_state, SchedulerLimits(max_running, budget, prefix_caching))


def request(prompt: list[int], max_tokens: int = 6, **options) -> Request:
    return Request(f"r{prompt[0]}", prompt, SamplingOptions(max_tokens=max_tokens, temperature=0.0, **options))


def expected(prompt: list[int], count: int) -> list[int]:
    context = list(prompt)
    for _ in range(count):
        context.append(next_token(context))
    return context[len(prompt):]


def drain(scheduler: Scheduler, runner: FakeRunner, max_steps: int = 500) -> dict[tuple[str, int], list[int]]:
    tokens: dict[tuple[str, int], list[int]] = {}
    for _ in range(max_steps):
        if not scheduler.has_work():
            break
        for req, output in run_step(scheduler, runner):
            tokens.setdefault((req.request_id, output.index), []).extend(output.token_ids)
    assert not scheduler.has_work()
    return tokens
