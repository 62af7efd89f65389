"""Derender server: factory, CLI flags and entry point (thin; the work is in the domain modules)."""

from __future__ import annotations

import argparse
import asyncio
import logging
from pathlib import Path

from tito import settings
from tito_models.paths import resolve_model
from tito.serving import RunningServer, observability, run_until_signal, start_server
from tito.settings import add_settings
from tito.startup import StartupPhases, loading_model
from tito.v1 import derender_pb2_grpc
from tito_derender.config import DerenderConfig
from tito_derender.resume import StateSealer
from tito_derender.observe import DerenderMetrics
from tito_derender.servicer import DerenderServicer
from tito_derender.tokenizer import TextTokenizer

SERVICE_NAME = "tito.v1.DerenderService"

log = logging.getLogger(__name__)


#: The typed config whose field declarations give this service's flags (tito.settings).
CONFIG = DerenderConfig


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Derender's own flags (few: all output options arrive per request in DerenderContext)."""
    add_settings(parser, DerenderConfig, common=False)


def config_from_args(args: argparse.Namespace) -> DerenderConfig:
    config = settings.config_from_args(DerenderConfig, args)
    config.validate()
    return config


async def create_server(config: DerenderConfig, phases: StartupPhases | None = None) -> RunningServer:
    """Start NOT_SERVING, load the tokenizer off the event loop, then go SERVING.

    The servicer is registered before the tokenizer exists (grpc.aio takes services only before
    start); calls that arrive meanwhile get UNAVAILABLE, and health says NOT_SERVING.
    """
    phases = phases or StartupPhases()
    config.validate()
    servicer = DerenderServicer(sealer=StateSealer(config.state_key()))
    metrics = observability(config, "derender")
    if metrics is not None:
        servicer.metrics = DerenderMetrics(metrics, lambda: servicer.live_streams)
    with phases.phase("bind"):
        running = await start_server(
            config, (SERVICE_NAME,),
            lambda server: derender_pb2_grpc.add_DerenderServiceServicer_to_server(servicer, server), metrics)
    running.derender_servicer = servicer  # for tests and operators: live stream count
    running.add_closer(servicer.drain)  # batch calls end as shutdown begins, once their streams have
    cache = Path(config.model_cache_dir) if config.model_cache_dir else None
    try:
        with phases.phase("model load", "tokenizer"), loading_model(config.model):
            tokenizer = await asyncio.to_thread(lambda: TextTokenizer.load(resolve_model(config.model, cache)))
    except BaseException:
        await running.stop(0)
        raise
    servicer.set_tokenizer(tokenizer)
    log.info("derender ready: tokenizer of %s (vocab %d, %d special tokens)", config.model,
             tokenizer.vocab_size, len(tokenizer.special_ids))
    await running.set_serving()
    phases.serving()
    return running


async def serve(config: DerenderConfig, phases: StartupPhases | None = None) -> None:
    running = await create_server(config, phases)
    await run_until_signal(running)
