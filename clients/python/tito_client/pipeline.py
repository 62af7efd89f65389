"""Client for the whole path: render -> engine -> derender, streaming chat chunks.

This is what a router does, in Python: render the chat, forward the `GenerateRequest` to the
engine unchanged, and feed the derender stream its `DerenderContext` followed by every engine
message as it arrives. When derender ends a choice itself (a stop string matched) it sets
`cancel_generation`, and the pipeline cancels the engine stream so the engine frees the slot.
Every call carries a deadline.

`ChatPipeline` is synchronous (a chat per thread); `AsyncChatPipeline` is the same on asyncio,
for a router that serves many chats at once from one event loop. Either takes an
`routing.EngineRouter` to spread chats over several engines (cache-aware by default): each
rendered request goes to the engine the router picks, and an engine that fails with UNAVAILABLE
is left out of later picks at once, while the chats it was serving continue on another engine
(request migration: engine_stream.py, migration.py).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tito import tracing
from tito.security import ClientSecurity
from tito_client.derender_batch import DerenderBatcher
from tito_client.disaggregation import Prefill, place, place_blocking
from tito_client.engine_stream import AsyncMigratingStream, MigratingStream
from tito_client.routing import EngineRouter
from tito.v1 import (
    derender_pb2,
    derender_pb2_grpc,
    engine_pb2,
    engine_pb2_grpc,
    render_pb2,
    render_pb2_grpc,
)

log = logging.getLogger(__name__)

#: Called once, with no arguments, when a chat's engine stream delivers its first response.
OnGenerating = Callable[[], None]
#: Called with each engine response of a chat and the address of the engine that sent it.
OnResponse = Callable[[engine_pb2.GenerateResponse, str], None]
#: Gives a chat's render answer (a RenderChatResponse or RenderCompletionResponse), its calls
#: carrying the given gRPC metadata (the chat span's trace context).
Prepare = Callable[[list[tuple[str, str]] | None], Awaitable]


@dataclass(frozen=True)
class Endpoints:
    """Addresses of the three services (host:port or unix:/path)."""

    render: str
    engine: str
    derender: str


def wait_until_serving(address: str, service: str = "", timeout: float = 120.0,
                       security: ClientSecurity = ClientSecurity()) -> None:
    """Poll the standard health service until `service` is SERVING, or raise TimeoutError."""
    deadline = time.monotonic() + timeout
    last = "no answer"
    with security.channel(address) as channel:
        stub = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline:
            try:
                reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2.0)
                if reply.status == health_pb2.HealthCheckResponse.SERVING:
                    return
                last = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                last = exc.code().name
            time.sleep(0.1)
    raise TimeoutError(f"{address} did not become SERVING within {timeout:.0f}s (last status: {last})")


def _message_limits(max_message_bytes: int) -> list[tuple[str, int]]:
    return [("grpc.max_receive_message_length", max_message_bytes),
            ("grpc.max_send_message_length", max_message_bytes)]


def _channel_options(address: str, max_message_bytes: int) -> list[tuple[str, object]]:
    """A channel's options: the message limits, and for a `dns:///name:port` target (a headless
    Service: one address per replica) gRPC's round_robin over every address it resolves to."""
    options: list[tuple[str, object]] = list(_message_limits(max_message_bytes))
    if address.startswith("dns:"):
        options.append(("grpc.lb_policy_name", "round_robin"))
    return options


class _Cancellation:
    """Whether the pipeline cancelled a chat's engine stream itself: only then is the stream's
    CANCELLED status expected and quiet. A CANCELLED the engine's server sent (it shut down with
    the stream open) is an engine error the caller must see, never a silently shortened chat."""

    def __init__(self, generation):
        self._generation = generation
        self._requested = False

    def cancel(self) -> None:
        self._requested = True
        self._generation.cancel()

    def expected(self, error: grpc.RpcError) -> bool:
        return self._requested and error.code() == grpc.StatusCode.CANCELLED


