"""Continuous batching policy: who runs in a step, with which tokens. A step is three calls with
one direction of data (plan.py): `schedule()` returns a `StepPlan` (admits waiting requests,
schedules prefill chunks beside the running decodes), the model runner executes it (ONE batched
forward and ONE batched sampling call), and `update(plan, sampled)` applies the tokens (finishes,
frees, forks). `run_step` chains the three. Block arithmetic and the prefix cache are
`kv_manager.KVCacheManager`'s; the scheduler never touches the model, so its policy is tested
against a fake runner.

Runs only on the engine thread (no locks here).

- Running set: at most `max_running_sequences` choices; admission order is kept (it decides who is
  preempted first). Waiting queue: FIFO; preempted requests go back to its front.
- Prefill: a prompt is computed in chunks of at most `max_prefill_tokens` per step (shared by all
  prefilling sequences), so a long prompt never stalls the running decodes for long.
- KV memory: a request is admitted only when blocks for its whole prompt plus one spare block per
  choice are free. A running sequence that needs a new block when none is free preempts the most
  recently admitted request (its blocks are freed; it goes back to the front of the queue and later
  recomputes prompt + tokens already generated; streamed tokens stay streamed). Requests that could
  never fit the whole cache are refused before they get here (Engine.submit).
- n > 1: choice 0 prefills the prompt; when it completes, the other choices fork from it, sharing
  the prompt's full blocks (reference counts) and copying the last partial block.
- Media prompts (Gemma3): a prefill chunk never splits a bidirectional span (an image's run of
  soft tokens attends within itself in both directions, exact only in one chunk): the chunk ends
  before the span, or, when it starts at the span, takes the whole span even past the budget.
- Structured outputs (constraints.py): a constrained request arrives with its compiled grammar;
  each choice gets a matcher. The runner masks a step's constrained rows in one batched apply
  before sampling and feeds each matcher its token after (ModelRunner.run); a choice whose
  grammar is complete finishes with STOP. Steps without constrained rows pay nothing.
- Prefix caching (text prompts only; requests with media items never read or fill it): full
  prompt blocks are registered under chained sha256 digests
  of their tokens (and the request's cache_salt) once computed; an admitted sequence takes the
  longest cached prefix of its prompt (at most all but its last token, which must run to give
  logits) and starts computing after it. Unreferenced cached blocks count as free and are
  evicted least recently used first.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from typing import Any, Protocol

from tito_engine.limits import SchedulerLimits
from tito_engine.request import ChoiceOutput, FinishReason, Request, Sequence
from tito_engine.scheduling.blocks import KVBlocks
from tito_engine.scheduling.kv_manager import KVCacheManager
from tito_engine.scheduling.plan import RowInput, SampledTokens, SampleRow, StepPlan
from tito_engine.scheduling.spans import fit_chunk_end

log = logging.getLogger(__name__)


StepOutputs = list[tuple[Request, ChoiceOutput | BaseException]]


class StepRunner(Protocol):
    """What executes a plan: the model runner, or a fake one in policy tests."""

    def run(self, plan: StepPlan) -> SampledTokens: ...


class ChoiceState(Protocol):
    """What a new choice gets from the model side (`tito_engine.model.choices.ModelChoiceState`):
    the scheduler decides when a choice starts, never how its generator or matcher are built."""

    def new_generator(self, seed: int, index: int) -> Any:
        """The random generator of choice `index` of a request seeded with `seed`."""

    def new_matcher(self, grammar: Any, prior_output: list[int] | tuple[int, ...] = ()) -> Any:
        """A matcher of a compiled structured-output grammar, past a migrated choice's earlier
        output (`prior_output`; admission checked that the grammar takes it)."""


class _EosIds(Protocol):
    eos_token_ids: tuple[int, ...]


class SchedulerRunner(Protocol):
    """What `Scheduler.for_runner` reads of a runner: its KV storage, its model's EOS ids and how
    a new choice gets its generator and matcher."""

    cache: KVBlocks
    info: _EosIds
    choice_state: ChoiceState


class Scheduler:
    def __init__(self, cache: KVBlocks, eos_token_ids: frozenset[int] | tuple[int, ...], choice_state: ChoiceState,
                 limits: SchedulerLimits = SchedulerLimits()):
        self.kv = KVCacheManager(cache, limits.prefix_caching)
        self.choice_state = choice_state
        self.max_running_sequences = limits.max_running_sequences
        self.max_prefill_tokens = limits.max_prefill_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.finished_requests = 0
        self.preemptions = 0
        self._admit_counter = 0
        self._running_sequences = 0  # unfinished choices of running requests

    @classmethod
    def for_runner(cls, runner: SchedulerRunner, limits: SchedulerLimits) -> "Scheduler":
        """A scheduler over `runner`'s KV cache within `limits`, stopping at its model's EOS ids."""
        return cls(runner.cache, runner.info.eos_token_ids, runner.choice_state, limits)

    # ---------------------------------------------------------------- queue management

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_sequences(self) -> int:
        return self._running_sequences

    def kv_blocks_used(self) -> int:
        return self.kv.num_used

    @property
    def prefix_cache_hit_tokens(self) -> int:
        return self.kv.prefix_cache_hit_tokens

    def abort(self, request: Request) -> list[ChoiceOutput]:
        """Remove `request` wherever it is; free its KV; return the ABORT outputs of its open choices."""
        if request.is_running:
            self._leave_running(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            return []  # already finished (or never added)
        if not request.sequences:
            request.sequences = [Sequence(i) for i in range(request.options.n)]
        outputs = []
        for seq in request.unfinished():
            seq.finish_reason = FinishReason.ABORT
            outputs.append(_final_output(request, seq))
        self._retire(request)
        return outputs

    def fail(self, plan: StepPlan, error: BaseException) -> StepOutputs:
        """The step of `plan` failed: one forward serves the whole batch, so its error fails every
        request in it (and only those: waiting requests and the engine carry on)."""
        outputs: StepOutputs = []
        for request in dict.fromkeys(request for request, _ in plan.owners):
            if request.is_running:
                self._leave_running(request)
                request.failed = True
                self._retire(request)
                outputs.append((request, error))
        return outputs

    # ---------------------------------------------------------------- scheduling

    def schedule(self) -> StepPlan:
        """This step's rows: the running choices' next tokens or prefill chunks, then newly
        admitted requests within the prefill budget; and how each target picks its token."""
        plan = StepPlan()
        budget = self._schedule_running(plan)
        self._admit(plan, budget)
        self._plan_sampling(plan)
        return plan

    def _schedule_running(self, plan: StepPlan) -> int:
        """Rows of the running requests (preempting the newest when blocks run out); returns the
        prefill budget left."""
        budget = self.max_prefill_tokens
        for request in list(self.running):
            if not request.is_running:
                continue  # preempted while making room for an earlier request
            total_prompt = len(request.prompt_ids)
            for seq in request.sequences:
                if seq.finish_reason is not None or seq.awaiting_fork:
                    continue
                total = total_prompt + len(seq.output_ids)
                start = seq.num_computed
                remaining = total - start
                count = 1 if remaining == 1 else _chunk(request, start, min(remaining, budget))
                if count <= 0:
                    continue
                end = start + count
                need = self.kv.growth_need(seq, end)
                fork_need = self.kv.fork_need(request) if end == total and request.sequences[-1].awaiting_fork else 0
                if need + fork_need > 0:
                    if not self._make_room(need + fork_need, request):
                        # `request` itself was the newest and went back to the queue; every request
                        # after it in this loop was preempted before it, so nothing is left here.
                        _drop_rows_of(plan, request)
                        return budget
                    self.kv.grow(seq, need)
                    if fork_need:
                        self.kv.reserve_fork_blocks(request)
                if remaining > 1:
                    budget -= count
                    tokens = _tokens(request, seq, start, end)
                else:
                    tokens = [seq.output_ids[-1]] if seq.output_ids else request.prompt_ids[-1:]
                plan.rows.append(RowInput(tokens, start, seq.block_table, end == total, request.mm,
                                          request.lora_slot))
                plan.owners.append((request, seq))
        return budget

    def _make_room(self, need: int, request: Request) -> bool:
        """Preempt the newest requests until `need` blocks are free; False if `request` itself went."""
        while self.kv.num_free < need:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self._leave_running(request)
        self.kv.free(request)
        for seq in request.sequences:
            seq.num_computed = 0
        request.preemptions += 1
        self.preemptions += 1
        if request.media_unencoded is not None:  # its recompute needs the encoder rows it skipped
            request.awaiting_media_rows = True
        self.waiting.appendleft(request)
        log.info("preempted for KV memory (%d blocks free); it will recompute %d tokens", self.kv.num_free,
                 sum(len(request.prompt_ids) + len(s.output_ids) for s in request.unfinished()),
                 extra={"request_id": request.request_id})

    def _admit(self, plan: StepPlan, budget: int) -> None:
        """Move waiting requests to the running set, in order, while choices, blocks and the
        prefill budget allow; schedule each one's first prefill chunk."""
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if request.failed:
                self.waiting.popleft()
                continue
            if request.awaiting_media_rows:
                break  # the core encodes its items before the next step
            fresh = not request.sequences
            if fresh:
                _create_sequences(request, self.choice_state)
            open_seqs = request.unfinished()
            if self._running_sequences + len(open_seqs) > self.max_running_sequences:
                break
            prefilling = [seq for seq in open_seqs if not seq.awaiting_fork]
            # An idle engine skips the spare block per choice: Engine.submit guaranteed the request
            # fits the cache on its own.
            if self.kv.admission_need(request, prefilling, 1 if self.running else 0) > self.kv.num_free:
                break
            self.waiting.popleft()
            self._enter_running(request, len(open_seqs))
            self.kv.allocate_for_admission(request, prefilling, fresh)
            for seq in prefilling:
                start = seq.num_computed
                total = len(request.prompt_ids) + len(seq.output_ids)
                count = _chunk(request, start, min(total - start, budget))
                if count <= 0:
                    continue
                budget -= count
                end = start + count
                if end == total and seq.index == 0:
                    self.kv.reserve_fork_blocks(request)
                plan.rows.append(RowInput(_tokens(request, seq, start, end), start, seq.block_table, end == total,
                                          request.mm, request.lora_slot))
                plan.owners.append((request, seq))

    def _plan_sampling(self, plan: StepPlan) -> None:
        """One target per row that reaches the end of its known tokens; choices forking from
        choice 0 this step sample from the same logits row."""
        logit_row = 0
        for row, (request, seq) in zip(plan.rows, plan.owners):
            if not row.needs_logits:
                continue
            choices = [seq]
            if seq.index == 0 and request.sequences[-1].awaiting_fork:
                choices += [child for child in request.sequences if child.awaiting_fork]
            for choice in choices:
                plan.targets.append((request, choice))
                if choice.matcher is not None:
                    plan.constrained.append(len(plan.targets) - 1)
                plan.samples.append(_sample_row(request, choice, self.eos_token_ids))
                plan.logit_rows.append(logit_row)
            logit_row += 1

    # ---------------------------------------------------------------- after the forward

    def update(self, plan: StepPlan, sampled: SampledTokens) -> StepOutputs:
        """Apply a step's results: computed tokens (publishing finished prefix blocks), forks,
        one new token per target; finish, free and retire what ended."""
        for row, (request, seq) in zip(plan.rows, plan.owners):
            before = seq.num_computed
            seq.num_computed += len(row.token_ids)
            self.kv.register_computed(request, seq, before)
            if row.needs_logits and seq.index == 0 and request.sequences[-1].awaiting_fork:
                self.kv.fork(request, seq)
        now = time.monotonic()
        outputs: StepOutputs = []
        done: list[Request] = []
        logprobs = sampled.logprobs
        for i, (request, seq) in enumerate(plan.targets):
            if request.first_token_time is None:
                request.first_token_time = now
            output = _append(request, seq, sampled.token_ids[i], logprobs[i] if logprobs is not None else None,
                             self.eos_token_ids, i in sampled.structure_complete)
            outputs.append((request, output))
            if output.finish_reason is not None:
                self._running_sequences -= 1
                if request.kv_pin is not None and seq.index == 0 and not request.failed:
                    request.pinned = self.kv.pin(request, seq, now + request.kv_pin.seconds)
                else:
                    self.kv.release(seq)
                if request.finished and (not done or done[-1] is not request):
                    done.append(request)
        for request in done:
            self.running.remove(request)
            request.is_running = False
            self._retire(request)
        return outputs

    # ---------------------------------------------------------------- the running set

    def _enter_running(self, request: Request, open_choices: int) -> None:
        self._admit_counter += 1
        request.admit_order = self._admit_counter
        if request.scheduled_time is None:
            request.scheduled_time = time.monotonic()
        self.running.append(request)
        request.is_running = True
        self._running_sequences += open_choices

    def _leave_running(self, request: Request) -> None:
        self.running.remove(request)
        request.is_running = False
        self._running_sequences -= len(request.unfinished())

    def _retire(self, request: Request) -> None:
        self.kv.free(request)
        request.finish_time = time.monotonic()
        self.finished_requests += 1
        _log_finished(request)


