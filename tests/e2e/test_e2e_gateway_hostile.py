"""Hostile HTTP against `tito serve gateway` (a process, over the three services as processes):
malformed JSON, wrong types, huge bodies, unknown fields, slow clients and thousands of idle
connections each get a clean 4xx or a bounded wait, and the gateway keeps serving."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from service_processes import running_gateway, running_services

pytestmark = pytest.mark.e2e

MODEL = "tiny"
IDLE_S = 2.0
MAX_BODY = 65536


@pytest.fixture(scope="module")
def gateway(tiny_text_model, tmp_path_factory):
    with running_services(tiny_text_model, tmp_path_factory.mktemp("hostile")) as (addresses, _):
        with running_gateway(addresses, ["--served-model-name", MODEL, "--idle-timeout", str(IDLE_S),
                                         "--max-body-bytes", str(MAX_BODY)]) as (base, process):
            yield base, process


def _serves(base: str) -> None:
    reply = httpx.post(f"{base}/v1/chat/completions", timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["finish_reason"] in ("length", "stop")


def _address(base: str) -> tuple[str, int]:
    host, port = base.removeprefix("http://").rsplit(":", 1)
    return host, int(port)


def _read_all(sock: socket.socket) -> bytes:
    """Everything the gateway sends until it closes the connection (or stays quiet past the idle timeout)."""
    sock.settimeout(IDLE_S + 3)
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except TimeoutError:
            break
        except OSError:  # reset: the gateway closed while data was in flight
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


def _raw(base: str, data: bytes) -> bytes:
    """Send raw bytes on a fresh connection; everything the gateway answers until it closes."""
    with socket.create_connection(_address(base), timeout=30) as sock:
        try:
            sock.sendall(data)
        except OSError:  # the gateway closed before taking it all
            pass
        return _read_all(sock)


@pytest.mark.parametrize("body, code", [
    (b"{", "INVALID_JSON"),
    (b"", "INVALID_JSON"),
    (b"[1, 2]", "INVALID_JSON"),
    (b"\xff\xfe\x00garbage", "INVALID_JSON"),
    (b'{"model": "tiny", "messages": [], "temperature": NaN}', "INVALID_JSON"),
    (b"[" * 30000 + b"]" * 30000, "JSON_TOO_DEEP"),  # nested past any parser's recursion
    (b'{"model": "tiny", "messages": "Hi"}', "INVALID_REQUEST"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": 5}]}', "INVALID_REQUEST"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": "lots"}', "INVALID_REQUEST"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "n": 1.5}', "INVALID_REQUEST"),
    (b'{"model": 7, "messages": []}', "INVALID_REQUEST"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi"}], "evil": {"a": 1}}', "UNSUPPORTED_PARAMETER"),
    (b'{"model": "tiny", "messages": [{"role": "user", "content": "Hi", "x": 1}]}', "UNSUPPORTED_PARAMETER"),
])
def test_malformed_or_mistyped_bodies_are_clean_400s(gateway, body, code):
    base, _ = gateway
    for path in ("/v1/chat/completions", "/v1/completions"):
        reply = httpx.post(f"{base}{path}", content=body, headers={"content-type": "application/json"}, timeout=30)
        if code not in ("INVALID_JSON", "JSON_TOO_DEEP") and path == "/v1/completions":
            continue  # the chat bodies are not completion bodies
        assert reply.status_code == 400, reply.text
        error = reply.json()["error"]
        assert error["code"] == code and error["type"] == "invalid_request_error"
    _serves(base)


def _chat(**extra) -> dict:
    return {"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 3, **extra}


def _schema(levels: int) -> dict:
    """A JSON schema `levels` objects deep (arrays of arrays of ... strings)."""
    schema = {"type": "string"}
    for _ in range(levels - 1):
        schema = {"type": "array", "items": schema}
    return schema


def _tool(name: str = "f", parameters: dict | None = None) -> dict:
    return {"type": "function", "function": {"name": name, "parameters": parameters or {"type": "object"}}}


@pytest.mark.parametrize("body, code, param", [
    (_chat(messages=[{"role": "user", "content": "\ud800"}]), "INVALID_REQUEST", "messages[0].content"),
    (_chat(stop=["ok", "\udfff"]), "INVALID_REQUEST", "stop[1]"),
    (_chat(tools=[_tool("get_\ud800")]), "INVALID_REQUEST", "tools[0].function.name"),
    (_chat(response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": _schema(60)}}),
     "STRUCT_TOO_DEEP", "response_format.json_schema.schema"),
    (_chat(tools=[_tool(parameters=_schema(450))]), "JSON_TOO_DEEP", "tools[0].function.parameters.items"),
])
def test_what_protobuf_cannot_carry_is_a_400_naming_the_parameter(gateway, body, code, param):
    """Lone surrogates (a `\\ud800` escape) and nesting render and protobuf refuse, sent as JSON
    clients write it: 400s in OpenAI's shape naming the parameter, never a 500."""
    base, _ = gateway
    reply = httpx.post(f"{base}/v1/chat/completions", content=json.dumps(body), timeout=30,
                       headers={"content-type": "application/json"})
    assert reply.status_code == 400, reply.text[:300]
    error = reply.json()["error"]
    assert error["code"] == code and error["type"] == "invalid_request_error"
    assert error["param"].startswith(param), error
    _serves(base)


