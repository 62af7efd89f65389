"""Render server: factory, CLI flags and standalone entry point."""

from __future__ import annotations

import argparse
import asyncio
from concurrent.futures import ThreadPoolExecutor

from tito.errors import Unavailable
from tito.logs import setup_logging
from tito.serving import RunningServer, run_until_signal, start_server
from tito.v1 import render_pb2

from tito_render.config import AUTO, NONE, REASONING_PARSERS, TOOL_PARSERS, RenderConfig
from tito_render.model import load_render_model
from tito_render.renderer import Renderer
from tito_render.servicer import RenderServicer, add_to_server

SERVICE_NAME = render_pb2.DESCRIPTOR.services_by_name["RenderService"].full_name


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Render's own flags (the common ones come from the tito CLI)."""
    parser.add_argument("--max-model-len", type=int, default=0,
                        help="context limit in tokens (default 0: the model's own)")
    parser.add_argument("--reasoning-parser", default=AUTO, choices=(AUTO, NONE, *REASONING_PARSERS),
                        help="reasoning parser named in DerenderContext (auto: qwen3 when the tokenizer has "
                             "<think>/</think>)")
    parser.add_argument("--tool-parser", default=AUTO, choices=(AUTO, NONE, *TOOL_PARSERS),
                        help="tool-call parser named in DerenderContext (auto: hermes when the tokenizer has "
                             "<tool_call>)")
    parser.add_argument("--workers", type=int, default=1, help="render workers (only 1 in this version)")


def config_from_args(args: argparse.Namespace) -> RenderConfig:
    config = RenderConfig(
        address=args.address, model=args.model, log_level=args.log_level,
        max_message_bytes=args.max_message_bytes, grace_seconds=args.grace_seconds,
        max_model_len=args.max_model_len, reasoning_parser=args.reasoning_parser,
        tool_parser=args.tool_parser, workers=args.workers)
    config.validate()
    return config


async def create_server(config: RenderConfig) -> RunningServer:
    """Start NOT_SERVING, load the tokenizer off the loop, register, then go SERVING."""
    config.validate()
    executor = ThreadPoolExecutor(max_workers=config.workers, thread_name_prefix="render")
    servicer_slot: list[RenderServicer] = []

    def register(server) -> None:
        # The servicer is created before the model is loaded; it must exist at registration time.
        servicer = _LazyServicer()
        servicer_slot.append(servicer)
        add_to_server(servicer, server)

    running = await start_server(config, [SERVICE_NAME], register)
    running.add_cleanup(lambda: executor.shutdown(wait=False, cancel_futures=True))
    try:
        model = await asyncio.get_running_loop().run_in_executor(executor, load_render_model, config)
    except BaseException:
        await running.stop(0)
        raise
    servicer_slot[0].attach(RenderServicer(Renderer(model), executor))
    await running.set_serving()
    return running


class _LazyServicer(RenderServicer):
    """Answers UNAVAILABLE until the model is loaded, then delegates."""

    def __init__(self) -> None:  # noqa: D107 - no renderer yet
        self._inner: RenderServicer | None = None

    def attach(self, inner: RenderServicer) -> None:
        self._inner = inner

    def _ready(self) -> RenderServicer:
        if self._inner is None:
            raise Unavailable("render is loading its model; retry shortly", reason="LOADING")
        return self._inner

    async def RenderChat(self, request, context):
        return await self._ready().RenderChat(request, context)

    async def RenderCompletion(self, request, context):
        return await self._ready().RenderCompletion(request, context)

    async def Tokenize(self, request, context):
        return await self._ready().Tokenize(request, context)

    async def GetModelInfo(self, request, context):
        return await self._ready().GetModelInfo(request, context)


async def serve(config: RenderConfig) -> None:
    running = await create_server(config)
    await run_until_signal(running)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="tito-render", description="tito render service")
    parser.add_argument("--address", default="127.0.0.1:50051")
    parser.add_argument("--model", default="tiny-qwen2")
    parser.add_argument("--device", default="cpu", help="ignored: render runs on CPU")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--max-message-bytes", type=int, default=RenderConfig.max_message_bytes)
    parser.add_argument("--grace-seconds", type=float, default=RenderConfig.grace_seconds)
    add_arguments(parser)
    args = parser.parse_args(argv)
    setup_logging(args.log_level, "render")
    asyncio.run(serve(config_from_args(args)))


if __name__ == "__main__":
    main()
