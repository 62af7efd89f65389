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
import time
from multiprocessing.process import BaseProcess

from collections.abc import Awaitable, Callable
from typing import Any

from tito.config import ConfigError
from tito.logs import setup_logging
from tito.serving import run_until_signal

from tito_render.config import RenderConfig

log = logging.getLogger(__name__)

#: What a worker runs: the render server's factory (`tito_render.server.create_server`), given by the
#: server that owns the pool (spawned workers import it by name, so it must be a module-level function).
ServerFactory = Callable[[RenderConfig], Awaitable[Any]]

#: Seconds a stopping worker gets beyond the grace period before it is killed.
KILL_MARGIN_SECONDS = 10.0
_POLL_SECONDS = 0.2


def worker_config(config: RenderConfig) -> RenderConfig:
    """A worker's own config: one process, sharing the port."""
    return dataclasses.replace(config, workers=1, reuse_port=True)


def _exit_with_parent(parent_pid: int) -> None:
    """Linux: get SIGTERM when the supervisor dies (even by SIGKILL), so no orphan keeps the port."""
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent_pid:  # the parent died before prctl took effect
        os.kill(os.getpid(), signal.SIGTERM)


def _worker_main(config: RenderConfig, index: int, ready: multiprocessing.Queue, parent_pid: int,
                 create_server: ServerFactory) -> None:
    """Entry point of one worker process."""
    setup_logging(config.log_level, f"render[w{index} pid {os.getpid()}]")
    _exit_with_parent(parent_pid)
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


class WorkerPool:
    """Start, supervise and stop the worker processes of one render server."""

    def __init__(self, config: RenderConfig, count: int, create_server: ServerFactory) -> None:
        self.config = worker_config(config)
        self.count = count
        self.create_server = create_server  # runs in each worker; the parent never loads a model
        self._context = multiprocessing.get_context("spawn")  # no fork of a threaded parent
        self._ready: multiprocessing.Queue = self._context.Queue()
        self._processes: dict[int, BaseProcess] = {}
        self._serving: set[int] = set()
        self._stopping = asyncio.Event()
        self._config_error: str | None = None  # a worker's start-up ConfigError, reported by the parent

    def _start(self, index: int) -> None:
        process = self._context.Process(target=_worker_main, args=(self.config, index, self._ready, os.getpid(), self.create_server),
                                        name=f"render-worker-{index}", daemon=False)
        process.start()
        self._processes[index] = process
        self._serving.discard(index)
        log.info("started worker %d (pid %d)", index, process.pid)

    def _drain_ready(self) -> None:
        while True:
            try:
                kind, index, detail = self._ready.get_nowait()
            except queue.Empty:
                return
            if kind == "failed":
                self._config_error = self._config_error or detail
                continue
            pid = detail
            process = self._processes.get(index)
            if process is not None and process.pid == pid:
                self._serving.add(index)

    async def run(self) -> int:
        """Serve until a signal (exit code 0) or a worker failing at start-up (exit code 1; a
        ConfigError, raised here after every worker has stopped, when the worker reported one)."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self._stopping.set)
        for index in range(self.count):
            self._start(index)
        announced = False
        code = 0
        try:
            while not self._stopping.is_set():
                self._drain_ready()
                if not announced and len(self._serving) == self.count:
                    announced = True
                    pids = ", ".join(str(self._processes[i].pid) for i in sorted(self._processes))
                    log.info("render serving on %s with %d worker processes (pids %s)", self.config.address,
                             self.count, pids)
                failed = self._check_workers()
                if failed:
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

    def _check_workers(self) -> bool:
        """Restart dead workers that were serving; True when one died while starting."""
        for index, process in list(self._processes.items()):
            if process.exitcode is None:
                continue
            if index not in self._serving:
                self._drain_ready()
            if index in self._serving:
                log.error("worker %d (pid %d) died with exit code %s; starting a replacement",
                          index, process.pid, process.exitcode)
                self._start(index)
            else:
                if not self._config_error:  # a reported ConfigError is the server's one line (run)
                    log.error("worker %d (pid %d) failed while starting (exit code %s); stopping the server",
                              index, process.pid, process.exitcode)
                return True
        return False

    async def stop(self) -> None:
        alive = [p for p in self._processes.values() if p.exitcode is None]
        log.info("stopping %d worker processes", len(alive))
        for process in alive:
            try:
                os.kill(process.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
        deadline = time.monotonic() + self.config.grace_seconds + KILL_MARGIN_SECONDS
        while any(p.exitcode is None for p in alive) and time.monotonic() < deadline:
            await asyncio.sleep(_POLL_SECONDS)
        for process in alive:
            if process.exitcode is None:
                log.warning("worker pid %d did not stop in time; killing it", process.pid)
                process.kill()
            process.join(timeout=5)
        self._ready.close()
