"""Prometheus metrics of one server: its own registry, the RPC series, and the /metrics endpoint.

Each server builds one `ServiceMetrics` when started with `--metrics-port`. It owns a private
`CollectorRegistry` (never prometheus_client's global one), so several servers in one process
(tests, `tito serve all` in development) keep apart. Services add their own series with
`counter`/`histogram`/`add_collector`; gauges that mirror state another part of the service
already keeps (the engine's load snapshot, derender's live streams) are collectors read at scrape
time, so serving a request costs nothing for them.

Every name starts with `tito_`; the table in docs/metrics.md lists them with their vLLM
counterparts. Without `--metrics-port` none of this is imported.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable, Sequence

from prometheus_client import CollectorRegistry, Counter, Histogram, disable_created_metrics
from prometheus_client.exposition import start_http_server

from tito.errors import ConfigError

log = logging.getLogger(__name__)

PREFIX = "tito_"
#: Seconds, for request-level latencies (TTFT, queue, end-to-end, render): 1 ms to 2 minutes.
LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
                   120.0)
#: Seconds per output token: 1 ms to 2.5 s (vLLM's inter-token buckets span about the same).
TOKEN_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.15, 0.2, 0.3, 0.5, 1.0, 2.5)


class ServiceMetrics:
    """The metrics of one server (`service` is render, engine or derender)."""

    def __init__(self, service: str) -> None:
        # No `*_created` timestamp series beside every counter (as vLLM): they double a scrape for
        # nothing a dashboard uses. The switch is prometheus_client's, for the whole process.
        disable_created_metrics()
        self.service = service
        self.registry = CollectorRegistry()
        self.rpc_requests = self.counter(
            "grpc_requests", "RPCs handled, by method and final gRPC status code", ("method", "code"))
        self.rpc_seconds = self.histogram(
            "grpc_request_duration_seconds", "Time from the start of an RPC to its status, by method",
            ("method",))
        self._http = None
        self._http_thread: threading.Thread | None = None
        self.address = ""  # host:port of /metrics once serving

    def counter(self, name: str, documentation: str, labels: Sequence[str] = ()) -> Counter:
        """A counter named `tito_<name>_total` in this server's registry."""
        return Counter(PREFIX + name, documentation, tuple(labels), registry=self.registry)

    def histogram(self, name: str, documentation: str, labels: Sequence[str] = (),
                  buckets: Iterable[float] = LATENCY_BUCKETS) -> Histogram:
        return Histogram(PREFIX + name, documentation, tuple(labels), registry=self.registry,
                         buckets=tuple(buckets))

    def add_collector(self, collector) -> None:
        """A prometheus collector (an object with `collect()`) read at every scrape."""
        self.registry.register(collector)

    def observe_rpc(self, method: str, code: str, seconds: float) -> None:
        self.rpc_requests.labels(method, code).inc()
        self.rpc_seconds.labels(method).observe(seconds)

    # ------------------------------------------------------------------ the HTTP endpoint

    def serve(self, host: str, port: int) -> str:
        """Serve GET /metrics on host:port (0 = any free port) from a daemon thread; return host:port."""
        try:
            self._http, self._http_thread = start_http_server(port, addr=host, registry=self.registry)
        except OSError as exc:
            raise ConfigError(f"--metrics-port {port}: cannot listen on {host}:{port} ({exc.strerror or exc}); "
                              f"pick another port (0 = any free one)") from None
        self.address = f"{host}:{self._http.server_port}"
        log.info("metrics on http://%s/metrics", self.address)
        return self.address

    def stop(self) -> None:
        if self._http is not None:
            self._http.shutdown()
            self._http.server_close()
            self._http = None


def metrics_host(grpc_address: str) -> str:
    """Where /metrics listens: the host of the gRPC address (a server reachable only on loopback
    keeps its metrics there too); for a unix socket, loopback."""
    if grpc_address.startswith("unix:"):
        return "127.0.0.1"
    host = grpc_address.rsplit(":", 1)[0]
    return host.strip("[]") or "0.0.0.0"


class ScrapeTimeCollector:
    """A collector whose families a function builds at scrape time (from a snapshot the service
    keeps anyway). `describe()` returns nothing, so registering it never calls `build`."""

    def __init__(self, build: Callable[[], Iterable]) -> None:
        self._build = build

    def describe(self) -> list:
        return []

    def collect(self) -> Iterable:
        return self._build()
