"""The scheduler step: admit waiting requests, advance every running choice by one token.

Runs only on the engine thread (no locks here). Each `step()` returns the outputs produced, which
the engine hands to each request's `deliver` callback. In this phase a step runs one forward per
choice; the next phase swaps in one batched forward per step (ModelRunner) without changing this
module's callers.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from .model_runner import ModelRunner
from .request import ChoiceOutput, FinishReason, Request, Sequence
from .sampler import make_generator, sample

log = logging.getLogger(__name__)


class Scheduler:
    def __init__(self, runner: ModelRunner, max_running_sequences: int):
        self.runner = runner
        self.max_running_sequences = max_running_sequences
        self.eos_token_ids = frozenset(runner.info.eos_token_ids)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.finished_requests = 0

    # ---------------------------------------------------------------- queue management

    def add(self, request: Request) -> None:
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def num_running_sequences(self) -> int:
        return sum(len(request.unfinished()) for request in self.running)

    def abort(self, request: Request) -> list[ChoiceOutput]:
        """Remove `request` wherever it is; return the ABORT outputs of its unfinished choices."""
        if request in self.waiting:
            self.waiting.remove(request)
            request.sequences = [Sequence(i, None) for i in range(request.options.n)]
        elif request in self.running:
            self.running.remove(request)
        else:
            return []  # already finished (or never added)
        outputs = []
        for seq in request.unfinished():
            seq.finish_reason = FinishReason.ABORT
            outputs.append(self._final_output(request, seq, ()))
        self._retire(request)
        return outputs

    # ---------------------------------------------------------------- the step

    def step(self) -> list[tuple[Request, ChoiceOutput | BaseException]]:
        outputs: list[tuple[Request, ChoiceOutput | BaseException]] = []
        admitted = self._admit()
        for request in list(self.running):
            try:
                if request in admitted:
                    produced = self._prefill(request)
                else:
                    produced = self._decode(request)
            except Exception as exc:  # noqa: BLE001 - one bad request must not stop the engine
                log.exception("request failed in the model step", extra={"request_id": request.request_id})
                self.running.remove(request)
                self._retire(request)
                outputs.append((request, exc))
                continue
            outputs.extend((request, output) for output in produced)
            if request.finished:
                self.running.remove(request)
                self._retire(request)
        return outputs

    def _admit(self) -> set[Request]:
        admitted = set()
        room = self.max_running_sequences - self.num_running_sequences()
        while self.waiting and self.waiting[0].options.n <= room:
            request = self.waiting.popleft()
            request.scheduled_time = time.monotonic()
            room -= request.options.n
            self.running.append(request)
            admitted.add(request)
        return admitted

    def _prefill(self, request: Request) -> list[ChoiceOutput]:
        logits, cache = self.runner.prefill(request.prompt_ids)
        options = request.options
        request.sequences = []
        for index in range(options.n):
            seq = Sequence(index, make_generator(options.seed, index, self.runner.device))
            seq.cache = cache if index == 0 else self.runner.fork(cache)
            request.sequences.append(seq)
        outputs = [self._append(request, seq, self._sample(request, seq, logits)) for seq in request.sequences]
        request.first_token_time = time.monotonic()
        return outputs

    def _decode(self, request: Request) -> list[ChoiceOutput]:
        outputs = []
        for seq in request.unfinished():
            logits = self.runner.decode(seq.output_ids[-1], seq.cache)
            outputs.append(self._append(request, seq, self._sample(request, seq, logits)))
        return outputs

    def _sample(self, request: Request, seq: Sequence, logits) -> int:
        options = request.options
        banned: set[int] = set()
        if len(seq.output_ids) < options.min_tokens:
            banned |= options.stop_token_ids
            if not options.ignore_eos:
                banned |= self.eos_token_ids
        return sample(logits, options, seq.generator, banned)

    def _append(self, request: Request, seq: Sequence, token_id: int) -> ChoiceOutput:
        options = request.options
        seq.output_ids.append(token_id)
        if len(seq.output_ids) >= options.min_tokens:
            if (not options.ignore_eos and token_id in self.eos_token_ids) or token_id in options.stop_token_ids:
                seq.finish_reason = FinishReason.STOP
                seq.matched_stop_token_id = token_id
        if seq.finish_reason is None and len(seq.output_ids) >= options.max_tokens:
            seq.finish_reason = FinishReason.LENGTH
        if seq.finished:
            seq.free()
            return self._final_output(request, seq, (token_id,))
        return ChoiceOutput(seq.index, (token_id,))

    def _final_output(self, request: Request, seq: Sequence, token_ids: tuple[int, ...]) -> ChoiceOutput:
        return ChoiceOutput(seq.index, token_ids, finish_reason=seq.finish_reason,
                            matched_stop_token_id=seq.matched_stop_token_id, usage=request.usage_for(seq))

    def _retire(self, request: Request) -> None:
        for seq in request.sequences:
            seq.free()
        request.finish_time = time.monotonic()
        self.finished_requests += 1
        _log_finished(request)


def _log_finished(request: Request) -> None:
    completion = sum(len(seq.output_ids) for seq in request.sequences)
    reasons = ",".join(seq.finish_reason.value if seq.finish_reason else "?" for seq in request.sequences)
    end = request.finish_time or time.monotonic()
    queue_s = (request.scheduled_time or end) - request.arrival_time
    ttft = f"{(request.first_token_time - request.arrival_time) * 1000:.1f}ms" if request.first_token_time else "-"
    if request.first_token_time and completion > len(request.sequences):
        steps = max(max(len(seq.output_ids) for seq in request.sequences) - 1, 1)
        tpot = f"{(end - request.first_token_time) / steps * 1000:.2f}ms"
    else:
        tpot = "-"
    log.info("finished: prompt_tokens=%d completion_tokens=%d queue=%.1fms ttft=%s tpot=%s finish=%s",
             len(request.prompt_ids), completion, queue_s * 1000, ttft, tpot, reasons,
             extra={"request_id": request.request_id})
