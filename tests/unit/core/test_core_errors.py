from google.rpc import code_pb2, error_details_pb2

from tito.errors import InvalidArgument, ResourceExhausted, Violations
from tito.grpc_errors import status_for


def _unpack(status, kind):
    for detail in status.details:
        if detail.Is(kind.DESCRIPTOR):
            message = kind()
            detail.Unpack(message)
            return message
    return None


def test_invalid_argument_carries_error_info_and_bad_request():
    status = status_for(InvalidArgument("messages[1].role: unknown role 'robot'", reason="UNKNOWN_ROLE",
                                        field="messages[1].role"))
    assert status.code == code_pb2.INVALID_ARGUMENT
    info = _unpack(status, error_details_pb2.ErrorInfo)
    assert info.reason == "UNKNOWN_ROLE" and info.domain
    bad = _unpack(status, error_details_pb2.BadRequest)
    assert [v.field for v in bad.field_violations] == ["messages[1].role"]


def test_resource_exhausted_without_field_has_no_bad_request():
    status = status_for(ResourceExhausted("queue full", reason="QUEUE_FULL"))
    assert status.code == code_pb2.RESOURCE_EXHAUSTED
    assert _unpack(status, error_details_pb2.BadRequest) is None


def test_violations_collects_all_fields():
    violations = Violations()
    violations.add("a", "bad a")
    violations.add("b", "bad b")
    try:
        violations.raise_if_any()
    except InvalidArgument as exc:
        assert [v.field for v in exc.violations] == ["a", "b"]
        assert "and 1 more" in exc.message
    else:
        raise AssertionError("expected InvalidArgument")
