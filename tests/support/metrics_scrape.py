"""Reading a started server's Prometheus /metrics (a server started with metrics_port=0)."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


def scrape(server) -> dict[tuple[str, tuple], float]:
    """GET /metrics: {(sample name, sorted labels): value}."""
    with urllib.request.urlopen(f"http://{server.running.metrics.address}/metrics", timeout=10) as reply:
        assert reply.status == 200
        text = reply.read().decode()
    return {(sample.name, tuple(sorted(sample.labels.items()))): sample.value
            for family in text_string_to_metric_families(text) for sample in family.samples}
