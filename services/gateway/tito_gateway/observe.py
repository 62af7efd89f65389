"""The gateway's Prometheus series (GET /metrics on the gateway's own address; docs/metrics.md).

A private registry, as every tito server keeps (tito.metrics), with the `tito_gateway_` series:
requests by endpoint and HTTP status, requests in flight, end-to-end time and time to first token
as the client sees them, and the tokens it passed through.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, disable_created_metrics, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

from tito.metrics import LATENCY_BUCKETS, PREFIX

CONTENT_TYPE = CONTENT_TYPE_LATEST


class GatewayMetrics:
    def __init__(self) -> None:
        disable_created_metrics()
        self.registry = CollectorRegistry()
        name = PREFIX + "gateway_"
        self.requests = Counter(name + "requests", "HTTP requests answered, by endpoint and HTTP status",
                                ("endpoint", "status"), registry=self.registry)
        self.in_flight = Gauge(name + "requests_in_flight", "Completions being served now",
                               registry=self.registry)
        self.duration = Histogram(name + "request_duration_seconds",
                                  "Time from a completion request's arrival to its last byte, by endpoint",
                                  ("endpoint",), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.ttft = Histogram(name + "time_to_first_token_seconds",
                              "Time from a streamed completion's arrival to its first token, by endpoint",
                              ("endpoint",), buckets=LATENCY_BUCKETS, registry=self.registry)
        self.prompt_tokens = Counter(name + "prompt_tokens", "Prompt tokens of finished completions",
                                     registry=self.registry)
        self.completion_tokens = Counter(name + "completion_tokens", "Tokens generated for finished completions",
                                         registry=self.registry)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)
