"""Continuous batching: each step admits waiting requests, schedules prefill chunks beside the
running decodes, runs ONE batched forward and ONE batched sampling call, and returns the outputs.

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
  each choice gets a matcher. A step with constrained rows masks their logits in one batched
  fill + apply before sampling and feeds each matcher its token after; a choice whose grammar
  is complete finishes with STOP. Steps without constrained rows pay nothing.
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

from tito_engine import constraints
from tito_engine.forward import RowInput, fit_chunk_end
from tito_engine.kv_cache import blocks_for_tokens, prefix_block_hashes
from tito_engine.model_runner import ModelRunner
from tito_engine.request import ChoiceOutput, FinishReason, Request, Sequence
from tito_engine.sampler import SampleRow, make_generator, sample_batch

log = logging.getLogger(__name__)

DEFAULT_MAX_PREFILL_TOKENS = 2048

StepOutputs = list[tuple[Request, ChoiceOutput | BaseException]]


class Scheduler:
    def __init__(self, runner: ModelRunner, max_running_sequences: int,
                 max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS, prefix_caching: bool = True):
        self.runner = runner
        self.cache = runner.cache
        self.allocator = runner.cache.allocator
        self.block_size = runner.cache.block_size
        self.max_running_sequences = max_running_sequences
        self.max_prefill_tokens = max_prefill_tokens
        self.eos_token_ids = frozenset(runner.info.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # in admission order
        self.finished_requests = 0
        self.preemptions = 0
        self.prefix_caching = prefix_caching
        self.prefix_cache_hit_tokens = 0
        self._admit_counter = 0
        self._running_sequences = 0  # unfinished choices of running requests
        self._token_masks: constraints.TokenMasks | None = None  # built by the first constrained step

    # ---------------------------------------------------------------- queue management

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_sequences(self) -> int:
        return self._running_sequences

    def kv_blocks_used(self) -> int:
        return self.allocator.num_used

    def abort(self, request: Request) -> list[ChoiceOutput]:
        """Remove `request` wherever it is; free its KV; return the ABORT outputs of its open choices."""
        if request.is_running:
            self.running.remove(request)
            request.is_running = False
            self._running_sequences -= len(request.unfinished())
        elif request in self.waiting:
            self.waiting.remove(request)
        else:
            return []  # already finished (or never added)
        if not request.sequences:
            request.sequences = [Sequence(i) for i in range(request.options.n)]
        outputs = []
        for seq in request.unfinished():
            seq.finish_reason = FinishReason.ABORT
            outputs.append(self._final_output(request, seq, ()))
        self._retire(request)
        return outputs

    # ---------------------------------------------------------------- the step

    def step(self) -> StepOutputs:
        """Schedule, run one forward, sample, and return every output produced (engine thread)."""
        rows, owners = self._schedule()
        if not rows:
            return []
        try:
            logits = self.runner.execute(rows)
            return self._process(rows, owners, logits)
        except Exception as exc:  # noqa: BLE001 - a failed batch must not stop the engine
            # One forward serves the whole batch, so its error fails every request in it (and
            # only those: waiting requests and the engine carry on).
            log.exception("the model step failed; failing the %d requests in its batch", len(rows))
            outputs: StepOutputs = []
            for request in dict.fromkeys(request for request, _ in owners):
                if request.is_running:
                    self.running.remove(request)
                    request.is_running = False
                    self._running_sequences -= len(request.unfinished())
                    request.failed = True
                    self._retire(request)
                    outputs.append((request, exc))
            return outputs

    # ---------------------------------------------------------------- scheduling

    def _schedule(self) -> tuple[list[RowInput], list[tuple[Request, Sequence]]]:
        rows: list[RowInput] = []
        owners: list[tuple[Request, Sequence]] = []
        budget = self.max_prefill_tokens
        block_size = self.block_size
        for request in list(self.running):
            if not request.is_running:
                continue  # preempted while making room for an earlier request
            prompt_len = len(request.prompt_ids)
            for seq in request.sequences:
                if seq.finish_reason is not None or seq.awaiting_fork:
                    continue
                output_ids = seq.output_ids
                total = prompt_len + len(output_ids)
                start = seq.num_computed
                remaining = total - start
                if remaining == 1:
                    count = 1
                else:
                    count = _chunk(request, start, min(remaining, budget))
                    if count <= 0:
                        continue
                end = start + count
                need = 0
                if end > len(seq.block_table) * block_size:
                    need = blocks_for_tokens(end, block_size) - len(seq.block_table)
                fork_need = 0
                if end == total and request.sequences[-1].awaiting_fork:
                    fork_need = self._fork_block_need(request)
                if need + fork_need > 0:
                    if not self._make_room(need + fork_need, request):
                        # `request` itself was the newest: it went back to the queue.
                        rows, owners = _without(rows, owners, request)
                        break
                    if need > 0:
                        seq.block_table.extend(self.allocator.allocate(need))
                    if fork_need:
                        request.fork_blocks = self.allocator.allocate(fork_need)
                if remaining > 1:
                    budget -= count
                    tokens = _tokens(request, seq, start, end)
                else:
                    tokens = [output_ids[-1]] if output_ids else request.prompt_ids[-1:]
                rows.append(RowInput(tokens, start, seq.block_table, end == total, request.mm))
                owners.append((request, seq))
        self._admit(rows, owners, budget)
        return rows, owners

    def _fork_block_need(self, request: Request) -> int:
        """Blocks the waiting choices need at fork: a copy of the prompt's partial last block each."""
        waiting = sum(1 for seq in request.sequences if seq.awaiting_fork)
        return waiting if len(request.prompt_ids) % self.block_size else 0

    def _make_room(self, need: int, request: Request) -> bool:
        """Preempt the newest requests until `need` blocks are free; False if `request` itself went."""
        while self.allocator.num_free < need:
            victim = self.running[-1]
            self._preempt(victim)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        request.is_running = False
        self._running_sequences -= len(request.unfinished())
        self._free_blocks(request)
        for seq in request.sequences:
            seq.num_computed = 0
        request.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(request)
        log.info("preempted for KV memory (%d blocks free); it will recompute %d tokens", self.allocator.num_free,
                 sum(len(request.prompt_ids) + len(s.output_ids) for s in request.unfinished()),
                 extra={"request_id": request.request_id})

    def _admit(self, rows: list[RowInput], owners: list[tuple[Request, Sequence]], budget: int) -> None:
        block_size = self.block_size
        while self.waiting and budget > 0:
            request = self.waiting[0]
            if request.failed:
                self.waiting.popleft()
                continue
            fresh = not request.sequences
            if fresh:
                self._create_sequences(request)
            open_seqs = request.unfinished()
            if self._running_sequences + len(open_seqs) > self.max_running_sequences:
                break
            # Blocks for every token to recompute (less cached prefix blocks, though taking an
            # evictable one uses up a free one), the fork copies, and one spare per choice so it
            # can make progress (an idle engine skips the spare: Engine.submit guaranteed the
            # request fits the cache on its own).
            prefilling = [seq for seq in open_seqs if not seq.awaiting_fork]
            hashes = self._prefix_hashes(request)
            need = self._fork_block_need(request)
            for seq in prefilling:
                total = len(request.prompt_ids) + len(seq.output_ids)
                hits, evictable = self.allocator.peek_prefix(hashes[:(total - 1) // block_size])
                need += blocks_for_tokens(total, block_size) - hits + evictable
            if self.running:
                need += len(open_seqs)
            if need > self.allocator.num_free:
                break
            self.waiting.popleft()
            self._admit_counter += 1
            request.admit_order = self._admit_counter
            if request.scheduled_time is None:
                request.scheduled_time = time.monotonic()
            self.running.append(request)
            request.is_running = True
            self._running_sequences += len(open_seqs)
            # Take every cached prefix before allocating: an allocation may evict cached blocks.
            cached_prefixes = [self.allocator.take_prefix(
                hashes[:(len(request.prompt_ids) + len(seq.output_ids) - 1) // block_size]) for seq in prefilling]
            for seq, cached in zip(prefilling, cached_prefixes):
                total = len(request.prompt_ids) + len(seq.output_ids)
                seq.block_table = cached + self.allocator.allocate(blocks_for_tokens(total, block_size) - len(cached))
                start = seq.num_computed = len(cached) * block_size
                if fresh:
                    request.cached_tokens = max(request.cached_tokens, start)
                self.prefix_cache_hit_tokens += start
                count = _chunk(request, start, min(total - start, budget))
                if count <= 0:
                    continue
                budget -= count
                end = start + count
                if end == total and seq.index == 0 and self._fork_block_need(request):
                    request.fork_blocks = self.allocator.allocate(self._fork_block_need(request))
                rows.append(RowInput(_tokens(request, seq, start, end), start, seq.block_table, end == total,
                                     request.mm))
                owners.append((request, seq))

    def _prefix_hashes(self, request: Request) -> list[bytes]:
        """The prompt's full-block digests (empty when prefix caching is off or media are involved)."""
        if request.block_hashes is None:
            # Media requests stay out of the prefix cache: the token ids of two different images
            # are equal, so a block covering an image must not be keyed by tokens alone.
            cacheable = self.prefix_caching and not request.has_media and request.mm is None
            request.block_hashes = prefix_block_hashes(request.prompt_ids, self.block_size,
                                                       request.cache_salt) if cacheable else []
        return request.block_hashes

    def _register_prefix_blocks(self, request: Request, seq: Sequence, before: int) -> None:
        """Publish the prompt blocks this step completed (computed tokens went from `before` on)."""
        hashes = request.block_hashes
        block_size = self.block_size
        for index in range(before // block_size, min(seq.num_computed // block_size, len(hashes))):
            self.allocator.register(seq.block_table[index], hashes[index])

    def _create_sequences(self, request: Request) -> None:
        options = request.options
        device = self.runner.device
        request.sequences = []
        for index in range(options.n):
            generator = make_generator(options.seed, index, device) if options.seed is not None else None
            seq = Sequence(index, generator)
            seq.awaiting_fork = index > 0
            if request.grammar is not None:
                seq.matcher = constraints.new_matcher(request.grammar)
            request.sequences.append(seq)

    # ---------------------------------------------------------------- after the forward

    def _process(self, rows: list[RowInput], owners: list[tuple[Request, Sequence]], logits) -> StepOutputs:
        logit_rows: list[int] = []
        targets: list[tuple[Request, Sequence]] = []
        logit_index = 0
        for row, (request, seq) in zip(rows, owners):
            before = seq.num_computed
            seq.num_computed += len(row.token_ids)
            if request.block_hashes and before < len(request.block_hashes) * self.block_size:
                self._register_prefix_blocks(request, seq, before)
            if not row.needs_logits:
                continue
            targets.append((request, seq))
            logit_rows.append(logit_index)
            if seq.index == 0 and request.sequences[-1].awaiting_fork:
                for child in self._fork(request, seq):  # the choices sample from the same logits
                    targets.append((request, child))
                    logit_rows.append(logit_index)
            logit_index += 1
        if not targets:
            return []
        if logit_rows != list(range(logit_index)):
            logits = logits[logit_rows]
        constrained = [i for i, (_, seq) in enumerate(targets) if seq.matcher is not None]
        raw_logits = logits
        if constrained:
            logits = self._mask_constrained(logits, targets, constrained)
        if all(request.options.plain_greedy for request, _ in targets):
            tokens, logprobs = logits.max(dim=-1).indices.tolist(), None  # the common fast path
        else:
            tokens, logprobs = sample_batch(logits, [self._sample_row(request, seq) for request, seq in targets],
                                            raw_logits=raw_logits)
        complete = self._advance_constrained(targets, constrained, tokens) if constrained else ()
        now = time.monotonic()
        outputs: StepOutputs = []
        done: list[Request] = []
        for i, (request, seq) in enumerate(targets):
            if request.first_token_time is None:
                request.first_token_time = now
            output = self._append(request, seq, tokens[i], logprobs[i] if logprobs is not None else None,
                                  i in complete)
            outputs.append((request, output))
            if output.finish_reason is not None:
                self._running_sequences -= 1
                self._release(seq)
                if request.finished and (not done or done[-1] is not request):
                    done.append(request)
        for request in done:
            self.running.remove(request)
            request.is_running = False
            self._retire(request)
        return outputs

    def _mask_constrained(self, logits, targets: list[tuple[Request, Sequence]], constrained: list[int]):
        """The logits with every token the constrained rows' grammars refuse at -inf (one batched
        mask; on a copy when a row wants logprobs, which are those of the raw distribution)."""
        if self._token_masks is None:
            self._token_masks = constraints.TokenMasks(logits.shape[-1])
        if any(request.options.wants_logprobs for request, _ in targets):
            logits = logits.clone()
        self._token_masks.apply(logits, constrained, [targets[i][1].matcher for i in constrained])
        return logits

    def _advance_constrained(self, targets: list[tuple[Request, Sequence]], constrained: list[int],
                             tokens: list[int]) -> set[int]:
        """Feed the sampled tokens to the matchers; the rows whose structure is now complete."""
        finished = self._token_masks.advance([targets[i][1].matcher for i in constrained],
                                             [tokens[i] for i in constrained])
        return {i for i, done in zip(constrained, finished) if done}

    def _sample_row(self, request: Request, seq: Sequence) -> SampleRow:
        options = request.options
        banned: frozenset[int] = frozenset()
        if len(seq.output_ids) < options.min_tokens and seq.matcher is None:
            # EOS and stop ids may not end it yet (a grammar decides where a constrained row may end)
            banned = options.stop_token_ids if options.ignore_eos else options.stop_token_ids | self.eos_token_ids
        return SampleRow(options, seq, request.prompt_ids, banned)

    def _fork(self, request: Request, parent: Sequence) -> list[Sequence]:
        """Choices 1..n-1 start from choice 0's prompt KV: full blocks shared, the partial one copied."""
        block_size = self.block_size
        prompt_len = len(request.prompt_ids)
        full = prompt_len // block_size
        shared = parent.block_table[:full]
        children = [seq for seq in request.sequences if seq.awaiting_fork]
        spare = request.fork_blocks
        request.fork_blocks = []
        for child in children:
            child.awaiting_fork = False
            self.allocator.share(shared)
            child.block_table = list(shared)
            if prompt_len % block_size:
                block = spare.pop()
                self.cache.copy_block(parent.block_table[full], block)
                child.block_table.append(block)
            child.num_computed = parent.num_computed
        return children

    def _append(self, request: Request, seq: Sequence, token_id: int, logprobs,
                structure_complete: bool = False) -> ChoiceOutput:
        options = request.options
        seq.output_ids.append(token_id)
        count = len(seq.output_ids)
        if count >= options.min_tokens and (
                (not options.ignore_eos and token_id in self.eos_token_ids) or token_id in options.stop_token_ids):
            seq.finish_reason = FinishReason.STOP
            seq.matched_stop_token_id = token_id
        elif structure_complete:  # the grammar took its end (an EOS token) or can take nothing more
            seq.finish_reason = FinishReason.STOP
            if token_id in self.eos_token_ids or token_id in options.stop_token_ids:
                seq.matched_stop_token_id = token_id
        elif count >= options.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        lp = (logprobs,) if logprobs is not None else ()
        if seq.finish_reason is not None:
            return ChoiceOutput(seq.index, (token_id,), seq.finish_reason, seq.matched_stop_token_id,
                                request.usage_for(seq), lp)
        return ChoiceOutput(seq.index, (token_id,), logprobs=lp)

    def _final_output(self, request: Request, seq: Sequence, token_ids: tuple[int, ...]) -> ChoiceOutput:
        return ChoiceOutput(seq.index, token_ids, finish_reason=seq.finish_reason,
                            matched_stop_token_id=seq.matched_stop_token_id, usage=request.usage_for(seq))

    # ---------------------------------------------------------------- KV bookkeeping

    def _release(self, seq: Sequence) -> None:
        if seq.block_table:
            self.allocator.release(seq.block_table)
            seq.block_table = []

    def _free_blocks(self, request: Request) -> None:
        for seq in request.sequences:
            self._release(seq)
        if request.fork_blocks:
            self.allocator.release(request.fork_blocks)
            request.fork_blocks = []

    def _retire(self, request: Request) -> None:
        self._free_blocks(request)
        request.finish_time = time.monotonic()
        self.finished_requests += 1
        _log_finished(request)


def _chunk(request: Request, start: int, count: int) -> int:
    """The prefill chunk length from `start` within `count` (the budget), moved so it splits no
    bidirectional span of the prompt (forward.fit_chunk_end); 0: wait for the next step."""
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


def _without(rows, owners, request):
    kept = [(row, owner) for row, owner in zip(rows, owners) if owner[0] is not request]
    return [row for row, _ in kept], [owner for _, owner in kept]


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
