"""The one place where errors become gRPC statuses.

`ErrorMappingInterceptor` wraps every handler of the services a server lists (tito.v1's, and a
protocol face's such as the engine's `vllm.grpc.engine.VllmEngine`; never health or reflection).
A `TitoError` raised by domain code becomes its status code with `google.rpc.ErrorInfo` (reason,
domain, metadata) and, for field problems, `google.rpc.BadRequest` details. Anything else is a
bug: it is logged with its traceback and answered INTERNAL with a generic message. Cancellation
passes through untouched.

Two guarantees hold for every RPC, whatever the caller sends:
- Request bytes that do not parse as the method's message (random bytes, truncations, invalid
  UTF-8 in a string field, nesting past protobuf's limit), on unary and streaming requests alike,
  are INVALID_ARGUMENT `MALFORMED_REQUEST`: the interceptor parses requests itself instead of
  letting grpc answer UNKNOWN or INTERNAL.
- A status fits comfortably in the 8 KB of trailers a client accepts: the message, each field
  violation and each metadata value are clipped (`MAX_MESSAGE_CHARS` and the like), and at most
  `MAX_VIOLATIONS` violations are sent, so a caller's huge field value can never crowd out the
  details.
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

from tito.errors import InvalidArgument, TitoError
from tito.logs import bind_request_id

log = logging.getLogger(__name__)

ERROR_DOMAIN = "tito.dev"
TITO_METHOD_PREFIX = "/tito.v1."
MALFORMED_REQUEST = "MALFORMED_REQUEST"
# Bounds on what a status carries, in characters. The status travels twice in the trailers (the
# message as grpc-message, the whole status base64-encoded as grpc-status-details-bin), so it is
# kept near 3 KB: both fit in the 8 KB of trailers a client accepts, with room to spare.
MAX_MESSAGE_CHARS = 512
MAX_FIELD_CHARS = 128
MAX_DESCRIPTION_CHARS = 200
MAX_METADATA_ENTRIES = 4
MAX_METADATA_CHARS = 128
MAX_VIOLATIONS = 5


def clip(text: str, limit: int) -> str:
    """`text` cut to at most `limit` characters, saying how many were left out."""
    if len(text) <= limit:
        return text
    kept = max(0, limit - len(f"... ({len(text)} more characters)"))
    return f"{text[:kept]}... ({len(text) - kept} more characters)"


def status_for(error: TitoError) -> status_pb2.Status:
    """Build the rich google.rpc.Status for a domain error (bounded in size, see module docstring)."""
    details = []
    metadata = {clip(key, MAX_FIELD_CHARS): clip(value, MAX_METADATA_CHARS)
                for key, value in list(error.metadata.items())[:MAX_METADATA_ENTRIES]}
    info = error_details_pb2.ErrorInfo(reason=error.reason, domain=ERROR_DOMAIN, metadata=metadata)
    details.append(info)
    if error.violations:
        details.append(error_details_pb2.BadRequest(field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field=clip(v.field, MAX_FIELD_CHARS),
                                                        description=clip(v.description, MAX_DESCRIPTION_CHARS))
            for v in error.violations[:MAX_VIOLATIONS]
        ]))
    packed = []
    for d in details:
        a = any_pb2.Any()
        a.Pack(d)
        packed.append(a)
    message = error.message
    if len(error.violations) > MAX_VIOLATIONS:
        message += f" ({len(error.violations) - MAX_VIOLATIONS} more field violations not listed)"
    return status_pb2.Status(code=getattr(code_pb2, error.code_name), message=clip(message, MAX_MESSAGE_CHARS),
                             details=packed)


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


class _Undecodable:
    """Stands in for a request message whose bytes did not parse (see `_tolerant`)."""

    def __init__(self, type_name: str, error: Exception):
        self.type_name = type_name
        self.error = error

    def refusal(self) -> InvalidArgument:
        return InvalidArgument(f"the request could not be parsed as a {self.type_name} message: "
                               f"{clip(str(self.error) or type(self.error).__name__, 200)}",
                               reason=MALFORMED_REQUEST)


def _tolerant(deserialize: Callable | None) -> Callable | None:
    """A request deserializer that never raises: grpc would answer a raising one UNKNOWN or
    INTERNAL. Bytes that do not parse become an `_Undecodable`, refused by the handler wrapper."""
    if deserialize is None:
        return None
    owner = getattr(deserialize, "__self__", None)
    type_name = getattr(getattr(owner, "DESCRIPTOR", None), "full_name", "request")

    def parse(data: bytes):
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - DecodeError, RecursionError, whatever the parser raises
            return _Undecodable(type_name, exc)
    return parse


def _checked(request):
    """The request itself, or (for a request stream) an iterator that refuses undecodable items."""
    if isinstance(request, _Undecodable):
        raise request.refusal()
    if hasattr(request, "__aiter__"):
        return _checked_stream(request)
    return request


async def _checked_stream(requests) -> AsyncIterator:
    async for request in requests:
        if isinstance(request, _Undecodable):
            raise request.refusal()
        yield request


def _wrap(behavior: Callable, method: str, streaming_response: bool) -> Callable:
    if streaming_response and inspect.isasyncgenfunction(behavior):
        async def stream_wrapper(request, context) -> AsyncIterator:
            _request_id_from(context)
            try:
                async for item in behavior(_checked(request), context):
                    yield item
            except (asyncio.CancelledError, grpc.aio.AbortError):
                raise
            except Exception as exc:  # noqa: BLE001 - this is the single mapping point
                await _abort(context, exc, method)
        return stream_wrapper

    async def unary_wrapper(request, context):
        _request_id_from(context)
        try:
            return await behavior(_checked(request), context)
        except (asyncio.CancelledError, grpc.aio.AbortError):
            raise
        except Exception as exc:  # noqa: BLE001 - this is the single mapping point
            await _abort(context, exc, method)
    return unary_wrapper


def method_prefixes(service_names) -> tuple[str, ...]:
    """The method-path prefixes of the named services ("/pkg.Service/")."""
    return tuple(f"/{name}/" for name in service_names)


class ErrorMappingInterceptor(grpc.aio.ServerInterceptor):
    """Maps exceptions from the handlers of the methods under `prefixes` (default: every tito.v1
    service) to rich statuses (see module docstring).

    Services are registered before the server starts and never change, so each method's
    wrapped handler is built once and reused: per call the interceptor costs one dict lookup.
    """

    def __init__(self, prefixes: tuple[str, ...] = (TITO_METHOD_PREFIX,)) -> None:
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}
        self._prefixes = prefixes

    async def intercept_service(self, continuation, handler_call_details):
        method = handler_call_details.method
        cached = self._wrapped.get(method)
        if cached is not None:
            return cached
        handler = await continuation(handler_call_details)
        if handler is None or not method.startswith(self._prefixes):
            return handler
        self._wrapped[method] = wrapped = self._wrap_handler(handler, method)
        return wrapped

    @staticmethod
    def _wrap_handler(handler: grpc.RpcMethodHandler, method: str) -> grpc.RpcMethodHandler:
        return wrap_handler(handler, lambda behavior, streaming: _wrap(behavior, method, streaming),
                            request_deserializer=_tolerant(handler.request_deserializer))


_HANDLER_KINDS = {
    "unary_unary": (grpc.unary_unary_rpc_method_handler, False),
    "unary_stream": (grpc.unary_stream_rpc_method_handler, True),
    "stream_unary": (grpc.stream_unary_rpc_method_handler, False),
    "stream_stream": (grpc.stream_stream_rpc_method_handler, True),
}


def wrap_handler(handler: grpc.RpcMethodHandler, wrap: Callable[[Callable, bool], Callable],
                 request_deserializer: Callable | None = None) -> grpc.RpcMethodHandler:
    """`handler` with its behavior replaced by `wrap(behavior, streaming_response)` (the way every
    tito interceptor wraps a method); the request deserializer too when one is given."""
    for attr, (factory, streaming) in _HANDLER_KINDS.items():
        behavior = getattr(handler, attr)
        if behavior is not None:
            return factory(wrap(behavior, streaming),
                           request_deserializer=request_deserializer or handler.request_deserializer,
                           response_serializer=handler.response_serializer)
    return handler


def error_details(error: grpc.RpcError) -> dict:
    """Client-side helper: decode an RpcError's rich status into {code, message, reason, fields,
    metadata} (metadata: ErrorInfo's)."""
    status = rpc_status.from_call(error)
    result = {"code": error.code(), "message": error.details(), "reason": None, "fields": [], "metadata": {}}
    if status is None:
        return result
    for detail in status.details:
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            result["reason"] = info.reason
            result["metadata"] = dict(info.metadata)
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            result["fields"] = [v.field for v in bad.field_violations]
    return result