def run_step(scheduler: Scheduler, runner: StepRunner) -> StepOutputs:
    """One engine step: schedule, execute (forward and sampling), update. A failed execution
    fails the requests of its batch, never the engine."""
    plan = scheduler.schedule()
    if not plan:
        return []
    try:
        sampled = runner.run(plan)
    except Exception as exc:  # noqa: BLE001 - a failed batch must not stop the engine
        log.exception("the model step failed; failing the %d requests in its batch", len(plan.rows))
        return scheduler.fail(plan, exc)
    return scheduler.update(plan, sampled)


def _sample_row(request: Request, seq: Sequence, eos_token_ids: frozenset[int]) -> SampleRow:
    options = request.options
    banned: frozenset[int] = frozenset()
    if len(seq.output_ids) < options.min_tokens and seq.matcher is None:
        # EOS and stop ids may not end it yet (a grammar decides where a constrained row may end)
        banned = options.stop_token_ids if options.ignore_eos else options.stop_token_ids | eos_token_ids
    return SampleRow(options, seq, request.prompt_ids, banned)


def _create_sequences(request: Request, choice_state: ChoiceState) -> None:
    """The request's choices; choice 0 prefills, the others wait to fork from it."""
    options = request.options
    request.sequences = []
    for index in range(options.n):
        generator = choice_state.new_generator(options.seed, index) if options.seed is not None else None
        seq = Sequence(index, generator)
        seq.awaiting_fork = index > 0
        if request.grammar is not None:
            seq.matcher = choice_state.new_matcher(request.grammar, request.prior_output_ids)
        request.sequences.append(seq)


