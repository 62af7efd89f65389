"""Several render processes behind one address (`--workers N`).

Rendering is CPU-bound Python (Jinja, tokenizer calls, image processing) and one process uses
one core, so N worker processes each bind the same TCP port with SO_REUSEPORT and the kernel
spreads connections across them. Nothing is copied between processes: each worker answers its
own calls, tensors included.

The parent supervises: it starts the workers (spawned, each loads the model itself), waits until
every one reports SERVING, forwards SIGTERM/SIGINT (each worker then shuts down gracefully), and
when a worker that was serving dies, logs it and starts a replacement. A worker that fails
*while starting* stops the whole server with an error instead: a replacement would fail the same
way. A configuration error (a model that does not load) travels back to the parent, which
reports it as its own: one line, exit status 2, as with one process.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import multiprocessing
import os
import queue
import signal

from collections.abc import Awaitable, Callable
from typing import Any

from tito.config import ConfigError
from tito.logs import setup_logging
from tito.serving import run_until_signal
from tito.supervision import ChildProcess, Supervisor, exit_with_parent, spawn_context

from tito_render.config import RenderConfig

log = logging.getLogger(__name__)

#: What a worker runs: the render server's factory (`tito_render.server.create_server`), given by the
#: server that owns the pool (spawned workers import it by name, so it must be a module-level function).
ServerFactory = Callable[[RenderConfig], Awaitable[Any]]

_POLL_SECONDS = 0.2


def worker_config(config: RenderConfig) -> RenderConfig:
    """A worker's own config: one process, sharing the port."""
    return dataclasses.replace(config, workers=1, reuse_port=True)


def _worker_main(config: RenderConfig, index: int, ready: multiprocessing.Queue, parent_pid: int,
                 create_server: ServerFactory) -> None:
    """Entry point of one worker process."""
    setup_logging(config.log_level, f"render[w{index} pid {os.getpid()}]")
    exit_with_parent(parent_pid)
    # The parent forwards SIGINT as SIGTERM; a terminal's Ctrl-C reaches every worker directly too.
    try:
        asyncio.run(_run_worker(config, index, ready, create_server))
    except ConfigError as exc:  # the parent reports it (one line for the operator, not one per worker)
        ready.put(("failed", index, str(exc)))
        raise SystemExit(2) from None
    except (OSError, RuntimeError) as exc:  # e.g. a port taken after the parent checked (grpc: RuntimeError)
        log.error("worker %d failed: %s", index, exc)
        raise SystemExit(3) from None
    except Exception:  # noqa: BLE001 - reported, then the exit code tells the parent
        log.exception("worker %d failed", index)
        raise SystemExit(3) from None


async def _run_worker(config: RenderConfig, index: int, ready: multiprocessing.Queue,
                      create_server: ServerFactory) -> None:
    if config.metrics_port:  # one /metrics per worker process: worker i serves on metrics_port + i
        config = dataclasses.replace(config, metrics_port=config.metrics_port + index)
    running = await create_server(config)
    log.info("worker %d (pid %d) serving on %s", index, os.getpid(), running.address)
    ready.put(("serving", index, os.getpid()))
    await run_until_signal(running)


def _worker_name(index: int) -> str:
    return f"render worker {index}"


class WorkerPool:
    """Start, supervise and stop the worker processes of one render server (tito.supervision's
    Supervisor: a worker that dies after serving is replaced with backoff, one that dies while
    starting stops the server)."""

    def __init__(self, config: RenderConfig, count: int, create_server: ServerFactory) -> None:
        self.config = worker_config(config)
        self.count = count
        self.create_server = create_server  # runs in each worker; the parent never loads a model
        self._context = spawn_context()
        self._ready: multiprocessing.Queue = self._context.Queue()
        self._supervisor = Supervisor(restart=True)
        self._stopping = asyncio.Event()
        self._config_error: str | None = None  # a worker's start-up ConfigError, reported by the parent

    def _spawner(self, index: int) -> Callable[[], ChildProcess]:
        def spawn() -> ChildProcess:
            process = self._context.Process(target=_worker_main, name=f"render-worker-{index}", daemon=False,
                                            args=(self.config, index, self._ready, os.getpid(), self.create_server))
            process.start()
            log.info("started worker %d (pid %d)", index, process.pid)
            return ChildProcess(_worker_name(index), process)
        return spawn

    def _drain_ready(self) -> None:
        while True:
            try:
                kind, index, detail = self._ready.get_nowait()
            except queue.Empty:
                return
            if kind == "failed":
                self._config_error = self._config_error or detail
            else:
                self._supervisor.mark_ready(_worker_name(index), pid=detail)

    async def run(self) -> int:
        """Serve until a signal (exit code 0) or a worker failing at start-up (exit code 1; a
        ConfigError, raised here after every worker has stopped, when the worker reported one)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        for index in range(self.count):
            self._supervisor.start(_worker_name(index), self._spawner(index))
        announced = False
        code = 0
        try:
            while not self._stopping.is_set():
                self._drain_ready()
                if not announced and self._supervisor.all_ready():
                    announced = True
                    pids = ", ".join(str(child.pid) for child in self._supervisor.children())
                    log.info("render serving on %s with %d worker processes (pids %s)", self.config.address,
                             self.count, pids)
                failed = self._supervisor.check()
                if failed is not None:  # it may have said "serving" just before dying: then it is replaced
                    self._drain_ready()
                    failed = self._supervisor.check()
                if failed is not None:
                    if not self._config_error:  # a reported ConfigError is the server's one line (run)
                        log.error("%s failed while starting (exit code %s); stopping the server",
                                  failed.name, failed.exit_code)
                    code = 1
                    break
                try:
                    await asyncio.wait_for(self._stopping.wait(), _POLL_SECONDS)
                except asyncio.TimeoutError:
                    pass
        finally:
            await self.stop()
        if self._config_error:
            raise ConfigError(self._config_error)
        return code

    async def stop(self) -> None:
        alive = [child for child in self._supervisor.children() if child.exit_code is None]
        log.info("stopping %d worker processes", len(alive))
        await asyncio.to_thread(self._supervisor.stop, self.config.grace_seconds)
        self._ready.close()
