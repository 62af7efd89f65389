"""`tito serve render --workers 2`: two processes behind one port (SO_REUSEPORT), both serving;
a killed worker is replaced; SIGTERM stops everything; a worker failing at start stops the server."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time

import grpc

from tito.v1 import chat_pb2, render_pb2, render_pb2_grpc
from tito_render.servicer import WORKER_PID_KEY

TIMEOUT = 10


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ServerProcess:
    """`python -m tito_cli serve render ...` with its stderr collected line by line."""

    def __init__(self, *args: str) -> None:
        self.lines: list[str] = []
        self.process = subprocess.Popen([sys.executable, "-m", "tito_cli", "serve", "render", *args],
                                        stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.process.stderr:
            self.lines.append(line)

    def wait_for(self, text: str, timeout: float = 60, start: int = 0) -> str:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in self.lines[start:]:
                if text in line:
                    return line
            if self.process.poll() is not None:
                break
            time.sleep(0.05)
        raise AssertionError(f"no {text!r} in the server log:\n{''.join(self.lines)}")

    def stop(self) -> int:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=30)
        finally:
            if self.process.poll() is None:
                self.process.kill()


def render_once(address: str) -> int:
    """One RenderChat on a fresh connection (the kernel balances connections, not calls)."""
    options = [("grpc.use_local_subchannel_pool", 1)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = render_pb2_grpc.RenderServiceStub(channel)
        response, call = stub.RenderChat.with_call(render_pb2.RenderChatRequest(
            messages=[chat_pb2.ChatMessage(role="user", content="hello")]), timeout=TIMEOUT)
        assert response.generate_request.token_ids
        return int(dict(call.trailing_metadata())[WORKER_PID_KEY])


def test_two_workers_share_the_port_and_are_supervised(tiny_text_model):
    address = f"127.0.0.1:{free_port()}"
    server = ServerProcess("--workers", "2", "--address", address, "--model", str(tiny_text_model),
                           "--grace-seconds", "2")
    try:
        line = server.wait_for("worker processes (pids")
        worker_pids = {int(p) for p in line.split("(pids ")[1].split(")")[0].split(", ")}
        assert len(worker_pids) == 2 and server.process.pid not in worker_pids
        served = {render_once(address) for _ in range(24)}
        assert served == worker_pids  # both processes answer calls on the one address

        # A worker that dies is replaced; the server keeps answering meanwhile.
        victim = sorted(worker_pids)[0]
        mark = len(server.lines)
        os.kill(victim, signal.SIGKILL)
        server.wait_for("starting a replacement", start=mark)
        assert render_once(address) != victim  # the survivor answers while the replacement starts
        started = server.wait_for("started worker", start=mark)
        replacement = int(started.rsplit("pid ", 1)[1].rstrip(")\n"))
        server.wait_for(f"(pid {replacement}) serving", start=mark)
        served = {render_once(address) for _ in range(24)}
        assert victim not in served and replacement in served
    finally:
        code = server.stop()
    assert code == 0, "".join(server.lines)


def test_a_worker_that_cannot_load_the_model_stops_the_server_with_one_line(tmp_path):
    # A directory that looks like a model to the supervisor (config.json) but does not load.
    (tmp_path / "config.json").write_text('{"model_type": "qwen2"}')
    server = ServerProcess("--workers", "2", "--address", f"127.0.0.1:{free_port()}", "--model", str(tmp_path),
                           "--log-level", "warning")
    try:
        code = server.process.wait(timeout=60)
    finally:
        server.stop()
    server._reader.join(timeout=10)
    assert code == 2
    assert len(server.lines) == 1 and server.lines[0].startswith("tito serve render: "), server.lines


def test_a_taken_port_is_one_line_before_any_worker_starts():
    with socket.socket() as taken:  # a listener without SO_REUSEPORT: the workers could not bind
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        server = ServerProcess("--workers", "2", "--address", f"127.0.0.1:{taken.getsockname()[1]}")
        try:
            code = server.process.wait(timeout=60)
        finally:
            server.stop()
    assert code == 2
    problems = [line for line in server.lines if " INFO " not in line]
    assert len(problems) == 1 and "cannot listen there" in problems[0], server.lines


def test_workers_need_a_fixed_tcp_port():
    result = subprocess.run([sys.executable, "-m", "tito_cli", "serve", "render", "--workers", "2",
                             "--address", "127.0.0.1:0"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "fixed port" in result.stderr


def test_workers_exit_when_the_supervisor_is_killed(tiny_text_model):
    server = ServerProcess("--workers", "2", "--address", f"127.0.0.1:{free_port()}", "--model", str(tiny_text_model))
    try:
        line = server.wait_for("worker processes (pids")
        worker_pids = [int(p) for p in line.split("(pids ")[1].split(")")[0].split(", ")]
        server.process.kill()
        server.process.wait(timeout=10)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(_alive(pid) for pid in worker_pids):
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in worker_pids), "orphaned render workers keep the port"
    finally:
        server.stop()


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False
