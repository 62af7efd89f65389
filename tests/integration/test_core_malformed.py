"""Request bytes that do not parse are INVALID_ARGUMENT MALFORMED_REQUEST on every RPC of every
service, unary and streaming, and each service keeps answering; no status outgrows 8 KB."""

from __future__ import annotations

import random

import grpc
import pytest

from tito.grpc_errors import error_details
from tito.v1 import (chat_pb2, derender_pb2, derender_pb2_grpc, engine_pb2, engine_pb2_grpc, render_pb2,
                     render_pb2_grpc)
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.config import EngineConfig
from tito_engine.server import create_server as create_engine
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

TIMEOUT = 30
# A string field (field 1, wire type 2) holding bytes that are not UTF-8, as protobuf refuses them.
INVALID_UTF8 = b"\x0a\x02\xff\xfe"


def _deep(depth: int) -> bytes:
    """`depth` nested length-delimited fields 1: parsers stop at their recursion limit (100)."""
    data = b""
    for _ in range(depth):
        data = b"\x0a" + _varint(len(data)) + data
    return data


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _garbage(seed: int) -> bytes:
    rng = random.Random(seed)
    return bytes(rng.randrange(256) for _ in range(rng.randint(1, 64)))


@pytest.fixture(scope="module")
def servers(module_aio_server, tiny_text_model):
    model = str(tiny_text_model)
    return {
        "render": module_aio_server(lambda: create_render(RenderConfig(model=model))),
        "engine": module_aio_server(lambda: create_engine(EngineConfig(model=model, device="cpu",
                                                                       engine_process=False))),
        "derender": module_aio_server(lambda: create_derender(DerenderConfig(model=model))),
    }


# Method -> (request type, kind): kind is "unary", "server_streaming" or "bidi".
METHODS = {
    "/tito.v1.RenderService/RenderChat": ("render", render_pb2.RenderChatRequest, "unary"),
    "/tito.v1.RenderService/RenderCompletion": ("render", render_pb2.RenderCompletionRequest, "unary"),
    "/tito.v1.RenderService/Tokenize": ("render", render_pb2.TokenizeRequest, "unary"),
    "/tito.v1.RenderService/GetModelInfo": ("render", render_pb2.RenderServiceGetModelInfoRequest, "unary"),
    "/tito.v1.EngineService/Generate": ("engine", engine_pb2.GenerateRequest, "server_streaming"),
    "/tito.v1.EngineService/Encode": ("engine", engine_pb2.EncodeRequest, "unary"),
    "/tito.v1.EngineService/Abort": ("engine", engine_pb2.AbortRequest, "unary"),
    "/tito.v1.EngineService/GetModelInfo": ("engine", engine_pb2.EngineServiceGetModelInfoRequest, "unary"),
    "/tito.v1.EngineService/GetLoad": ("engine", engine_pb2.GetLoadRequest, "unary"),
    "/tito.v1.DerenderService/Derender": ("derender", derender_pb2.DerenderRequest, "bidi"),
    "/tito.v1.DerenderService/DerenderFull": ("derender", derender_pb2.DerenderFullRequest, "unary"),
    "/tito.v1.DerenderService/Detokenize": ("derender", derender_pb2.DetokenizeRequest, "unary"),
}
PAYLOADS = {"random bytes": _garbage(1), "more random bytes": _garbage(2), "invalid utf-8": INVALID_UTF8,
            "truncated": b"\x0a\x10abc", "nested too deep": _deep(200)}


def _parses(message_type, data: bytes) -> bool:
    try:
        message_type.FromString(data)
    except Exception:  # noqa: BLE001 - whatever protobuf raises for bytes it refuses
        return False
    return True


def _assert_malformed(error: grpc.RpcError) -> None:
    details = error_details(error)
    assert (details["code"], details["reason"]) == (grpc.StatusCode.INVALID_ARGUMENT, "MALFORMED_REQUEST"), details
    assert "could not be parsed" in details["message"]


def _good_call(service: str, channel: grpc.Channel) -> None:
    """A well-formed request still gets a normal answer."""
    if service == "render":
        reply = render_pb2_grpc.RenderServiceStub(channel).RenderChat(render_pb2.RenderChatRequest(
            messages=[chat_pb2.ChatMessage(role="user", content="hi")]), timeout=TIMEOUT)
        assert reply.generate_request.token_ids
    elif service == "engine":
        responses = list(engine_pb2_grpc.EngineServiceStub(channel).Generate(engine_pb2.GenerateRequest(
            token_ids=[5, 6], sampling_params={"max_tokens": 2, "temperature": 0}), timeout=TIMEOUT))
        assert responses[-1].finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED
    else:
        reply = derender_pb2_grpc.DerenderServiceStub(channel).Detokenize(
            derender_pb2.DetokenizeRequest(token_ids=[882, 11]), timeout=TIMEOUT)
        assert reply.text


@pytest.mark.parametrize("payload", PAYLOADS, ids=list(PAYLOADS))
@pytest.mark.parametrize("method", METHODS)
def test_undecodable_requests_are_invalid_argument(servers, method, payload):
    """Bytes the request type refuses are MALFORMED_REQUEST; bytes it accepts (unknown fields are
    legal) get an ordinary answer. Never UNKNOWN or INTERNAL, and the service keeps working."""
    service, message_type, kind = METHODS[method]
    data = PAYLOADS[payload]
    with servers[service].channel() as channel:
        try:
            if kind == "unary":
                channel.unary_unary(method)(data, timeout=TIMEOUT)
            elif kind == "server_streaming":
                list(channel.unary_stream(method)(data, timeout=TIMEOUT))
            else:
                list(channel.stream_stream(method)(iter([data]), timeout=TIMEOUT))
            answered = None
        except grpc.RpcError as exc:
            answered = exc
        if _parses(message_type, data):
            assert answered is None or answered.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), \
                error_details(answered)
        else:
            assert answered is not None, "an unparseable request was answered as if it were fine"
            _assert_malformed(answered)
        _good_call(service, channel)


def test_a_bad_message_later_in_a_derender_stream_is_refused(servers):
    context = derender_pb2.DerenderRequest(context=derender_pb2.DerenderContext(prompt_tokens=3))
    with servers["derender"].channel() as channel:
        call = channel.stream_stream("/tito.v1.DerenderService/Derender")
        with pytest.raises(grpc.RpcError) as exc:
            list(call(iter([context.SerializeToString(), INVALID_UTF8]), timeout=TIMEOUT))
        _assert_malformed(exc.value)
        _good_call("derender", channel)


def test_a_huge_caller_value_leaves_the_error_details_intact(servers):
    """A request id of 100,000 characters is quoted in the error; the status still arrives whole."""
    with servers["engine"].channel() as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        long_id = "x" * 100_000
        stream = stub.Generate(engine_pb2.GenerateRequest(
            request_id=long_id, token_ids=[5, 6], sampling_params={"max_tokens": 2000, "temperature": 0,
                                                                   "ignore_eos": True}), timeout=TIMEOUT)
        next(stream)
        with pytest.raises(grpc.RpcError) as exc:
            list(stub.Generate(engine_pb2.GenerateRequest(request_id=long_id, token_ids=[5]), timeout=TIMEOUT))
        stream.cancel()
        details = error_details(exc.value)
        assert (details["reason"], details["fields"]) == ("DUPLICATE_REQUEST_ID", ["request_id"])
        assert len(details["message"]) <= 512 and "more characters" in details["message"]
        _good_call("engine", channel)
