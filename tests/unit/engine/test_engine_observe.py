"""The engine's request observer: what it measures from a stream, that closing the observed
stream closes the backend's (the request is aborted as without it), and vLLM's timestamps."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

from tito_engine.backend.observe import RequestObserver
from tito_engine.request import ChoiceOutput, FinishReason, RequestTimings, Usage
from tito_engine.vllm.inputs import request_timings


class _Recorder:
    def __init__(self):
        self.values = []

    def observe(self, value):
        self.values.append(value)

    def inc(self, amount=1):
        self.values.append(amount)

    def labels(self, *labels):
        self.values.append(labels)
        return self


def _metrics():
    names = ("queue_seconds", "ttft_seconds", "tpot_seconds", "e2e_seconds", "prompt_tokens", "generation_tokens",
             "prefix_queries", "prefix_hits", "finished")
    return SimpleNamespace(**{name: _Recorder() for name in names})


async def _stream(outputs, closed: list):
    try:
        for output in outputs:
            yield output
            await asyncio.sleep(0)
    finally:
        closed.append(True)


def test_a_finished_stream_is_measured():
    metrics = _metrics()
    timings = RequestTimings(arrival=10.0, scheduled=10.25, first_token=10.5, finished=11.0)
    outputs = [ChoiceOutput(0, (1, 2)), ChoiceOutput(0, (3,), FinishReason.LENGTH, usage=Usage(7, 3, 4),
                                                     timings=timings)]

    async def run():
        closed = []
        seen = [output async for output in RequestObserver(metrics).observe(_stream(outputs, closed))]
        return seen, closed

    seen, closed = asyncio.run(run())
    assert seen == outputs and closed == [True]
    assert metrics.queue_seconds.values == [0.25]
    assert metrics.generation_tokens.values == [3]
    assert metrics.prompt_tokens.values == [7] and metrics.prefix_queries.values == [7]
    assert metrics.prefix_hits.values == [4]
    assert metrics.finished.values == [("length",), 1]
    assert len(metrics.ttft_seconds.values) == len(metrics.e2e_seconds.values) == len(metrics.tpot_seconds.values) == 1


def test_closing_the_observed_stream_closes_the_backend_stream():
    metrics = _metrics()

    async def run():
        closed = []
        observed = RequestObserver(metrics).observe(_stream([ChoiceOutput(0, (1,)), ChoiceOutput(0, (2,))], closed))
        await observed.__anext__()
        await observed.aclose()
        return closed

    assert asyncio.run(run()) == [True]  # the backend aborts the request when its stream is closed
    assert metrics.finished.values == [] and metrics.queue_seconds.values == []
    assert len(metrics.ttft_seconds.values) == 1


def test_vllm_request_stats_become_request_timings():
    stats = SimpleNamespace(queued_ts=5.0, scheduled_ts=5.5, first_token_ts=6.0, last_token_ts=7.0)
    assert request_timings(stats) == RequestTimings(5.0, 5.5, 6.0, 7.0)
    never_ran = SimpleNamespace(queued_ts=5.0, scheduled_ts=0.0, first_token_ts=0.0, last_token_ts=0.0)
    assert request_timings(never_ran) == RequestTimings(5.0, None, None, 5.0)
    assert request_timings(None) is None
    assert request_timings(SimpleNamespace(queued_ts=0.0)) is None
