"""Native engines as processes on local TCP ports, to kill (SIGKILL) and restart on the same
address: what a chaos test needs and an in-process server cannot give (a process that vanishes)."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

from tito_client.pipeline import wait_until_serving


def free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


class EngineProcess:
    """`tito serve engine` for `model` at `address` (model and server in one process, one CPU
    thread: a SIGKILL takes the whole engine at once); its output goes to `log_dir`."""

    def __init__(self, model: str | Path, address: str, log_dir: Path, extra: tuple[str, ...] = ()):
        self.address = address
        self._command = [sys.executable, "-m", "tito_cli", "serve", "engine", "--model", str(model),
                         "--address", address, "--device", "cpu", "--log-level", "warning", "--cpu-threads", "1",
                         "--core-cpus", "none", "--no-engine-process", *extra]
        self._log_path = log_dir / f"engine-{address.rsplit(':', 1)[1]}.log"
        self.process: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> "EngineProcess":
        log = open(self._log_path, "ab")  # noqa: SIM115 (the child holds it; closed here at once)
        with log:
            self.process = subprocess.Popen(self._command, stdout=log, stderr=log, start_new_session=True)
        self.starts += 1
        return self

    def wait_serving(self, timeout: float = 120.0) -> None:
        try:
            wait_until_serving(self.address, timeout=timeout)
        except TimeoutError:
            raise AssertionError(f"engine {self.address} did not serve: {self.log_tail()}") from None

    def kill(self) -> None:
        """SIGKILL: no drain, no goodbye; the port is free again once it is gone."""
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def terminate(self, timeout: float = 60.0) -> int | None:
        """SIGTERM (the engine drains, then exits) and wait for the exit: its exit status."""
        if self.process is None or self.process.poll() is not None:
            return None if self.process is None else self.process.returncode
        self.process.terminate()
        return self.process.wait(timeout=timeout)

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, chars: int = 3000) -> str:
        return self._log_path.read_text(errors="replace")[-chars:] if self._log_path.exists() else ""
