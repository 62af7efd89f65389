"""The three services as processes on Unix sockets, for the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import NamedTuple

from tito_cli.main import SERVICES, spawn_all, stop_all
from tito_client.pipeline import wait_until_serving


@contextmanager
def running_services(model, sockets: Path, device: str = "auto",
                     extra_args: dict[str, list[str]] | None = None) -> Iterator[tuple[dict[str, str], list]]:
    """`tito serve render|engine|derender` for `model` on sockets in `sockets`, SERVING; stopped
    with SIGTERM afterwards. Yields the addresses by service name and the processes."""
    addresses = {name: f"unix:{sockets / (name + '.sock')}" for name in SERVICES}
    processes = spawn_all(addresses, str(model), device, "warning", extra_args)
    try:
        for name in SERVICES:
            wait_until_serving(addresses[name], timeout=300)
        yield addresses, processes
    finally:
        stop_all(processes)


@contextmanager
def running_render_and_derender(model, sockets: Path, engine_address: str) -> Iterator[dict[str, str]]:
    """`tito serve render` and `tito serve derender` for `model` on sockets in `sockets`, SERVING,
    beside an engine already running at `engine_address`; yields the three services' addresses."""
    import subprocess

    from tito_cli.main import service_commands

    addresses = {"render": f"unix:{sockets / 'render.sock'}", "engine": engine_address,
                 "derender": f"unix:{sockets / 'derender.sock'}"}
    commands = service_commands(addresses, str(model), "auto", "warning")
    processes = [subprocess.Popen(commands[name]) for name in ("render", "derender")]
    try:
        for name in ("render", "derender"):
            wait_until_serving(addresses[name], timeout=300)
        yield addresses
    finally:
        stop_all(processes)


def signed_media_args(directory: Path, key: str = "e2e-shared-key-0123456789abcdef",
                      engine_args: Sequence[str] = ()) -> dict[str, list[str]]:
    """`running_services`' extra arguments for a deployment that trusts only signed media: render
    signs every item and the engine requires the signature, both with a key file written into
    `directory`. One render worker whatever TITO_WORKERS says: several need a TCP port, not a socket."""
    key_file = directory / "hmac.key"
    key_file.write_text(key + "\n")
    return {"render": ["--hmac-key-file", str(key_file), "--workers", "1"],
            "engine": ["--hmac-key-file", str(key_file), "--require-signed-features", *engine_args], "derender": []}


def free_port() -> int:
    """A TCP port free now on 127.0.0.1 (for an HTTP listener a test starts as a process)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def wait_until_healthy(url: str, process, timeout: float = 120.0, verify=True, accept=None,
                       name: str = "the gateway") -> None:
    """Poll `url` (a gateway's /health) until it answers 200 (and `accept(reply)`, when given, is
    true); fail if `process` exits first."""
    import time

    import httpx

    deadline = time.monotonic() + timeout
    last = "no answer"
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode}")
        try:
            reply = httpx.get(url, timeout=2.0, verify=verify)
            if reply.status_code == 200 and (accept is None or accept(reply)):
                return
            last = f"{reply.status_code} {reply.text[:200]}"
        except httpx.HTTPError as exc:
            last = repr(exc)
        time.sleep(0.2)
    raise TimeoutError(f"{url} did not answer 200 within {timeout:.0f}s (last: {last})")


@contextmanager
def running_gateway(addresses: dict[str, str], extra_args: list[str] = (), scheme: str = "http",
                    verify=True) -> Iterator[tuple[str, object]]:
    """`tito serve gateway` on a free port over the services at `addresses`, healthy; stopped with
    SIGTERM afterwards. Yields its base URL (scheme://127.0.0.1:port) and the process."""
    import subprocess
    import sys

    from tito_cli.main import gateway_argv

    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "tito_cli",
                                *gateway_argv(f"127.0.0.1:{port}", addresses, "warning", list(extra_args))])
    base = f"{scheme}://127.0.0.1:{port}"
    try:
        wait_until_healthy(f"{base}/health", process, verify=verify)
        yield base, process
    finally:
        stop_all([process])


def _wait_serving_unless_exited(address: str, process, log: Path, timeout: float) -> None:
    """wait_until_serving, failing at once (with the log's tail) when `process` exits first."""
    import time

    deadline = time.monotonic() + timeout
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"{address}: exited with code {process.returncode}: {log.read_text()[-2000:]}")
        try:
            wait_until_serving(address, timeout=2)
            return
        except TimeoutError:
            if time.monotonic() > deadline:
                raise


@contextmanager
def running_tcp_engine(model, log_dir: Path, extra_args: Sequence[str] = ()) -> Iterator[str]:
    """`tito serve engine` on a free TCP port of 127.0.0.1 (SMG dials workers over TCP), SERVING,
    its output in `log_dir`/engine.log; yields its host:port. On the native backend the model and
    the server share one process; `extra_args` with `--backend vllm` start vLLM's own processes."""
    import subprocess
    import sys

    address = f"127.0.0.1:{free_port()}"
    vllm = "--backend" in extra_args and list(extra_args)[list(extra_args).index("--backend") + 1] == "vllm"
    log = log_dir / "engine.log"
    with open(log, "wb") as out:
        process = subprocess.Popen([sys.executable, "-m", "tito_cli", "serve", "engine", "--model", str(model),
                                    "--address", address, "--log-level", "warning",
                                    *([] if vllm else ["--no-engine-process"]), *extra_args],
                                   stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_serving_unless_exited(address, process, log, timeout=300)
        yield address
    finally:
        stop_all([process])


class RunningSmg(NamedTuple):
    base: str  # http://127.0.0.1:PORT, its OpenAI API
    metrics: str  # its Prometheus endpoint's URL
    process: object


@contextmanager
def running_smg(worker_addresses: Sequence[str], model: str, log_dir: Path,
                extra_args: Sequence[str] = ()) -> Iterator[RunningSmg]:
    """`smg launch --backend vllm` over the tito engines at `worker_addresses` (host:port), on free
    ports of 127.0.0.1, serving `model`; stopped with SIGTERM afterwards."""
    import subprocess

    port, metrics_port = free_port(), free_port()
    from smg_calls import smg_command

    argv = [smg_command(), "launch", "--backend", "vllm",
            "--worker-urls", *(f"grpc://{address}" for address in worker_addresses),
            "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(metrics_port),
            "--log-level", "warn",
            # Nothing is in flight when a test stops it: its default 180 s would hold every stop.
            "--shutdown-grace-period-secs", "1", *extra_args]
    with open(log_dir / "smg.log", "wb") as log:
        # Its working directory is the log's: SMG writes nothing else, but keep it off the tree.
        process = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, cwd=log_dir)
    base = f"http://127.0.0.1:{port}"
    try:
        # Listed once its worker is registered and the tokenizer loaded.
        wait_until_healthy(f"{base}/v1/models", process, name="smg",
                           accept=lambda reply: model in {entry.get("id") for entry in reply.json().get("data", [])})
        yield RunningSmg(base, f"http://127.0.0.1:{metrics_port}/metrics", process)
    finally:
        stop_all([process])
