"""Engine server: factory, CLI flags and entry point. gRPC wiring only; the work is in engine.py."""

from __future__ import annotations

import argparse
import asyncio
import logging

from tito.logs import setup_logging
from tito.model_paths import DEFAULT_MODEL, resolve_model
from tito.serving import RunningServer, run_until_signal, start_server
from tito.v1 import engine_pb2_grpc

from .config import EngineConfig
from .engine import Engine
from .model_runner import ModelRunner
from .servicer import EngineServicer

SERVICE_NAME = "tito.v1.EngineService"

log = logging.getLogger(__name__)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Engine-only flags (the tito CLI adds --address, --model, --device and the other common ones)."""
    parser.add_argument("--max-running-requests", type=int, default=64,
                        help="most choices advanced together in one scheduler step (default 64)")
    parser.add_argument("--max-waiting-requests", type=int, default=1024,
                        help="most requests queued for a slot; beyond it Generate answers RESOURCE_EXHAUSTED "
                             "(default 1024)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="per-request context limit (prompt + generated); default: the model's "
                             "max_position_embeddings")
    parser.add_argument("--max-choices-per-request", type=int, default=16,
                        help="largest n (choices per request) accepted (default 16)")


def config_from_args(args: argparse.Namespace) -> EngineConfig:
    config = EngineConfig(
        address=args.address,
        max_message_bytes=args.max_message_bytes,
        grace_seconds=args.grace_seconds,
        log_level=args.log_level,
        model=args.model,
        device=args.device,
        max_running_requests=args.max_running_requests,
        max_waiting_requests=args.max_waiting_requests,
        max_model_len=args.max_model_len,
        max_choices_per_request=args.max_choices_per_request,
    )
    config.validate()
    return config


def _build_engine(config: EngineConfig) -> Engine:
    model_dir = resolve_model(config.model)
    runner = ModelRunner(model_dir, model_id=config.model, device=config.device,
                         max_model_len=config.max_model_len)
    return Engine(runner, max_running_requests=config.max_running_requests,
                  max_waiting_requests=config.max_waiting_requests,
                  max_choices_per_request=config.max_choices_per_request)


async def create_server(config: EngineConfig) -> RunningServer:
    """Start the server NOT_SERVING, load the model off the event loop, then turn SERVING."""
    config.validate()
    # The port is bound (health NOT_SERVING, calls answered UNAVAILABLE) while the model loads.
    servicer = EngineServicer()
    running = await start_server(
        config, [SERVICE_NAME], lambda server: engine_pb2_grpc.add_EngineServiceServicer_to_server(servicer, server))
    try:
        engine = await asyncio.to_thread(_build_engine, config)
    except BaseException:
        await running.stop(0)
        raise
    engine.start()
    running.add_cleanup(lambda: asyncio.to_thread(engine.stop))
    servicer.attach(engine)
    await running.set_serving()
    return running


async def serve(config: EngineConfig) -> None:
    running = await create_server(config)
    await run_until_signal(running)


def _add_common_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--address", default="127.0.0.1:50052", help="host:port or unix:/path.sock")
    parser.add_argument("--model", default=DEFAULT_MODEL, help="local HF model dir or a tiny model name")
    parser.add_argument("--device", default="auto", help="auto, cpu, cuda or cuda:N")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--max-message-bytes", type=int, default=EngineConfig.max_message_bytes)
    parser.add_argument("--grace-seconds", type=float, default=EngineConfig.grace_seconds)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tito-engine", description="tito engine: token ids in, tokens out")
    _add_common_arguments(parser)
    add_arguments(parser)
    args = parser.parse_args(argv)
    config = config_from_args(args)
    setup_logging(config.log_level, "engine")
    asyncio.run(serve(config))


if __name__ == "__main__":
    main()
