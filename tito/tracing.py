"""OpenTelemetry tracing, optional and off by default.

On (see `configure`): every RPC becomes a server span, a child of the W3C trace context the
caller sent in its gRPC metadata (`traceparent`, `tracestate`), so one chat that a client runs
through render, engine and derender is one trace. Services add spans for their phases (render:
templating, media, tokenization; engine: queue, prefill, decode). Spans go to an OTLP collector
configured by the standard `OTEL_*` environment variables.

Off: nothing here imports opentelemetry, `span()` returns a shared no-op context manager, and
`inject()` adds no metadata; the cost is a global lookup per call site.

Which environment turns tracing on (besides the `--otel` flag): `OTEL_TRACES_EXPORTER` set to
anything but `none`, or `OTEL_EXPORTER_OTLP_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` set.
`OTEL_SDK_DISABLED=true` keeps it off whatever else says.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from tito.errors import ConfigError

log = logging.getLogger(__name__)

_tracer: Any = None  # an opentelemetry Tracer while tracing is on
_trace: Any = None  # the opentelemetry.trace module while tracing is on
_provider: Any = None  # the TracerProvider `configure` built (flushed and shut down by `shutdown`)
_NO_SPAN = contextlib.nullcontext()
INSTRUMENTATION_NAME = "tito"


def enabled() -> bool:
    return _tracer is not None


def wanted(flag: bool, environ: Mapping[str, str] = os.environ) -> bool:
    """Whether tracing should be on: the flag, or the standard OTEL_* variables (module docstring)."""
    if environ.get("OTEL_SDK_DISABLED", "").strip().lower() == "true":
        return False
    exporter = environ.get("OTEL_TRACES_EXPORTER", "").strip().lower()
    if exporter == "none":
        return False
    return bool(flag or exporter or environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
                or environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT"))


def configure(service: str, flag: bool = False) -> bool:
    """Turn tracing on for this process when wanted (and not on already); returns whether it is on.

    Raises tito.config.ConfigError when tracing is wanted but opentelemetry is not installed or
    `OTEL_TRACES_EXPORTER` names an exporter tito does not know."""
    global _provider
    if enabled() or not wanted(flag):
        return enabled()
    try:
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import BatchSpanProcessor
    except ImportError:
        raise ConfigError("tracing (--otel or OTEL_* variables) needs OpenTelemetry: pip install 'tito[tracing]'"
                          ) from None
    attributes = {} if os.environ.get("OTEL_SERVICE_NAME") else {"service.name": f"tito-{service}"}
    provider = TracerProvider(resource=Resource.create(attributes))
    provider.add_span_processor(BatchSpanProcessor(_exporter(ConfigError)))
    use_provider(provider)
    _provider = provider
    log.info("tracing on: spans to %s", _destination())
    return True


def _destination() -> str:
    if os.environ.get("OTEL_TRACES_EXPORTER", "").strip().lower() == "console":
        return "the console"
    return (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
            or "the OTLP default endpoint (localhost:4317)")


def _exporter(config_error: type[Exception]) -> Any:
    """The span exporter OTEL_TRACES_EXPORTER and OTEL_EXPORTER_OTLP_(TRACES_)PROTOCOL name."""
    kind = os.environ.get("OTEL_TRACES_EXPORTER", "otlp").strip().lower() or "otlp"
    if kind == "console":
        from opentelemetry.sdk.trace.export import ConsoleSpanExporter

        return ConsoleSpanExporter()
    if kind != "otlp":
        raise config_error(f"OTEL_TRACES_EXPORTER={kind!r}: tito exports spans with otlp (default), console or "
                           f"none")
    protocol = (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_PROTOCOL") or os.environ.get("OTEL_EXPORTER_OTLP_PROTOCOL")
                or "grpc").strip().lower()
    if protocol == "grpc":
        from opentelemetry.exporter.otlp.proto.grpc.trace_exporter import OTLPSpanExporter
    elif protocol == "http/protobuf":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    else:
        raise config_error(f"OTEL_EXPORTER_OTLP_PROTOCOL={protocol!r}: use grpc (default) or http/protobuf")
    return OTLPSpanExporter()  # endpoint, headers, timeout, TLS: from the OTEL_EXPORTER_OTLP_* variables


def use_provider(provider: Any) -> None:
    """Trace with `provider` (an opentelemetry TracerProvider), e.g. one with an in-memory exporter."""
    global _tracer, _trace
    from opentelemetry import trace

    _trace = trace
    _tracer = provider.get_tracer(INSTRUMENTATION_NAME)


def shutdown() -> None:
    """Export what is buffered and turn tracing off (at process exit; tests turn it off this way)."""
    global _tracer, _provider, _trace
    provider, _provider, _tracer, _trace = _provider, None, None, None
    if provider is not None:
        provider.shutdown()


# ---------------------------------------------------------------------------------- spans

def span(name: str, **attributes: Any):
    """A child span of the current one around a block; a no-op while tracing is off or when the
    current span is not recorded (a sampler left its trace out: children would be dropped too)."""
    if _tracer is None or not _trace.get_current_span().is_recording():
        return _NO_SPAN
    return _tracer.start_as_current_span(name, attributes=attributes or None)


def add_attributes(**attributes: Any) -> None:
    """Set attributes on the current span (nothing while tracing is off)."""
    if _tracer is None:
        return
    current = _trace.get_current_span()
    if current.is_recording():
        current.set_attributes(attributes)


def record_span(name: str, start_monotonic: float, end_monotonic: float, **attributes: Any) -> None:
    """A finished child span of the current one for work already done elsewhere (e.g. in the
    engine's core process), from `time.monotonic()` readings of this machine."""
    if _tracer is None or end_monotonic < start_monotonic or not _trace.get_current_span().is_recording():
        return
    offset_ns = time.time_ns() - time.monotonic_ns()
    started = _tracer.start_span(name, start_time=int(start_monotonic * 1e9) + offset_ns,
                                 attributes=attributes or None)
    started.end(end_time=int(end_monotonic * 1e9) + offset_ns)


# ---------------------------------------------------------------------------------- propagation

def inject(metadata: Sequence[tuple[str, str]] = (), parent: Any = None) -> list[tuple[str, str]] | None:
    """gRPC call metadata carrying a trace context (W3C traceparent/tracestate): `parent`'s (a span
    from `begin_client_span`) or else the current one, added to `metadata`; None when there is
    nothing to send (tracing off and no metadata given)."""
    if _tracer is None:
        return list(metadata) or None
    from opentelemetry import trace
    from opentelemetry.propagate import inject as otel_inject

    carrier: dict[str, str] = {}
    otel_inject(carrier, context=trace.set_span_in_context(parent) if parent is not None else None)
    return [*metadata, *carrier.items()] or None


@contextlib.contextmanager
def server_span(method: str, invocation_metadata: Sequence[tuple[str, Any]] | None) -> Iterator[Any]:
    """The span of one RPC (kind SERVER), child of the caller's trace context, current inside."""
    from opentelemetry import trace
    from opentelemetry.propagate import extract

    carrier = {key: value for key, value in invocation_metadata or () if isinstance(value, str)}
    service, _, rpc = method.lstrip("/").partition("/")
    with _tracer.start_as_current_span(
            method.lstrip("/"), context=extract(carrier), kind=trace.SpanKind.SERVER,
            attributes={"rpc.system": "grpc", "rpc.service": service, "rpc.method": rpc},
            record_exception=False, set_status_on_exception=False) as current:
        yield current


def end_server_span(current: Any, code_name: str) -> None:
    """Record the RPC's gRPC status on its span (an error status for server-side faults)."""
    from opentelemetry.trace import Status, StatusCode

    current.set_attribute("rpc.grpc.status_code", code_name)
    if code_name in _SERVER_FAULTS:
        current.set_status(Status(StatusCode.ERROR, code_name))


# OpenTelemetry's gRPC conventions: these codes mark a server span as failed.
_SERVER_FAULTS = frozenset({"UNKNOWN", "DEADLINE_EXCEEDED", "UNIMPLEMENTED", "INTERNAL", "UNAVAILABLE",
                            "DATA_LOSS"})


def begin_client_span(name: str, **attributes: Any) -> Any:
    """A span (kind CLIENT, child of the current one if any) for a client's unit of work, e.g. one
    chat, that the client's calls carry with `inject(parent=...)`; None while tracing is off. It is
    not made current: a generator that opens it may be resumed from anywhere. End it with `end_span`."""
    if _tracer is None:
        return None
    from opentelemetry import trace

    return _tracer.start_span(name, kind=trace.SpanKind.CLIENT, attributes=attributes or None)


def end_span(started: Any, error: BaseException | None = None) -> None:
    if started is None:
        return
    if error is not None:
        from opentelemetry.trace import Status, StatusCode

        started.set_status(Status(StatusCode.ERROR, type(error).__name__))
    started.end()
