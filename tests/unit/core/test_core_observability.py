"""Observability switches: when tracing turns on, the metrics port's validation, where /metrics
listens, and that with both off nothing of prometheus_client or opentelemetry is imported."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tito import tracing
from tito.config import ConfigError, ServerConfig
from tito.metrics import metrics_host


@pytest.mark.parametrize("environ, flag, expected", [
    ({}, False, False),
    ({}, True, True),
    ({"OTEL_TRACES_EXPORTER": "otlp"}, False, True),
    ({"OTEL_TRACES_EXPORTER": "console"}, False, True),
    ({"OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, False, True),
    ({"OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": "http://collector:4318/v1/traces"}, False, True),
    ({"OTEL_TRACES_EXPORTER": "none", "OTEL_EXPORTER_OTLP_ENDPOINT": "http://collector:4317"}, True, False),
    ({"OTEL_SDK_DISABLED": "true"}, True, False),
    ({"OTEL_SERVICE_NAME": "x"}, False, False),  # naming the service alone does not turn tracing on
])
def test_tracing_is_wanted_by_the_flag_or_the_standard_variables(environ, flag, expected):
    assert tracing.wanted(flag, environ) is expected


@pytest.mark.parametrize("port", [-1, 65536])
def test_metrics_port_must_be_a_tcp_port(port):
    with pytest.raises(ConfigError, match="metrics_port"):
        ServerConfig(metrics_port=port).validate()


def test_metrics_port_zero_and_none_are_valid():
    ServerConfig(metrics_port=0).validate()
    ServerConfig(metrics_port=None).validate()


@pytest.mark.parametrize("address, host", [
    ("127.0.0.1:50051", "127.0.0.1"), ("0.0.0.0:50051", "0.0.0.0"), ("[::1]:50051", "::1"),
    ("unix:/tmp/render.sock", "127.0.0.1")])
def test_metrics_listen_on_the_grpc_host(address, host):
    assert metrics_host(address) == host


def test_off_means_no_spans_no_metadata():
    assert not tracing.enabled()
    with tracing.span("anything", key=1):
        pass
    assert tracing.inject() is None
    assert tracing.inject([("x-request-id", "r")]) == [("x-request-id", "r")]
    assert tracing.begin_client_span("chat") is None


def test_with_both_off_neither_library_is_imported():
    """The servers, the pipeline client and the domain modules import neither prometheus_client
    nor opentelemetry until metrics or tracing is turned on."""
    code = ("import sys\n"
            "import tito.serving, tito_client.pipeline, tito_cli.main\n"
            "import tito_render.server, tito_engine.server, tito_derender.server\n"
            "loaded = sorted(name for name in sys.modules if name.split('.')[0] in "
            "('prometheus_client', 'opentelemetry'))\n"
            "print(loaded)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert result.stdout.strip() == "[]", result.stdout
