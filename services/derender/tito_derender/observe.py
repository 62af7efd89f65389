"""Derender's metrics: chunks sent, choices finished, tokens turned into text, what the parsers
made of them (tool calls, malformed markup degraded to content, reasoning split), and the live
streams (tito.metrics; only built with --metrics-port).

A stream's counts are added when it ends (one update per stream, not one per chunk); a
DerenderFull call's choices, tokens and parser outcomes count like a stream's."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tito_derender.stream import DerenderStream

#: tito_derender_parser_outcomes_total{outcome}: what each outcome counts.
OUTCOMES = ("tool_call", "malformed_to_content", "reasoning_split")


class DerenderMetrics:
    def __init__(self, metrics: Any, live_streams: Callable[[], int]) -> None:
        from prometheus_client.core import GaugeMetricFamily

        from tito.metrics import ScrapeTimeCollector

        self.streams = metrics.counter("derender_streams", "Derender streams ended (any way)")
        self.chunks = metrics.counter("derender_chunks", "Chat chunks sent on Derender streams")
        self.choices = metrics.counter("derender_choices_finished", "Choices finished, by finish reason",
                                       ("finish_reason",))
        self.completion_tokens = metrics.counter("derender_completion_tokens",
                                                 "Engine tokens turned into text (all choices)")
        self.parser_outcomes = metrics.counter(
            "derender_parser_outcomes",
            "Parser results: tool_call (a call parsed), malformed_to_content (a call's broken or cut-off "
            "markup sent back as content), reasoning_split (a choice's reasoning split from its content)",
            ("parser", "outcome"))
        metrics.add_collector(ScrapeTimeCollector(lambda: [GaugeMetricFamily(
            "tito_derender_streams_active", "Derender streams holding state now", value=live_streams())]))

    def stream_ended(self, stream: DerenderStream | None, chunks: int) -> None:
        """A Derender stream ended (any way; `stream` is None when no context came)."""
        self.streams.inc()
        self.chunks.inc(chunks)
        if stream is not None:
            self.choices_done(stream)

    def choices_done(self, stream: DerenderStream) -> None:
        """The choices of a request (a Derender stream or a DerenderFull call), when it ends."""
        context = stream.context
        for choice in stream.choices():
            if choice.finish_reason is not None:
                self.choices.labels(choice.finish_reason.value).inc()
            self.completion_tokens.inc(choice.completion_tokens)
        outcomes = stream.parser_outcomes()
        tool_parser = context.tool_parser or "none"
        if outcomes.tool_calls:
            self.parser_outcomes.labels(tool_parser, "tool_call").inc(outcomes.tool_calls)
        if outcomes.malformed_calls:
            self.parser_outcomes.labels(tool_parser, "malformed_to_content").inc(outcomes.malformed_calls)
        if outcomes.reasoning_splits:
            self.parser_outcomes.labels(context.reasoning_parser or "none", "reasoning_split").inc(
                outcomes.reasoning_splits)