class ChatPipeline:
    """Synchronous client running chats through the three services."""

    def __init__(self, endpoints: Endpoints, timeout: float = 300.0, max_message_bytes: int = 64 * 1024 * 1024,
                 security: ClientSecurity = ClientSecurity(), router: EngineRouter | None = None):
        """`security`: TLS / mutual TLS / bearer token for all three services (tito.security).
        `router`: pick an engine per chat among its engines (endpoints.engine is then unused)."""
        self.timeout = timeout
        options = _message_limits(max_message_bytes)
        self._security, self._options, self.router = security, options, router
        self._channels = [security.channel(a, options=options)
                          for a in (endpoints.render, endpoints.engine, endpoints.derender)]
        self.render = render_pb2_grpc.RenderServiceStub(self._channels[0])
        self.engine = engine_pb2_grpc.EngineServiceStub(self._channels[1])
        self.derender = derender_pb2_grpc.DerenderServiceStub(self._channels[2])
        self._engines: dict[str, engine_pb2_grpc.EngineServiceStub] = {}
        self.last_engine: str | None = None  # where the latest chat went (with a router)

    def _engine_at(self, address: str) -> engine_pb2_grpc.EngineServiceStub:
        stub = self._engines.get(address)
        if stub is None:
            channel = self._security.channel(address, options=self._options)
            self._channels.append(channel)
            stub = self._engines[address] = engine_pb2_grpc.EngineServiceStub(channel)
        return stub

    def close(self) -> None:
        for channel in self._channels:
            channel.close()

    def __enter__(self) -> "ChatPipeline":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def stream_chat(self, request: render_pb2.RenderChatRequest) -> Iterator[derender_pb2.ChatChunk]:
        """Yield chat chunks as derender produces them.

        With tracing on (tito.tracing), the chat is one span whose W3C trace context the three
        calls carry in their metadata, so render, engine and derender add to one trace."""
        chat_span = tracing.begin_client_span("chat")
        error: BaseException | None = None
        try:
            yield from self._stream_chat(request, tracing.inject(parent=chat_span))
        except BaseException as exc:
            error = exc if not isinstance(exc, GeneratorExit) else None
            raise
        finally:
            tracing.end_span(chat_span, error)

    def _stream_chat(self, request: render_pb2.RenderChatRequest, metadata) -> Iterator[derender_pb2.ChatChunk]:
        rendered = self.render.RenderChat(request, timeout=self.timeout, metadata=metadata)
        if self.router is None:
            yield from self._generate(rendered, self.engine.Generate(rendered.generate_request, timeout=self.timeout,
                                                                     metadata=metadata), metadata)
            return
        def prefill(address: str, request: engine_pb2.GenerateRequest) -> list[engine_pb2.GenerateResponse]:
            return list(self._engine_at(address).Generate(request, timeout=self.timeout, metadata=metadata))

        address, placed = place_blocking(self.router, rendered.generate_request, prefill)
        self.last_engine = address
        generation = MigratingStream(self.router, lambda where, generate: self._engine_at(where).Generate(
            generate, timeout=self.timeout, metadata=metadata), placed, address)
        try:
            yield from self._generate(rendered, generation, metadata)
        finally:
            self.last_engine = generation.address

    def _generate(self, rendered, generation, metadata) -> Iterator[derender_pb2.ChatChunk]:
        """`generation`: the engine's Generate call, or a MigratingStream standing for it."""
        engine_errors: list[grpc.RpcError] = []
        cancellation = _Cancellation(generation)

        def derender_requests():
            # Runs on grpc's request-sending thread. An engine error must reach the caller as the
            # engine's status, so it is kept and re-raised below instead of breaking this stream.
            yield derender_pb2.DerenderRequest(context=rendered.derender_context)
            try:
                for response in generation:
                    yield derender_pb2.DerenderRequest(generate_response=response)
            except grpc.RpcError as exc:
                if not cancellation.expected(exc):
                    engine_errors.append(exc)

        chunks = self.derender.Derender(derender_requests(), timeout=self.timeout, metadata=metadata)
        try:
            for reply in chunks:
                if reply.chunk.cancel_generation:
                    cancellation.cancel()
                yield reply.chunk
        except grpc.RpcError:
            if engine_errors:
                raise engine_errors[0] from None
            raise
        finally:
            cancellation.cancel()
            chunks.cancel()
        if engine_errors:
            raise engine_errors[0]


@dataclass(frozen=True)
class _Running:
    """Where a `generate` call runs now, for `abort`: its engine and the id that engine knows it by
    (both change when the request moves to another engine)."""

    engine: Callable[[], engine_pb2_grpc.EngineServiceStub]
    request_id: Callable[[], str]
    address: Callable[[], str]