def _append(request: Request, seq: Sequence, token_id: int, logprobs, eos_token_ids: frozenset[int],
            structure_complete: bool = False) -> ChoiceOutput:
    """Append a sampled token to its choice, deciding whether it ends the choice
    (`structure_complete`: its grammar took its end or can take nothing more)."""
    options = request.options
    seq.output_ids.append(token_id)
    count = len(seq.output_ids)
    if count >= options.min_tokens and (
            (not options.ignore_eos and token_id in eos_token_ids) or token_id in options.stop_token_ids):
        seq.finish_reason = FinishReason.STOP
        seq.matched_stop_token_id = token_id
    elif structure_complete:
        seq.finish_reason = FinishReason.STOP
        if token_id in eos_token_ids or token_id in options.stop_token_ids:
            seq.matched_stop_token_id = token_id
    elif count >= options.max_tokens:
        seq.finish_reason = FinishReason.LENGTH
    lp = (logprobs,) if logprobs is not None else ()
    cached = request.cached_tokens if count == 1 else None
    if seq.finish_reason is not None:
        return ChoiceOutput(seq.index, (token_id,), seq.finish_reason, seq.matched_stop_token_id,
                            request.usage_for(seq), lp, cached_tokens=cached)
    return ChoiceOutput(seq.index, (token_id,), logprobs=lp, cached_tokens=cached)


