"""The gateway's one error mapping: a TitoError (the gateway's own checks) or a gRPC status from a
service behind it -> an HTTP status and OpenAI's error JSON.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "temperature",
               "code": "INVALID_SAMPLING_PARAMS"}}

`code` is the contract's ErrorInfo reason (proto/tito/v1/errors.proto), `param` the OpenAI
parameter the first field violation names; a reason OpenAI answers itself is spelled as OpenAI
does (`model_not_found`). The HTTP status follows the gRPC status behind it; RESOURCE_EXHAUSTED is
413 for a size limit and 429 otherwise, and an id already in use is 409. A service that refuses
the gateway's own credentials is the deployment's problem, not the caller's: 502.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

import grpc
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tito import kv_params
from tito.errors import TitoError
from tito_client.routing import NoEngineAvailable

log = logging.getLogger(__name__)

UPSTREAM_ERROR = "UPSTREAM_ERROR"
INTERNAL_ERROR = "INTERNAL_ERROR"

STATUS_BY_CODE = {
    "INVALID_ARGUMENT": 400, "FAILED_PRECONDITION": 400, "OUT_OF_RANGE": 400, "UNAUTHENTICATED": 401,
    "PERMISSION_DENIED": 403, "NOT_FOUND": 404, "ALREADY_EXISTS": 409, "ABORTED": 409, "RESOURCE_EXHAUSTED": 429,
    "CANCELLED": 499, "UNKNOWN": 500, "INTERNAL": 500, "DATA_LOSS": 500, "UNIMPLEMENTED": 501,
    "UNAVAILABLE": 503, "DEADLINE_EXCEEDED": 504,
}
#: RESOURCE_EXHAUSTED reasons that are about size (413), not load (429).
SIZE_REASONS = re.compile(r"(TOO_LARGE|TOO_MANY_PIXELS|TOO_LONG)$")
#: Reasons that say the caller's id is already in use: HTTP's 409 Conflict, whatever gRPC status
#: carries them (the engine's INVALID_ARGUMENT for a duplicate request id, which the gateway's
#: caller chose in its x-request-id header).
CONFLICT_REASONS = frozenset({"DUPLICATE_REQUEST_ID"})
#: Reasons OpenAI's API answers itself, spelled as OpenAI spells them (`code`, `type`), so a client
#: written against OpenAI recognises them; every other code is the contract's reason.
OPENAI_SPELLINGS = {"MODEL_NOT_FOUND": ("model_not_found", "invalid_request_error")}
#: Service fields that the gateway's caller sets as an HTTP header, not as a body parameter.
HEADER_FIELDS = {"request_id": "x-request-id"}

TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
         404: "not_found_error", 405: "invalid_request_error", 409: "conflict_error",
         413: "invalid_request_error", 429: "rate_limit_error", 499: "invalid_request_error"}

#: Field-path prefixes of render's and the engine's messages that OpenAI's parameters do not have.
FIELD_PREFIXES = ("sampling_params.", "sampling.", "generate_request.", "request.")
#: The engine's field of a decode request's handle, and where a caller sent it (tito.kv_params):
#: the gateway's requests get a KV transfer only from vLLM's `kv_transfer_params`.
KV_HANDLE = "kv_transfer.decode.handle"


@dataclass(frozen=True)
class HttpError:
    """An error as the gateway answers it."""

    status: int
    message: str
    code: str
    param: str | None = None

    def json(self) -> dict:
        kind = TYPES.get(self.status, "server_error" if self.status >= 500 else "invalid_request_error")
        code, kind = OPENAI_SPELLINGS.get(self.code, (self.code, kind))
        return {"error": {"message": self.message, "type": kind, "param": self.param, "code": code}}


def http_status(code_name: str, reason: str) -> int:
    if code_name == "RESOURCE_EXHAUSTED" and SIZE_REASONS.search(reason):
        return 413
    if reason in CONFLICT_REASONS:
        return 409
    return STATUS_BY_CODE.get(code_name, 500)


def openai_param(field: str | None) -> str | None:
    if not field:
        return None
    if field in HEADER_FIELDS:
        return HEADER_FIELDS[field]
    if field.startswith(kv_params.FIELD):  # named in vLLM's terms already
        return field
    if field.startswith(KV_HANDLE):  # the engine refused the handle kv_transfer_params carried
        return f"{kv_params.FIELD}.{kv_params.HANDLE_KEY}{field[len(KV_HANDLE):]}"
    if field.startswith("kv_transfer"):
        return kv_params.FIELD
    for prefix in FIELD_PREFIXES:
        if field.startswith(prefix):
            return field[len(prefix):]
    return field


def from_tito(error: TitoError) -> HttpError:
    """One of the gateway's own refusals."""
    return HttpError(http_status(error.code_name, error.reason), error.message, error.reason,
                     openai_param(error.field))


def from_rpc(error: grpc.RpcError) -> HttpError:
    """A service's gRPC status, with its ErrorInfo reason and first BadRequest field."""
    code = error.code() if callable(getattr(error, "code", None)) else grpc.StatusCode.UNKNOWN
    message = (error.details() if callable(getattr(error, "details", None)) else "") or code.name
    reason, field = "", None
    try:
        status = rpc_status.from_call(error)
    except (ValueError, AttributeError):
        status = None
    for detail in status.details if status is not None else ():
        if detail.Is(error_details_pb2.ErrorInfo.DESCRIPTOR):
            info = error_details_pb2.ErrorInfo()
            detail.Unpack(info)
            reason = info.reason
        elif detail.Is(error_details_pb2.BadRequest.DESCRIPTOR):
            bad = error_details_pb2.BadRequest()
            detail.Unpack(bad)
            if bad.field_violations and field is None:
                field = bad.field_violations[0].field
    if code.name in ("UNAUTHENTICATED", "PERMISSION_DENIED"):
        log.error("a service behind the gateway refused its credentials: %s (%s)", message, reason)
        return HttpError(502, f"a service behind the gateway refused the gateway's credentials: {message}",
                         reason or UPSTREAM_ERROR)
    if not reason:  # no tito status: the transport's (unreachable, reset, deadline)
        reason = UPSTREAM_ERROR
    return HttpError(http_status(code.name, reason), message, reason, openai_param(field))


def from_exception(error: BaseException) -> HttpError:
    if isinstance(error, TitoError):
        return from_tito(error)
    if isinstance(error, grpc.RpcError):
        return from_rpc(error)
    if isinstance(error, NoEngineAvailable):  # the router knows no reachable engine right now
        return HttpError(503, str(error), UPSTREAM_ERROR)
    log.exception("unexpected error in the gateway", exc_info=error)
    return HttpError(500, "internal error in the gateway; its log has the details", INTERNAL_ERROR)
