import pytest
from google.rpc import code_pb2, error_details_pb2

from tito.errors import FieldViolation, InvalidArgument, ResourceExhausted, Unavailable, Violations
from tito.grpc_errors import clip, status_for


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


def test_a_status_stays_small_whatever_the_caller_sent():
    """Huge quoted values and many violations are clipped: the status fits well inside the 8 KB of
    trailers a client accepts, and still says what was left out."""
    huge = "r" * 100_000
    error = InvalidArgument(f"request_id {huge!r} is already live", reason="DUPLICATE_REQUEST_ID", field=huge,
                            violations=[FieldViolation(f"tools[{i}].{huge}", huge) for i in range(50)],
                            metadata={huge: huge})
    status = status_for(error)
    # It travels as grpc-message plus the base64 of the whole status: both well inside 8 KB.
    assert len(status.message.encode()) + len(status.SerializeToString()) * 4 / 3 < 6 * 1024
    assert "more characters" in status.message
    bad = error_details_pb2.BadRequest()
    status.details[1].Unpack(bad)
    assert len(bad.field_violations) == 5 and all(len(v.description) <= 200 for v in bad.field_violations)


def test_clip_keeps_short_text_and_says_how_much_it_cut():
    assert clip("short", 10) == "short"
    clipped = clip("x" * 5000, 100)
    kept = clipped.index("...")
    assert len(clipped) <= 100 and clipped.endswith(f"({5000 - kept} more characters)")


def test_a_caller_request_id_cannot_forge_or_bloat_log_lines():
    from tito.logs import bind_request_id, request_id_var

    bind_request_id("abc\n2026-12-01 INFO forged line")
    assert "\n" not in request_id_var.get() and request_id_var.get().startswith("abc\\n")
    bind_request_id("x" * 1_000_000)
    assert len(request_id_var.get()) <= 131
    bind_request_id("")
    assert request_id_var.get() == "-"


def test_every_service_answers_still_loading_the_same_way():
    from tito_derender.servicer import DerenderServicer
    from tito_engine.service.servicer import EngineServicer
    from tito_render.server import _LazyServicer

    for not_ready in (lambda: DerenderServicer().tokenizer, lambda: EngineServicer()._engine,
                      lambda: _LazyServicer()._ready()):
        with pytest.raises(Unavailable) as raised:
            not_ready()
        status = status_for(raised.value)
        assert status.code == code_pb2.UNAVAILABLE and _unpack(status, error_details_pb2.ErrorInfo).reason == \
            "MODEL_LOADING" and "still loading its model" in status.message
