"""The RenderService servicer: thin. CPU-bound rendering runs on a worker thread so the event loop
(health checks, other calls) stays responsive."""

from __future__ import annotations

import asyncio
import contextvars
import os
import time
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any

from tito.logs import bind_request_id, request_id_var
from tito.v1 import render_pb2_grpc

from tito_render.convert import chat_response, completion_response, model_info_to_proto, tokenize_response
from tito_render.deadline import WATCHDOG
from tito_render.observe import RenderMetrics
from tito_render.renderer import Renderer, new_request_id


#: Trailing metadata key naming the process that served a call (several workers share one port).
WORKER_PID_KEY = "x-tito-worker-pid"


#: Requests up to this size (serialized bytes) without media or a chat_template override render on
#: the event loop itself: a small text chat with the model's own template takes well under a
#: millisecond, about what the hop to a thread and back costs. Larger ones, client templates (whose
#: run time the client decides) and everything with images go to the render threads, so the loop
#: (health checks, other calls) never waits long.
INLINE_MAX_REQUEST_BYTES = 16 * 1024


def has_media(request: Any) -> bool:
    return any(len(message.content_parts) and any(part.WhichOneof("part") != "text"
                                                  for part in message.content_parts)
               for message in request.messages)


class RenderServicer(render_pb2_grpc.RenderServiceServicer):
    def __init__(self, renderer: Renderer, executor: Executor, metrics: RenderMetrics | None = None) -> None:
        self._renderer = renderer
        self._executor = executor
        self._metrics = metrics
        if metrics is not None:
            renderer.on_media_processed = metrics.media_processed

    async def _run(self, fn: Callable[..., Any], *args: Any, inline: bool = False) -> Any:
        if inline:
            return fn(*args)
        # Copy the request-id binding into the worker thread so its log lines carry it too.
        request_id = request_id_var.get()
        token = object()  # this call, for the template watchdog

        def call() -> Any:
            bind_request_id(request_id)
            with WATCHDOG.owned_by(token):
                return fn(*args)

        try:
            # In the call's context: the spans the renderer opens are children of the RPC's span.
            return await asyncio.get_running_loop().run_in_executor(self._executor, contextvars.copy_context().run,
                                                                    call)
        except asyncio.CancelledError:
            WATCHDOG.expire(token)  # the caller went away: stop its template now, not at its deadline
            raise

    @staticmethod
    def _mark_worker(context: Any) -> None:
        context.set_trailing_metadata(((WORKER_PID_KEY, str(os.getpid())),))

    @staticmethod
    def _request_id(request: Any) -> str:
        """The request's final id, chosen up front so every log line of this call carries it."""
        request_id = new_request_id(request.request_id)
        bind_request_id(request_id)
        return request_id

    async def RenderChat(self, request, context):
        self._mark_worker(context)
        request_id = self._request_id(request)
        # Cheapest checks first: ByteSize() serializes the message (upb), which for a request
        # carrying a large image costs milliseconds.
        inline = (not has_media(request) and not request.HasField("chat_template")
                  and request.ByteSize() <= INLINE_MAX_REQUEST_BYTES)
        started = time.perf_counter()
        response = await self._run(chat_response, self._renderer, request, request_id, context.time_remaining(),
                                   inline=inline)
        self._rendered("chat", started, len(response.generate_request.token_ids))
        return response

    async def RenderCompletion(self, request, context):
        self._mark_worker(context)
        request_id = self._request_id(request)
        started = time.perf_counter()
        response = await self._run(completion_response, self._renderer, request, request_id,
                                   inline=request.ByteSize() <= INLINE_MAX_REQUEST_BYTES)
        self._rendered("completion", started, len(response.generate_request.token_ids))
        return response

    async def Tokenize(self, request, context):
        started = time.perf_counter()
        response = await self._run(tokenize_response, self._renderer, request,
                                   inline=request.ByteSize() <= INLINE_MAX_REQUEST_BYTES)
        self._rendered("tokenize", started, len(response.token_ids))
        return response

    def _rendered(self, kind: str, started: float, tokens: int) -> None:
        if self._metrics is not None:
            self._metrics.rendered(kind, started, tokens)

    async def GetModelInfo(self, request, context):
        return model_info_to_proto(self._renderer)


def add_to_server(servicer: RenderServicer, server) -> None:
    render_pb2_grpc.add_RenderServiceServicer_to_server(servicer, server)

