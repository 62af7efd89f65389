"""The gateway's one error mapping: gRPC statuses and its own refusals -> HTTP and OpenAI's JSON."""

from __future__ import annotations

import grpc
import pytest

from tito.errors import InvalidArgument, ResourceExhausted
from tito_gateway.errors import from_exception

from gateway_fakes import FakeRpcError


@pytest.mark.parametrize("error, status, code, param", [
    (InvalidArgument("t", reason="INVALID_SAMPLING_PARAMS", field="sampling.temperature"), 400,
     "INVALID_SAMPLING_PARAMS", "temperature"),
    (ResourceExhausted("q", reason="QUEUE_FULL"), 429, "QUEUE_FULL", None),
    (ResourceExhausted("big", reason="IMAGE_TOO_LARGE"), 413, "IMAGE_TOO_LARGE", None),
])
def test_a_services_status_keeps_its_reason_and_maps_its_code(error, status, code, param):
    mapped = from_exception(FakeRpcError(error))
    assert (mapped.status, mapped.code, mapped.param) == (status, code, param)
    assert mapped.json()["error"]["code"] == code


def test_a_request_id_already_in_use_is_a_409_naming_the_header():
    """The engine refuses a second request with a live id (INVALID_ARGUMENT, field request_id); the
    gateway's caller chose that id in its x-request-id header, and the id is in use: a conflict."""
    mapped = from_exception(FakeRpcError(InvalidArgument("request_id 'a' is already live",
                                                         reason="DUPLICATE_REQUEST_ID", field="request_id")))
    assert (mapped.status, mapped.code, mapped.param) == (409, "DUPLICATE_REQUEST_ID", "x-request-id")
    assert mapped.json()["error"]["type"] == "conflict_error"


def test_transport_failures_are_upstream_errors_with_the_codes_status():
    assert (from_exception(FakeRpcError()).status, from_exception(FakeRpcError()).code) == (503, "UPSTREAM_ERROR")
    late = from_exception(FakeRpcError(code=grpc.StatusCode.DEADLINE_EXCEEDED, details="Deadline Exceeded"))
    assert late.status == 504


def test_a_service_refusing_the_gateways_credentials_is_a_502():
    from tito.errors import Unauthenticated

    mapped = from_exception(FakeRpcError(Unauthenticated("no", reason="AUTH_TOKEN_INVALID")))
    assert (mapped.status, mapped.code) == (502, "AUTH_TOKEN_INVALID")


def test_the_gateways_own_refusals_and_bugs():
    mapped = from_exception(InvalidArgument("x", reason="UNSUPPORTED_PARAMETER", field="logit_bias"))
    assert mapped.json() == {"error": {"message": "x", "type": "invalid_request_error", "param": "logit_bias",
                                       "code": "UNSUPPORTED_PARAMETER"}}
    bug = from_exception(KeyError("oops"))
    assert (bug.status, bug.code, bug.json()["error"]["type"]) == (500, "INTERNAL_ERROR", "server_error")
    assert "oops" not in bug.message
