"""The RenderService servicer: thin. CPU-bound rendering runs on a worker thread so the event loop
(health checks, other calls) stays responsive."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from tito.logs import bind_request_id, request_id_var
from tito.v1 import render_pb2_grpc

from tito_render.renderer import Renderer, new_request_id


class RenderServicer(render_pb2_grpc.RenderServiceServicer):
    def __init__(self, renderer: Renderer, executor: Executor) -> None:
        self._renderer = renderer
        self._executor = executor

    async def _run(self, fn: Callable[..., Any], *args: Any) -> Any:
        # Copy the request-id binding into the worker thread so its log lines carry it too.
        request_id = request_id_var.get()

        def call() -> Any:
            bind_request_id(request_id)
            return fn(*args)

        return await asyncio.get_running_loop().run_in_executor(self._executor, call)

    def _with_request_id(self, request: Any) -> Any:
        """Give the request its final id up front, so every log line of this call carries it."""
        if not request.request_id:
            request = type(request).FromString(request.SerializeToString())
            request.request_id = new_request_id("")
        bind_request_id(request.request_id)
        return request

    async def RenderChat(self, request, context):
        request = self._with_request_id(request)
        return await self._run(self._renderer.render_chat, request)

    async def RenderCompletion(self, request, context):
        request = self._with_request_id(request)
        return await self._run(self._renderer.render_completion, request)

    async def Tokenize(self, request, context):
        return await self._run(self._renderer.tokenize, request)

    async def GetModelInfo(self, request, context):
        return self._renderer.model_info()


def add_to_server(servicer: RenderServicer, server) -> None:
    render_pb2_grpc.add_RenderServiceServicer_to_server(servicer, server)

