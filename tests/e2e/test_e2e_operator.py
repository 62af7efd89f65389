"""What an operator sees: every `tito serve` form answers a start-up mistake (a bad model, a taken
port, a key or certificate file that is not there) with one line and exit status 2; an idle
engine stops promptly on SIGTERM yet lets an in-flight stream finish; start-up logs its phases."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest

from tito_client.pipeline import wait_until_serving
from tito.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.e2e

FORMS = ("render", "engine", "derender", "all")


def serve(form: str, *args: str, env: dict[str, str] | None = None, timeout: float = 120) -> tuple[int, list[str]]:
    """Run `tito serve FORM ARGS` to its exit; its status and its stderr lines other than log lines."""
    command = [sys.executable, "-m", "tito_cli", "serve", form, "--log-level", "warning", *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout,
                            env={**os.environ, **(env or {})})
    return result.returncode, [line for line in result.stderr.splitlines() if line.strip()]


def address_flag(form: str, address: str) -> list[str]:
    """Where FORM listens (for `all`: the engine; the others on private Unix sockets)."""
    return ["--engine-address", address] if form == "all" else ["--address", address]


@pytest.fixture
def sockets(tmp_path) -> list[str]:
    """Unix addresses for `serve all`'s render and derender, so only the engine's port matters."""
    return ["--render-address", f"unix:{tmp_path / 'r.sock'}", "--derender-address", f"unix:{tmp_path / 'd.sock'}"]


@pytest.fixture
def taken_port() -> Iterator[int]:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        yield listener.getsockname()[1]


@pytest.mark.parametrize("form", FORMS)
def test_a_model_that_is_not_there_is_one_line(form, tmp_path):
    code, lines = serve(form, *address_flag(form, f"unix:{tmp_path / 's.sock'}"), "--model", str(tmp_path / "none"))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"tito serve {form}: --model ") and "not a model directory" in lines[0]


@pytest.mark.parametrize("form", ("render", "engine", "derender"))
def test_a_model_directory_that_does_not_load_is_one_line(form, tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')  # no tokenizer, no weights
    code, lines = serve(form, "--address", f"unix:{tmp_path / 's.sock'}", "--model", str(tmp_path))
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"tito serve {form}: "), lines


@pytest.mark.parametrize("form", FORMS)
def test_a_port_in_use_is_one_line(form, taken_port, sockets):
    extra = sockets if form == "all" else []
    code, lines = serve(form, *address_flag(form, f"127.0.0.1:{taken_port}"), *extra)
    assert code == 2 and len(lines) == 1, lines
    assert f"127.0.0.1:{taken_port}: cannot listen there" in lines[0]
    assert lines[0].startswith(f"tito serve {form}: " + ("engine: " if form == "all" else ""))


# (form, variables naming files, the flag the message must name). `serve all` takes these from
# its environment, which the three services inherit; the flag forms take them on the command line.
MISSING_FILES = [
    ("render", {"TLS_CERT_FILE": "missing", "TLS_KEY_FILE": "present"}, "--tls-cert-file"),
    ("engine", {"TLS_CERT_FILE": "present", "TLS_KEY_FILE": "missing"}, "--tls-key-file"),
    ("derender", {"TLS_CERT_FILE": "present", "TLS_KEY_FILE": "present", "TLS_CLIENT_CA_FILE": "missing"},
     "--tls-client-ca-file"),
    ("all", {"TLS_CERT_FILE": "present", "TLS_KEY_FILE": "missing"}, "--tls-key-file"),
    ("derender", {"AUTH_TOKEN_FILE": "missing"}, "--auth-token-file"),
    ("all", {"AUTH_TOKEN_FILE": "missing"}, "--auth-token-file"),
    ("render", {"HMAC_KEY_FILE": "missing"}, "--hmac-key-file"),
    ("engine", {"HMAC_KEY_FILE": "missing"}, "--hmac-key-file"),
    ("all", {"HMAC_KEY_FILE": "missing"}, "--hmac-key-file"),
]


@pytest.mark.parametrize(("form", "files", "flag"), MISSING_FILES)
def test_a_missing_key_or_certificate_file_is_one_line(form, files, flag, tmp_path, sockets):
    present = tmp_path / "present.pem"
    present.write_text("placeholder: only its presence is checked before the missing one\n")
    paths = {name: str(present if which == "present" else tmp_path / "missing.pem") for name, which in files.items()}
    if form == "all":
        code, lines = serve(form, *sockets, "--engine-address", f"unix:{tmp_path / 'e.sock'}",
                            env={f"TITO_{name}": path for name, path in paths.items()})
    else:
        flags = [part for name, path in paths.items() for part in (f"--{name.lower().replace('_', '-')}", path)]
        code, lines = serve(form, "--address", f"unix:{tmp_path / 's.sock'}", *flags)
    assert code == 2 and len(lines) == 1, lines
    assert f"{flag} '{tmp_path / 'missing.pem'}' cannot be read" in lines[0], lines


def test_a_bad_variable_is_one_line_naming_it():
    code, lines = serve("render", env={"TITO_WORKERS": "two"})
    assert code == 2 and lines == ["tito serve render: TITO_WORKERS='two' is not a valid int (it sets --workers)"]


def _start_engine(model: Path, address: str, *args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "tito_cli", "serve", "engine", "--address", address,
                             "--model", str(model), "--log-level", "info", *args],
                            stderr=subprocess.PIPE, text=True)


def test_an_idle_engine_stops_promptly_and_logs_its_start_up_phases(tiny_text_model, tmp_path):
    address = f"unix:{tmp_path / 'engine.sock'}"
    process = _start_engine(tiny_text_model, address)
    try:
        wait_until_serving(address, timeout=300)
        began = time.monotonic()
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        took = time.monotonic() - began
    finally:
        if process.poll() is None:
            process.kill()
    print(f"idle engine: SIGTERM to exit in {took:.2f}s")
    assert process.returncode == 0, stderr
    assert took < 3.0, f"an idle engine took {took:.2f}s to stop\n{stderr}"
    for phase in ("config took", "bind took", "warm-up took", "model load took", "core start took", "serving"):
        assert f"start-up: {phase}" in stderr, stderr


def test_sigterm_lets_an_in_flight_stream_finish(tiny_text_model, tmp_path):
    address = f"unix:{tmp_path / 'engine.sock'}"
    process = _start_engine(tiny_text_model, address, "--grace-seconds", "120")
    try:
        wait_until_serving(address, timeout=300)
        with grpc.insecure_channel(address) as channel:
            stream = engine_pb2_grpc.EngineServiceStub(channel).Generate(engine_pb2.GenerateRequest(
                token_ids=[1, 2, 3], sampling_params={"max_tokens": 400, "temperature": 0, "ignore_eos": True}),
                timeout=120)
            first = next(stream)  # the request is running
            process.send_signal(signal.SIGTERM)
            rest = list(stream)
        _, stderr = process.communicate(timeout=60)
    finally:
        if process.poll() is None:
            process.kill()
    tokens = sum(len(response.token_ids) for response in [first, *rest])
    assert tokens == 400 and rest[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH, stderr
    assert process.returncode == 0, stderr