def test_huge_bodies_are_413_declared_or_not(gateway):
    base, _ = gateway
    declared = _raw(base, b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                          b"content-length: 10000000000\r\n\r\n{")
    assert declared.startswith(b"HTTP/1.1 413"), declared[:200]
    assert b"REQUEST_BODY_TOO_LARGE" in declared

    def chunks():
        yield b'{"model": "tiny", "messages": [{"role": "user", "content": "'
        for _ in range(100):
            yield b"x" * 4096
        yield b'"}]}'
    streamed = httpx.post(f"{base}/v1/chat/completions", content=chunks(), timeout=30)  # chunked, no length
    assert streamed.status_code == 413 and streamed.json()["error"]["code"] == "REQUEST_BODY_TOO_LARGE"
    _serves(base)


def test_huge_headers_close_the_connection(gateway):
    base, _ = gateway
    answer = _raw(base, b"GET /health HTTP/1.1\r\nhost: x\r\nx-big: " + b"a" * 200000 + b"\r\n\r\n")
    assert answer == b"" or answer.startswith(b"HTTP/1.1 431") or answer.startswith(b"HTTP/1.1 400")
    _serves(base)


def test_slow_clients_are_cut_off_within_the_idle_timeout(gateway):
    base, _ = gateway
    host, port = _address(base)
    # Headers a byte at a time (slowloris): the connection closes IDLE_S after it opened.
    with socket.create_connection((host, port), timeout=30) as sock:
        started = time.monotonic()
        closed = False
        for byte in b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\n":
            try:
                sock.sendall(bytes([byte]))
                sock.settimeout(0.25)
                if sock.recv(1024) == b"":
                    closed = True
                    break
            except TimeoutError:
                continue
            except OSError:
                closed = True
                break
        assert closed and time.monotonic() - started < IDLE_S + 5
    # A body that trickles: a 400 once the idle timeout passes, not a slot held forever.
    with socket.create_connection((host, port), timeout=30) as sock:
        started = time.monotonic()
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: 1000\r\n\r\n{")
        answer = _read_all(sock)
        assert answer.startswith(b"HTTP/1.1 400") and b"did not arrive" in answer
        assert time.monotonic() - started < 2 * IDLE_S + 5  # the body's deadline, then the idle close
    _serves(base)


def test_a_client_that_never_reads_its_stream_does_not_stall_others(gateway):
    base, _ = gateway
    body = json.dumps({"model": MODEL, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 200,
                       "stream": True}).encode()
    with socket.create_connection(_address(base)) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.sendall(b"POST /v1/chat/completions HTTP/1.1\r\nhost: x\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\n\r\n" % len(body) + body)
        _serves(base)  # while the first stream sits unread


def test_thousands_of_idle_connections_are_bounded_and_the_gateway_keeps_serving(gateway):
    base, process = gateway
    idle = []
    try:
        for _ in range(2000):
            idle.append(socket.create_connection(_address(base), timeout=30))
        _serves(base)  # beside 2000 idle connections
        time.sleep(IDLE_S + 2)
        closed = 0
        for sock in idle:
            sock.settimeout(5)
            try:
                closed += sock.recv(1) == b""
            except (TimeoutError, OSError):
                pass
        assert closed == len(idle)  # every idle one was closed by the gateway
    finally:
        for sock in idle:
            sock.close()
    assert process.poll() is None
    _serves(base)
