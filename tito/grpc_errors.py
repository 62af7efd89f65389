"""The one place where errors become gRPC statuses.

`ErrorMappingInterceptor` wraps every tito.v1 handler of a server. A `TitoError` raised by domain
code becomes its status code with `google.rpc.ErrorInfo` (reason, domain, metadata) and, for
field problems, `google.rpc.BadRequest` details. Anything else is a bug: it is logged with its
traceback and answered INTERNAL with a generic message. Cancellation passes through untouched.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable

import grpc
from google.protobuf import any_pb2
from google.rpc import code_pb2, error_details_pb2, status_pb2
from grpc_status import rpc_status

from tito.errors import TitoError
from tito.logs import bind_request_id

log = logging.getLogger(__name__)

ERROR_DOMAIN = "tito.dev"
TITO_METHOD_PREFIX = "/tito.v1."


def status_for(error: TitoError) -> status_pb2.Status:
    """Build the rich google.rpc.Status for a domain error."""
    details = []
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=error.metadata)
    details.append(info)
    if error.violations:
        details.append(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=v.field, description=v.description)
            for v in error.violations
        ]))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    return status_pb2.Status(code=getattr(code_pb2, error.code_name), message=error.message, details=packed)


def internal_status() -> status_pb2.Status:
    info = any_pb2.Any()
    info.Pack(error_details_pb2.ErrorInfo(reason="INTERNAL_ERROR", domain=ERROR_DOMAIN))
    return status_pb2.Status(code=code_pb2.INTERNAL,
                             message="internal error in tito (a bug); see the server log",
                             details=[info])


async def _abort(context: grpc.aio.ServicerContext, exc: BaseException, method: str) -> None:
    if isinstance(exc, TitoError):
        log.info("%s rejected: %s %s: %s", method, exc.code_name, exc.reason, exc.message)
        status = status_for(exc)
    else:
        log.exception("%s failed with an unexpected error", method, exc_info=exc)
        status = internal_status()
    await context.abort_with_status(rpc_status.to_status(status))


def _request_id_from(context: grpc.aio.ServicerContext) -> None:
    for key, value in context.invocation_metadata() or ():
        if key == "x-request-id":
            bind_request_id(value)
            return
    bind_request_id("-")


def _wrap(behavior: Callable, method: str, streaming_response: bool) -> Callable:
    if streaming_response and inspect.isasyncgenfunction(behavior):
        async def stream_wrapper(request, context) -> AsyncIterator:
            _request_id_from(context)
            try:
                async for item in behavior(request, context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - this is the single mapping point
                await _abort(context, exc, method)
        return stream_wrapper

    async def unary_wrapper(request, context):
        _request_id_from(context)
        try:
            return await behavior(request, context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - this is the single mapping point
            await _abort(context, exc, method)
    return unary_wrapper


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions from tito.v1 handlers to rich statuses (see module docstring).

    Services are registered before the server starts and never change, so each method's
    wrapped handler is built once and reused: per call the interceptor costs one dict lookup.
    """

    def __init__(self) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None:
            return cached
        handler = await continuation(handler_call_details)
        if handler is None or not method.startswith(TITO_METHOD_PREFIX):
            return handler
        self._wrapped[method] = wrapped = self._wrap_handler(handler, method)
        return wrapped

    @staticmethod
    def _wrap_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        kinds = {
            "unary_unary": (grpc.unary_unary_rpc_method_handler, False),
            "unary_stream": (grpc.unary_stream_rpc_method_handler, True),
            "stream_unary": (grpc.stream_unary_rpc_method_handler, False),
            "stream_stream": (grpc.stream_stream_rpc_method_handler, True),
        }
        for attr, (factory, streaming) in kinds.items():
            behavior = getattr(handler, attr)
            if behavior is not None:
                return factory(_wrap(behavior, method, streaming),
                               request_deserializer=handler.request_deserializer,
                               response_serializer=handler.response_serializer)
        return handler


def error_details(error: grpc.RpcError) -> dict:
    """Client-side helper: decode an RpcError's rich status into {reason, fields, message}."""
    status = rpc_status.from_call(error)
    result = {"code": error.code(), "message": error.details(), "reason": None, "fields": []}
    if status is None:
        return result
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            result["reason"] = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            result["fields"] = [v.field for v in bad.field_violations]
    return result