class AsyncChatPipeline:
    """`ChatPipeline` on asyncio (grpc.aio): many chats from one event loop, each a task.

    Use it inside a running event loop (`async with AsyncChatPipeline(...) as pipeline`)."""

    def __init__(self, endpoints: Endpoints, timeout: float = 300.0, max_message_bytes: int = 64 * 1024 * 1024,
                 security: ClientSecurity = ClientSecurity(), router: EngineRouter | None = None,
                 sidecar_security: ClientSecurity | None = None, batch_derender: bool = False):
        """`router`: spread chats over several engines (routing.EngineRouter); `sidecar_security`:
        the TLS for render and derender when it differs from the engines' (plaintext Unix-socket
        sidecars beside TLS engines); the token is `security`'s for all. `batch_derender`: every
        chat's derender stream goes over one DerenderBatch call (derender_batch.py) instead of a
        Derender call each: one message per engine step for all chats, for a router serving many."""
        self.timeout = timeout
        self._max_message_bytes = max_message_bytes
        self._security, self.router = security, router
        self._engine_address = endpoints.engine
        beside = security if sidecar_security is None else sidecar_security
        self._channels = [side.aio_channel(a, options=_channel_options(a, max_message_bytes))
                          for side, a in ((beside, endpoints.render), (security, endpoints.engine),
                                          (beside, endpoints.derender))]
        self._metadata = security.call_metadata()
        self.render = render_pb2_grpc.RenderServiceStub(self._channels[0])
        self.engine = engine_pb2_grpc.EngineServiceStub(self._channels[1])
        self.derender = derender_pb2_grpc.DerenderServiceStub(self._channels[2])
        self._engines: dict[str, engine_pb2_grpc.EngineServiceStub] = {}
        self.last_engine: str | None = None  # where the latest chat went (with a router)
        self.derender_batcher = DerenderBatcher(self.derender, self._metadata) if batch_derender else None
        #: The engine of each request `generate` is running, by request id, for `abort`.
        self._generating: dict[str, _Running] = {}

    def _engine_at(self, address: str) -> engine_pb2_grpc.EngineServiceStub:
        stub = self._engines.get(address)
        if stub is None:
            channel = self._security.aio_channel(address, options=_channel_options(address, self._max_message_bytes))
            self._channels.append(channel)
            stub = self._engines[address] = engine_pb2_grpc.EngineServiceStub(channel)
        return stub

    async def close(self) -> None:
        if self.derender_batcher is not None:
            await self.derender_batcher.close()
        for channel in self._channels:
            await channel.close()

    async def __aenter__(self) -> "AsyncChatPipeline":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def stream_chat(self, request: render_pb2.RenderChatRequest, on_generating: OnGenerating | None = None
                          ) -> AsyncIterator[derender_pb2.ChatChunk]:
        """Yield chat chunks as derender produces them (tracing as in `ChatPipeline.stream_chat`;
        the span carries the request's id). `on_generating` is called once, when the engine's first
        response arrives (before derender has turned it into text): the gateway starts its stream
        there, as vLLM's server sends its first chunk on the engine's first output."""
        async for chunk in self._traced("chat", request, self.render.RenderChat, on_generating):
            yield chunk

    async def stream_completion(self, request: render_pb2.RenderCompletionRequest,
                                on_generating: OnGenerating | None = None) -> AsyncIterator[derender_pb2.ChatChunk]:
        """A raw prompt (text or token ids) through RenderCompletion -> engine -> derender: chunks
        as for a chat, with the text in `content` (a completion has no parsers)."""
        async for chunk in self._traced("completion", request, self.render.RenderCompletion, on_generating):
            yield chunk

    async def generate(self, request: engine_pb2.GenerateRequest) -> AsyncIterator[engine_pb2.GenerateResponse]:
        """The engine's responses to a request rendered already (token ids in, token ids out: no
        render, no derender), from the engine the router picks as for a chat, moved to another
        engine as a chat is when its engine goes away. While it runs, `abort` reaches it by its
        request id."""
        if self.router is None:
            generation = self.engine.Generate(request, timeout=self.timeout, metadata=self._metadata)
            running = _Running(lambda: self.engine, lambda: request.request_id, lambda: self._engine_address)
        else:
            address, placed = await place(self.router, request, self._prefill_with(self._metadata))
            self.last_engine = address
            generation = AsyncMigratingStream(self.router, lambda where, generate: self._engine_at(where).Generate(
                generate, timeout=self.timeout, metadata=self._metadata), placed, address)
            running = _Running(lambda: self._engine_at(generation.address), lambda: generation.request_id,
                               lambda: generation.address)
        rid = request.request_id
        if rid:
            self._generating[rid] = running
        try:
            async for response in generation:
                yield response
        finally:
            if rid and self._generating.get(rid) is running:
                del self._generating[rid]

    def _prefill_with(self, metadata) -> Prefill:
        """Runs a prefill request on an engine and returns its responses (disaggregation.place
        reads the handle or the connector's answer from them)."""
        async def prefill(address: str, request: engine_pb2.GenerateRequest) -> list[engine_pb2.GenerateResponse]:
            call = self._engine_at(address).Generate(request, timeout=self.timeout, metadata=metadata)
            return [response async for response in call]
        return prefill

    def engine_address(self, request_id: str) -> str | None:
        """Where the request `generate` is running (by the caller's id) now, None when it is not:
        the address a prefill answer names for its decode engine to pull from."""
        running = self._generating.get(request_id)
        return running.address() if running is not None else None

    async def abort(self, request_ids: list[str]) -> list[str]:
        """Abort the requests `generate` is running (by id) on the engines serving them now: their
        streams end with FINISH_REASON_ABORT. Ids it is not running are skipped; returns those
        aborted (by the ids the caller gave)."""
        by_engine: dict[int, tuple[engine_pb2_grpc.EngineServiceStub, dict[str, str]]] = {}
        for rid in request_ids:
            running = self._generating.get(rid)
            if running is not None:
                engine = running.engine()
                by_engine.setdefault(id(engine), (engine, {}))[1][running.request_id()] = rid
        aborted: list[str] = []
        for engine, callers_ids in by_engine.values():
            reply = await engine.Abort(engine_pb2.AbortRequest(request_ids=list(callers_ids)), timeout=self.timeout,
                                       metadata=self._metadata)
            aborted.extend(callers_ids[engine_id] for engine_id in reply.aborted_request_ids
                           if engine_id in callers_ids)
        return aborted

    async def stream_prepared(self, name: str, request_id: str, prepare: Prepare,
                              on_generating: OnGenerating | None = None, on_response: OnResponse | None = None
                              ) -> AsyncIterator[derender_pb2.ChatChunk]:
        """Chat chunks for the render answer `prepare(metadata)` gives (render called now with
        that metadata, or an answer the caller kept and adjusted): the engine the router picks,
        then derender, as `stream_chat` does after render, in the same span (`name`, carrying
        `request_id`), so a chat the caller prepares is traced as a plain one. `on_response` sees
        each engine response (a prefill's handoff is in its last one)."""
        async for chunk in self._spanned(name, request_id, prepare, on_generating, on_response):
            yield chunk

    async def check_health(self, timeout: float = 2.0) -> dict[str, str]:
        """Each service's health status name ("SERVING", "NOT_SERVING", or the gRPC code of a
        failed check), by service: render, engine, derender."""
        async def one(channel) -> str:
            try:
                reply = await health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(service=""), timeout=timeout)
                return health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
            except grpc.RpcError as exc:
                return exc.code().name
        states = await asyncio.gather(*(one(channel) for channel in self._channels))
        return dict(zip(("render", "engine", "derender"), states))

    def _traced(self, name: str, request, render_call, on_generating: OnGenerating | None
                ) -> AsyncIterator[derender_pb2.ChatChunk]:
        return self._spanned(name, request.request_id,
                             lambda metadata: render_call(request, timeout=self.timeout, metadata=metadata),
                             on_generating)

    async def _spanned(self, name: str, request_id: str, prepare: Prepare, on_generating: OnGenerating | None,
                       on_response: OnResponse | None = None) -> AsyncIterator[derender_pb2.ChatChunk]:
        """One span (`name`) around a request's render answer and its engine and derender calls,
        whose trace context every call carries."""
        chat_span = tracing.begin_client_span(name, **({"tito.request_id": request_id} if request_id else {}))
        error: BaseException | None = None
        try:
            metadata = tracing.inject(self._metadata, parent=chat_span)
            rendered = await prepare(metadata)
            async for chunk in self._stream_rendered(rendered, metadata, on_generating, on_response):
                yield chunk
        except BaseException as exc:
            error = exc if not isinstance(exc, (GeneratorExit, asyncio.CancelledError)) else None
            raise
        finally:
            tracing.end_span(chat_span, error)

    async def _stream_rendered(self, rendered, metadata, on_generating: OnGenerating | None,
                               on_response: OnResponse | None = None) -> AsyncIterator[derender_pb2.ChatChunk]:
        if self.router is None:
            generation = self.engine.Generate(rendered.generate_request, timeout=self.timeout, metadata=metadata)
            watch = _watch(on_response, lambda: self._engine_address)
            async for chunk in self._generate(rendered, generation, metadata, on_generating, watch):
                yield chunk
            return
        address, placed = await place(self.router, rendered.generate_request, self._prefill_with(metadata))
        self.last_engine = address
        generation = AsyncMigratingStream(self.router, lambda where, generate: self._engine_at(where).Generate(
            generate, timeout=self.timeout, metadata=metadata), placed, address)
        try:
            async for chunk in self._generate(rendered, generation, metadata, on_generating,
                                              _watch(on_response, lambda: generation.address)):
                yield chunk
        finally:
            self.last_engine = generation.address

    async def _generate(self, rendered, generation, metadata, on_generating: OnGenerating | None,
                        watch: Callable | None = None) -> AsyncIterator[derender_pb2.ChatChunk]:
        """`generation`: the engine's Generate call, or an AsyncMigratingStream standing for it;
        `watch`: called with each of its responses."""
        if self.derender_batcher is not None:
            async for chunk in self._generate_batched(rendered, generation, on_generating, watch):
                yield chunk
            return
        engine_errors: list[grpc.RpcError] = []
        cancellation = _Cancellation(generation)

        async def derender_requests():
            # As in ChatPipeline: an engine error reaches the caller as the engine's status.
            yield derender_pb2.DerenderRequest(context=rendered.derender_context)
            try:
                async for response in _announced(generation, on_generating, watch):
                    yield derender_pb2.DerenderRequest(generate_response=response)
            except asyncio.CancelledError:
                # grpc.aio ends a stream this pipeline cancelled (derender asked it to) this way;
                # the requests then simply end. Any other cancellation goes on.
                if not generation.cancelled():
                    raise
            except grpc.RpcError as exc:
                if not cancellation.expected(exc):
                    engine_errors.append(exc)

        chunks = self.derender.Derender(derender_requests(), timeout=self.timeout, metadata=metadata)
        try:
            async for reply in chunks:
                if reply.chunk.cancel_generation:
                    cancellation.cancel()
                yield reply.chunk
        except grpc.RpcError:
            if engine_errors:
                raise engine_errors[0] from None
            raise
        finally:
            cancellation.cancel()
            chunks.cancel()
        if engine_errors:
            raise engine_errors[0]

    async def _generate_batched(self, rendered, generation, on_generating: OnGenerating | None,
                                watch: Callable | None = None) -> AsyncIterator[derender_pb2.ChatChunk]:
        """`_generate` with the chat's derender stream on the shared DerenderBatch call: a task
        forwards the engine's responses, and the chunks come back through the batcher."""
        stream = self.derender_batcher.open(rendered.derender_context, self.timeout)
        engine_errors: list[grpc.RpcError] = []
        cancellation = _Cancellation(generation)

        async def forward() -> None:
            try:
                async for response in _announced(generation, on_generating, watch):
                    stream.send(response)
            except asyncio.CancelledError:
                if not generation.cancelled():  # as in _generate: the pipeline cancelled the engine
                    raise
            except grpc.RpcError as exc:
                if not cancellation.expected(exc):
                    engine_errors.append(exc)
            finally:
                stream.close()  # the engine is done: derender ends the stream (if it has not already)

        forwarding = asyncio.ensure_future(forward())
        try:
            async for chunk in stream.chunks():
                if chunk.cancel_generation:
                    cancellation.cancel()
                yield chunk
        except grpc.RpcError:
            if engine_errors:
                raise engine_errors[0] from None
            raise
        finally:
            cancellation.cancel()
            forwarding.cancel()
        if engine_errors:
            raise engine_errors[0]


async def _announced(generation, on_generating: OnGenerating | None, watch: Callable | None = None
                     ) -> AsyncIterator:
    """The engine stream's responses, calling `on_generating` (when given) before the first and
    `watch` (when given) with each."""
    async for response in generation:
        if on_generating is not None:
            on_generating()
            on_generating = None
        if watch is not None:
            watch(response)
        yield response


def _watch(on_response: OnResponse | None, address: Callable[[], str]) -> Callable | None:
    """`on_response` with the address of the engine serving the chat when the response came."""
    if on_response is None:
        return None
    return lambda response: on_response(response, address())
