"""The three services as processes on Unix sockets, for the end-to-end tests."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

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
