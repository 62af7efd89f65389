"""Render server: factory, CLI flags and standalone entry point."""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys
from concurrent.futures import ThreadPoolExecutor

from tito import settings
from tito.config import ConfigError
from tito.errors import LoadingGate
from tito_models.paths import resolve_model
from tito.serving import RunningServer, check_can_listen, observability, run_until_signal, start_server
from tito.settings import add_settings
from tito.startup import StartupPhases, loading_model
from tito.v1 import render_pb2

from tito_render.config import RenderConfig
from tito_render.media.features import Signer
from tito_render.model import load_render_model
from tito_render.observe import RenderMetrics
from tito_render.renderer import Renderer, RenderLimits
from tito_render.servicer import RenderServicer, add_to_server
from tito_render.workers import WorkerPool

SERVICE_NAME = render_pb2.DESCRIPTOR.services_by_name["RenderService"].full_name
#: Rendering threads per process: CPU work shares one core (the GIL), but a remote image fetch
#: or a large image does not hold up the other calls of the process.
RENDER_THREADS = 4

log = logging.getLogger(__name__)


#: The typed config whose field declarations give this service's flags (tito.settings).
CONFIG = RenderConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Render's own flags (the common ones come from the tito CLI)."""
    add_settings(parser, RenderConfig, common=False)


def config_from_args(args: argparse.Namespace) -> RenderConfig:
    config = settings.config_from_args(RenderConfig, args)
    config.validate()
    return config


async def create_server(config: RenderConfig, phases: StartupPhases | None = None) -> RunningServer:
    """One render process: start NOT_SERVING, load the tokenizer and image processor off the loop,
    register, then go SERVING. (Several processes: `serve` with config.workers != 1.)"""
    phases = phases or StartupPhases()
    config.validate()
    if config.resolved_workers() != 1:
        raise ConfigError(f"create_server runs one process (workers={config.workers}): use serve() to start "
                          f"worker processes")
    key = config.read_hmac_key()
    signer = Signer(key, config.hmac_key_id) if key else None
    executor = ThreadPoolExecutor(max_workers=RENDER_THREADS, thread_name_prefix="render")
    servicer_slot: list[RenderServicer] = []

    def register(server) -> None:
        # The servicer is created before the model is loaded; it must exist at registration time.
        servicer = _LazyServicer()
        servicer_slot.append(servicer)
        add_to_server(servicer, server)

    metrics = observability(config, "render")
    with phases.phase("bind"):
        running = await start_server(config, [SERVICE_NAME], register, metrics)
    running.add_cleanup(lambda: executor.shutdown(wait=False, cancel_futures=True))
    try:
        with phases.phase("model load", "tokenizer, chat template, media processors"), loading_model(config.model):
            model = await asyncio.get_running_loop().run_in_executor(executor, load_render_model, config)
    except BaseException:
        await running.stop(0)
        raise
    renderer = Renderer(model, RenderLimits.from_config(config), signer)
    running.add_cleanup(lambda: asyncio.to_thread(renderer.encoder.close))  # off the loop: it waits
    servicer_slot[0].attach(RenderServicer(renderer, executor, RenderMetrics(metrics) if metrics else None))
    if signer:
        log.info("media items are signed (HMAC-SHA256, key id %r)", config.hmac_key_id)
    await running.set_serving()
    phases.serving()
    return running


class _LazyServicer(RenderServicer):
    """Answers UNAVAILABLE until the model is loaded, then delegates."""

    def __init__(self) -> None:  # noqa: D107 - no renderer yet
        self._inner: LoadingGate[RenderServicer] = LoadingGate("render")

    def attach(self, inner: RenderServicer) -> None:
        self._inner.open(inner)

    def _ready(self) -> RenderServicer:
        return self._inner.get()

    async def RenderChat(self, request, context):
        return await self._ready().RenderChat(request, context)

    async def RenderCompletion(self, request, context):
        return await self._ready().RenderCompletion(request, context)

    async def Tokenize(self, request, context):
        return await self._ready().Tokenize(request, context)

    async def GetModelInfo(self, request, context):
        return await self._ready().GetModelInfo(request, context)


async def serve(config: RenderConfig, phases: StartupPhases | None = None) -> None:
    """Serve until SIGTERM/SIGINT: in this process (workers=1) or as a supervisor of worker processes."""
    workers = config.resolved_workers()
    if workers == 1:
        running = await create_server(config, phases)
        await run_until_signal(running)
        return
    # Fail fast (ConfigError: one line, exit 2) on a bad --model or a port another program holds,
    # and build a tiny model once rather than in every worker.
    resolve_model(config.model)
    check_can_listen(config.address, reuse_port=True)
    if config.health_address:
        check_can_listen(config.health_address, reuse_port=True, flag="--health-address")
    code = await WorkerPool(config, workers, create_server).run()
    if code:
        sys.exit(code)