def _final_output(request: Request, seq: Sequence) -> ChoiceOutput:
    """A finished choice's last message with no new tokens (abort)."""
    return ChoiceOutput(seq.index, (), finish_reason=seq.finish_reason,
                        matched_stop_token_id=seq.matched_stop_token_id, usage=request.usage_for(seq))


def _chunk(request: Request, start: int, count: int) -> int:
    """The prefill chunk length from `start` within `count` (the budget), moved so it splits no
    bidirectional span of the prompt (spans.fit_chunk_end); 0: wait for the next step."""
    if request.mm is None or count <= 0 or not request.mm.bidirectional_spans:
        return count
    return fit_chunk_end(request.mm, start, start + count) - start


def _tokens(request: Request, seq: Sequence, start: int, end: int) -> list[int]:
    """Token ids [start, end) of the sequence prompt + generated."""
    prompt = request.prompt_ids
    if end <= len(prompt):
        return prompt[start:end]
    if start >= len(prompt):
        return seq.output_ids[start - len(prompt):end - len(prompt)]
    return prompt[start:] + seq.output_ids[:end - len(prompt)]


def _drop_rows_of(plan: StepPlan, request: Request) -> None:
    kept = [(row, owner) for row, owner in zip(plan.rows, plan.owners) if owner[0] is not request]
    plan.rows = [row for row, _ in kept]
    plan.owners = [owner for _, owner in kept]


def _log_finished(request: Request) -> None:
    completion = sum(len(seq.output_ids) for seq in request.sequences)
    reasons = ",".join(seq.finish_reason.value if seq.finish_reason else "?" for seq in request.sequences)
    end = request.finish_time or time.monotonic()
    queue_s = (request.scheduled_time or end) - request.arrival_time
    ttft = f"{(request.first_token_time - request.arrival_time) * 1000:.1f}ms" if request.first_token_time else "-"
    longest = max((len(seq.output_ids) for seq in request.sequences), default=0)
    if request.first_token_time and longest > 1:
        tpot = f"{(end - request.first_token_time) / (longest - 1) * 1000:.2f}ms"
    else:
        tpot = "-"
    log.info("finished: prompt_tokens=%d completion_tokens=%d queue=%.1fms ttft=%s tpot=%s finish=%s "
             "preemptions=%d", len(request.prompt_ids), completion, queue_s * 1000, ttft, tpot, reasons,
             request.preemptions, extra={"request_id": request.request_id})
