"""Request-level observations of the engine, the same for both backends: latency histograms,
token counts, prefix-cache use, finish reasons (metrics), and the queue/prefill/decode spans
of a request (tracing).

`RequestObserver.observe(outputs)` wraps a backend's output stream for one Generate call. TTFT,
time per output token and end-to-end latency are measured here, on the serving side's clock,
from the call's start to the outputs as the service hands them out (so they include the trip
from the model's process, as a client sees it). Queue time and the engine spans come from the
`RequestTimings` the backend attaches to the request's last output (the native core's request
timestamps; vLLM's RequestStateStats). The engine's state (running and waiting requests, KV
blocks, encoder cache) is read from its load snapshot at scrape time (`load_collector`).

Nothing here imports grpc; prometheus_client only through tito.metrics when metrics are on.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from tito import tracing

from tito_engine.backend.interface import LoadSnapshot
from tito_engine.request import ChoiceOutput, RequestTimings


class EngineMetrics:
    """The engine's own series in a server's registry (tito.metrics.ServiceMetrics)."""

    def __init__(self, metrics: Any, load: Callable[[], LoadSnapshot | None]) -> None:
        from tito.metrics import TOKEN_LATENCY_BUCKETS, ScrapeTimeCollector

        self.queue_seconds = metrics.histogram(
            "engine_queue_time_seconds", "Time a request waited in the engine's queue before it first ran")
        self.ttft_seconds = metrics.histogram(
            "engine_time_to_first_token_seconds", "Time from a Generate call's start to its first token")
        self.tpot_seconds = metrics.histogram(
            "engine_time_per_output_token_seconds",
            "Mean time between a request's output tokens after the first", buckets=TOKEN_LATENCY_BUCKETS)
        self.e2e_seconds = metrics.histogram(
            "engine_e2e_request_latency_seconds", "Time from a Generate call's start to its last output")
        self.prompt_tokens = metrics.counter("engine_prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = metrics.counter("engine_generation_tokens", "Tokens generated (all choices)")
        self.prefix_queries = metrics.counter(
            "engine_prefix_cache_queries", "Prompt tokens looked up in the prefix cache (finished requests)")
        self.prefix_hits = metrics.counter(
            "engine_prefix_cache_hits", "Prompt tokens whose KV came from the prefix cache (finished requests)")
        self.kv_blocks_pulled = metrics.counter(
            "engine_kv_transfer_blocks_pulled", "KV blocks decode requests pulled from the engines that prefilled them")
        self.finished = metrics.counter(
            "engine_requests_finished", "Requests ended, by the finish reason of their last choice",
            ("finish_reason",))
        metrics.add_collector(ScrapeTimeCollector(lambda: load_families(load())))


def load_families(load: LoadSnapshot | None) -> list:
    """The load snapshot as gauge and counter families (nothing while the model loads)."""
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    if load is None:
        return []
    gauges = (("engine_requests_running", "Choices being generated now", load.running_requests),
              ("engine_requests_waiting", "Choices queued for a slot", load.waiting_requests),
              ("engine_kv_blocks_used", "KV cache blocks in use", load.kv_blocks_used),
              ("engine_kv_blocks_total", "KV cache blocks in all", load.kv_blocks_total),
              ("engine_kv_cache_usage_ratio", "Fraction of the KV cache in use (0-1)",
               load.kv_blocks_used / load.kv_blocks_total if load.kv_blocks_total else 0.0))
    counters = (("engine_encoder_cache_hits", "Media items whose encoder output came from the encoder cache",
                 load.encoder_cache_hits),
                ("engine_encoder_cache_misses", "Media items that had to be encoded", load.encoder_cache_misses))
    return ([GaugeMetricFamily("tito_" + name, text, value=value) for name, text, value in gauges]
            + [CounterMetricFamily("tito_" + name, text, value=value) for name, text, value in counters])


class RequestObserver:
    """Wraps Generate streams with the observations that are on (metrics, tracing or both)."""

    def __init__(self, metrics: EngineMetrics | None) -> None:
        self._metrics = metrics

    def pulled(self, transfer: Any) -> None:
        """Count the KV blocks a decode request pulled (its kv_transfers.Transfer; None, a
        prefill's: nothing), when it pulled them: before it runs, whatever becomes of it."""
        stats = getattr(transfer, "stats", None)
        if self._metrics is not None and stats is not None:
            self._metrics.kv_blocks_pulled.inc(stats.blocks_pulled)

    @property
    def active(self) -> bool:
        return self._metrics is not None or tracing.enabled()

    async def observe(self, outputs: AsyncIterator[ChoiceOutput]) -> AsyncIterator[ChoiceOutput]:
        started = time.monotonic()
        first = last = 0.0
        generated = 0
        longest = 0  # tokens of the longest choice: its gaps are what a caller waits through
        per_choice: dict[int, int] = {}
        final: ChoiceOutput | None = None
        try:
            async for output in outputs:
                now = time.monotonic()
                if output.token_ids:
                    if not first:
                        first = now
                    last = now
                    generated += len(output.token_ids)
                    count = per_choice[output.index] = per_choice.get(output.index, 0) + len(output.token_ids)
                    longest = max(longest, count)
                if output.finished:
                    final = output
                yield output
        finally:
            try:
                await outputs.aclose()  # closing this stream early aborts the request, as unwrapped
            finally:
                self._record(started, first, last, generated, longest, final)

    def _record(self, started: float, first: float, last: float, generated: int, longest: int,
                final: ChoiceOutput | None) -> None:
        timings = final.timings if final is not None else None
        if timings is not None:
            _record_spans(timings)
        metrics = self._metrics
        if metrics is None:
            return
        metrics.generation_tokens.inc(generated)
        if first:
            metrics.ttft_seconds.observe(first - started)
            metrics.e2e_seconds.observe(last - started)
            if longest > 1:
                metrics.tpot_seconds.observe((last - first) / (longest - 1))
        if timings is not None and timings.scheduled is not None:
            metrics.queue_seconds.observe(max(0.0, timings.scheduled - timings.arrival))
        if final is not None:
            metrics.finished.labels(final.finish_reason.value).inc()
            if final.usage is not None:
                metrics.prompt_tokens.inc(final.usage.prompt_tokens)
                metrics.prefix_queries.inc(final.usage.prompt_tokens)
                metrics.prefix_hits.inc(final.usage.cached_tokens)


def _record_spans(timings: RequestTimings) -> None:
    """engine.queue, engine.prefill and engine.decode as children of the Generate call's span."""
    if not tracing.enabled():
        return
    if timings.scheduled is None:
        tracing.record_span("engine.queue", timings.arrival, timings.finished)
        return
    tracing.record_span("engine.queue", timings.arrival, timings.scheduled)
    if timings.first_token is None:
        return
    tracing.record_span("engine.prefill", timings.scheduled, timings.first_token)
    tracing.record_span("engine.decode", timings.first_token, timings.finished)
