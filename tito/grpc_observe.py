"""The one interceptor that observes every RPC of a server: metrics and tracing.

`ObservingInterceptor` sits outermost (before authentication and the error mapping), so it sees
each call's final gRPC status whatever decided it: a handler's answer, an error the mapping turned
into a status, a refused token, a cancelled call. Per call it records
`tito_grpc_requests_total{method,code}` and `tito_grpc_request_duration_seconds{method}` (when
the server has metrics), and for tito.v1 methods opens a server span that continues the caller's
W3C trace context (when tracing is on; tito.tracing; health checks and reflection are not traced).
start_server adds it only when one of them is on.
"""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import AsyncIterator, Callable

import grpc

from tito import tracing
from tito.grpc_errors import TITO_METHOD_PREFIX, wrap_handler


def _code_name(context: grpc.aio.ServicerContext, default: str) -> str:
    """The status the handler set (grpc.aio reports a StatusCode or its integer value)."""
    code = context.code()
    if code is None:
        return default
    if isinstance(code, grpc.StatusCode):
        return code.name
    return _BY_VALUE.get(code, str(code))


_BY_VALUE = {status.value[0]: status.name for status in grpc.StatusCode}


class _Call:
    """One RPC being observed: its clock and its span."""

    __slots__ = ("method", "started", "span", "_span_scope", "_metrics")

    def __init__(self, method: str, context: grpc.aio.ServicerContext, metrics) -> None:
        self.method = method
        self._metrics = metrics
        self.started = time.perf_counter()
        self.span = None
        self._span_scope = None
        # Health checks and reflection are counted but not traced: a probe every few seconds
        # would bury the traces of real work.
        if tracing.enabled() and method.startswith(TITO_METHOD_PREFIX):
            self._span_scope = tracing.server_span(method, context.invocation_metadata())
            self.span = self._span_scope.__enter__()

    def end(self, code: str) -> None:
        if self._metrics is not None:
            self._metrics.observe_rpc(self.method, code, time.perf_counter() - self.started)
        if self._span_scope is not None:
            tracing.end_server_span(self.span, code)
            self._span_scope.__exit__(None, None, None)


def _observe(behavior: Callable, method: str, streaming_response: bool, metrics) -> Callable:
    if streaming_response and inspect.isasyncgenfunction(behavior):
        async def stream_observer(request, context) -> AsyncIterator:
            call = _Call(method, context, metrics)
            code = "UNKNOWN"
            try:
                async for item in behavior(request, context):
                    yield item
                code = _code_name(context, "OK")
            except grpc.aio.AbortError:
                code = _code_name(context, "UNKNOWN")
                raise
            except (asyncio.CancelledError, GeneratorExit):
                code = "CANCELLED"
                raise
            finally:
                call.end(code)
        return stream_observer
    if not inspect.iscoroutinefunction(behavior):
        return behavior  # a synchronous handler (none in tito's servers): left as it is

    async def unary_observer(request, context):
        call = _Call(method, context, metrics)
        code = "UNKNOWN"
        try:
            result = await behavior(request, context)
            code = _code_name(context, "OK")
            return result
        except grpc.aio.AbortError:
            code = _code_name(context, "UNKNOWN")
            raise
        except asyncio.CancelledError:
            code = "CANCELLED"
            raise
        finally:
            call.end(code)
    return unary_observer


class ObservingInterceptor(grpc.aio.ServerInterceptor):
    """Counts, times and traces every RPC (module docstring). `metrics`: a tito.metrics.ServiceMetrics
    or None (tracing only)."""

    def __init__(self, metrics=None) -> None:
        self._metrics = metrics
        # method -> (the inner handler, its observed wrapper). Inner interceptors hand back the same
        # handler object for every call of a method, except one-off handlers (a refused token):
        # a handler that differs is wrapped and becomes the method's entry.
        self._wrapped: dict[str, tuple[grpc.RpcMethodHandler, grpc.RpcMethodHandler]] = {}

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None and cached[0] is handler:
            return cached[1]
        metrics = self._metrics
        wrapped = wrap_handler(handler, lambda behavior, streaming: _observe(behavior, method, streaming, metrics))
        self._wrapped[method] = (handler, wrapped)
        return wrapped
