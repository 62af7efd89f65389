"""The HTTP layer: OpenAI's endpoints over the three services (Starlette; served by uvicorn).

Thin: each handler checks the caller (bearer token, body size, concurrency), parses the body into
render's request (openai_in), runs it through `AsyncChatPipeline` (upstream) and writes the
chunks in OpenAI's shapes (openai_out). Every error goes through `errors.from_exception`, the one
mapping. A streamed request reports an error found before its stream starts (a chat's at the
engine's first token, a completion's at its first text) as an HTTP status, and one found later as
an SSE `data: {"error": ...}` event before `[DONE]`. A client that goes away
cancels its request: the pipeline cancels the engine stream, which frees the engine's slot.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import re
import time
import uuid
from collections.abc import AsyncIterator, Callable

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from tito.errors import (InvalidArgument, NotFound, ResourceExhausted, TitoError, Unauthenticated,
                         Unavailable)
from tito.logs import bind_request_id
from tito.v1 import derender_pb2, render_pb2
from tito_gateway import merge, openai_in, openai_out
from tito_gateway.errors import UPSTREAM_ERROR, HttpError, from_exception
from tito_gateway.observe import CONTENT_TYPE, GatewayMetrics
from tito_gateway.upstream import Upstream
from tito_gateway.vllm_api.chat_extras import VllmChatCall, VllmCompletionCall
from tito_gateway.vllm_api.routes import VllmApi

log = logging.getLogger(__name__)

REQUEST_ID_HEADER = "x-request-id"
REQUEST_ID = re.compile(r"^[A-Za-z0-9._:\-]{1,128}$")
REQUEST_BODY_TOO_LARGE = "REQUEST_BODY_TOO_LARGE"
TOO_MANY_REQUESTS = "TOO_MANY_REQUESTS"
UNKNOWN_ENDPOINT = "UNKNOWN_ENDPOINT"
MODEL_LOADING = "MODEL_LOADING"
OPEN_PATHS = ("/health", "/metrics")
#: How long the engines' list of LoRA adapters is trusted, and how often a request naming an
#: adapter not on it may ask again (seconds).
ADAPTERS_MAX_AGE = 5.0
ADAPTERS_MIN_AGE = 0.5


def dumps(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def error_response(error: HttpError, headers: dict[str, str] | None = None) -> Response:
    return Response(dumps(error.json()), status_code=error.status, media_type="application/json", headers=headers)


class Gateway:
    """The gateway's state: the upstream pipeline, limits, the served model, metrics."""

    def __init__(self, upstream: Upstream, *, served_model_name: str = "", token: str = "",
                 auth_exempt_health: bool = True, max_body_bytes: int = 32 * 1024 * 1024,
                 max_concurrent_requests: int = 1024, body_timeout: float = 30.0, lora_updating: bool = False):
        """`lora_updating`: serve vLLM's POST /v1/load_lora_adapter and /v1/unload_lora_adapter."""
        self.upstream = upstream
        self.lora_updating = lora_updating
        self._model = served_model_name
        self._model_info: render_pb2.RenderServiceGetModelInfoResponse | None = None
        # The LoRA adapters `model` may name, as last asked of the engines, and when.
        self._adapters: list = []
        self._adapters_at = float("-inf")
        self._expected = f"Bearer {token}".encode() if token else None
        self.auth_exempt_health = auth_exempt_health
        self.max_body_bytes = max_body_bytes
        self.max_concurrent_requests = max_concurrent_requests
        self.body_timeout = body_timeout
        self.active = 0
        self.metrics = GatewayMetrics()
        self.created = int(time.time())
        self.vllm = VllmApi(self)  # vLLM's token-in/token-out endpoints and the chat's reuse path

    # -- the caller ------------------------------------------------------------------------------

    def authorize(self, request: Request) -> None:
        if self._expected is None or (self.auth_exempt_health and request.url.path in OPEN_PATHS):
            return
        supplied = request.headers.get("authorization")
        if supplied is None:
            raise Unauthenticated("this gateway requires `Authorization: Bearer <token>`", reason="AUTH_TOKEN_MISSING")
        if not hmac.compare_digest(supplied.encode("latin-1", "replace"), self._expected):
            raise Unauthenticated("the bearer token is not this gateway's", reason="AUTH_TOKEN_INVALID")

    async def read_body(self, request: Request) -> bytes:
        """The body, at most max_body_bytes (413 before reading when Content-Length says more), read
        within body_timeout (a client that trickles its body is cut off)."""
        declared = request.headers.get("content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body_bytes:
            raise self._too_large()
        parts, size = [], 0
        try:
            async with asyncio.timeout(self.body_timeout):
                async for part in request.stream():
                    size += len(part)
                    if size > self.max_body_bytes:
                        raise self._too_large()
                    parts.append(part)
        except TimeoutError:
            raise InvalidArgument(f"the request body did not arrive within {self.body_timeout:g}s",
                                  reason="MALFORMED_REQUEST") from None
        return b"".join(parts)

    def _too_large(self) -> ResourceExhausted:
        return ResourceExhausted(f"the request body is larger than this gateway accepts ({self.max_body_bytes} "
                                 f"bytes)", reason=REQUEST_BODY_TOO_LARGE)

    @staticmethod
    def request_id(request: Request) -> str:
        given = request.headers.get(REQUEST_ID_HEADER)
        if given is None:
            return uuid.uuid4().hex
        if not REQUEST_ID.match(given):
            raise InvalidArgument(f"{REQUEST_ID_HEADER}: 1 to 128 characters of letters, digits and ._:-",
                                  reason="INVALID_REQUEST", field=REQUEST_ID_HEADER)
        return given

    async def served_model(self) -> str:
        if not self._model:
            info = await self.model_info()
            self._model = info.model_id
        return self._model

    async def model_info(self) -> render_pb2.RenderServiceGetModelInfoResponse:
        if self._model_info is None:
            pipeline = self.upstream.pipeline
            self._model_info = await pipeline.render.GetModelInfo(render_pb2.RenderServiceGetModelInfoRequest(),
                                                                  timeout=10.0, metadata=pipeline._metadata)
        return self._model_info

    async def lora_adapters(self, wanted: str = "") -> list:
        """The engines' LoRA adapters (tito.v1.LoraAdapterInfo), asked again when the last answer
        is older than ADAPTERS_MAX_AGE seconds or lacks `wanted` (an adapter just loaded is
        usable at once), at most once per ADAPTERS_MIN_AGE."""
        age = time.monotonic() - self._adapters_at
        known = any(adapter.name == wanted for adapter in self._adapters) if wanted else True
        if age > ADAPTERS_MAX_AGE or (not known and age > ADAPTERS_MIN_AGE):
            self._adapters = await self.upstream.lora_adapters()
            self._adapters_at = time.monotonic()
        return self._adapters

    async def adapter_names(self, body: dict) -> frozenset[str]:
        """The adapters a request's `model` may name (none asked for when it is the served model)."""
        model = body.get("model") if isinstance(body, dict) else None
        if not isinstance(model, str) or model == await self.served_model():
            return frozenset()
        return frozenset(adapter.name for adapter in await self.lora_adapters(model))

    # -- endpoints --------------------------------------------------------------------------------

    async def chat_completions(self, request: Request) -> Response:
        return await self._completion(request, "chat", self.vllm.parse_chat, "chatcmpl-", self._chat_chunks)

    async def completions(self, request: Request) -> Response:
        return await self._completion(request, "completions", self.vllm.parse_completion, "cmpl-",
                                      self._completion_chunks)

    def _chat_chunks(self, call: openai_in.ChatCall, on_generating=None) -> AsyncIterator:
        if isinstance(call, VllmChatCall):  # vLLM's kv_transfer_params or echo
            return self.vllm.chat_chunks(call, on_generating)
        return self.upstream.pipeline.stream_chat(call.request, on_generating=on_generating)

    def _completion_chunks(self, call: openai_in.CompletionCall, on_generating=None) -> AsyncIterator:
        """Every prompt's request through the services at once, their chunks as one stream."""
        if isinstance(call, VllmCompletionCall):  # a prefill/decode part (vLLM's kv_transfer_params)
            return self.vllm.completion_chunks(call)
        pipeline = self.upstream.pipeline
        return merge.merged([pipeline.stream_completion(request) for request in call.requests], call.n)

    async def _echo(self, call: openai_in.CompletionCall) -> openai_out.Echo | None:
        """The prompts' texts for `echo`: a text prompt as sent, a token-id prompt decoded as vLLM
        decodes it (special tokens kept)."""
        if not call.echo:
            return None
        pipeline = self.upstream.pipeline
        texts = []
        for request in call.requests:
            if request.HasField("prompt"):
                texts.append(request.prompt)
                continue
            decoded = await pipeline.derender.Detokenize(
                derender_pb2.DetokenizeRequest(token_ids=request.prompt_token_ids, skip_special_tokens=False),
                timeout=pipeline.timeout, metadata=pipeline._metadata)
            texts.append(decoded.text)
        return openai_out.Echo(texts, call.n)

    async def _completion(self, request: Request, endpoint: str, parse: Callable, prefix: str,
                          chunks_of: Callable) -> Response:
        started = time.monotonic()
        headers: dict[str, str] = {}
        admitted = False
        try:
            self.authorize(request)
            rid = self.request_id(request)
            headers[REQUEST_ID_HEADER] = rid
            bind_request_id(rid)
            if self.active >= self.max_concurrent_requests:
                raise ResourceExhausted(f"the gateway is serving as many requests as it allows "
                                        f"({self.max_concurrent_requests}); retry shortly", reason=TOO_MANY_REQUESTS)
            self.active += 1
            self.metrics.in_flight.inc()
            admitted = True
            body = openai_in.parse_body(await self.read_body(request))
            call = parse(body, await self.served_model(), await self.adapter_names(body))
            call.set_request_id(rid)
            response_id = prefix + rid
            if call.stream.stream:
                response = await self._stream(request, endpoint, call, response_id, chunks_of, started, headers)
                admitted = False  # the stream releases its slot when it ends
                return response
            return await self._whole(request, endpoint, call, response_id, chunks_of, started, headers)
        except ClientDisconnect:  # gone while sending its body
            self.metrics.requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        except (TitoError, Exception) as exc:  # the one mapping (errors.from_exception)
            error = from_exception(exc)
            self.metrics.requests.labels(endpoint, str(error.status)).inc()
            return error_response(error, headers)
        finally:
            if admitted:
                self._release()

    def _release(self) -> None:
        self.active -= 1
        self.metrics.in_flight.dec()

    async def _whole(self, request: Request, endpoint: str, call, response_id: str, chunks_of, started: float,
                     headers: dict[str, str]) -> Response:
        completions = endpoint == "completions"
        assembled = openai_out.Assembled(call.n if completions else None)
        echo = await self._echo(call) if completions else None

        async def collect() -> None:
            async for chunk in chunks_of(call):
                assembled.add(chunk)

        work = asyncio.ensure_future(collect())
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait((work, gone), return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not work.done():  # the client went away: cancelling the work cancels the engine stream
            work.cancel()
            await asyncio.gather(work, return_exceptions=True)
            self.metrics.requests.labels(endpoint, "499").inc()
            return Response(status_code=499)
        work.result()  # raises the pipeline's error, if any
        if endpoint == "chat":
            body = openai_out.chat_completion(response_id, call.model, assembled, call.logprobs,
                                              echo=_chat_echo(call), role=call.role)
        else:
            body = openai_out.text_completion(response_id, call.model, assembled, call.logprobs is not None, echo)
        handoff = getattr(call, "handoff", None)
        if handoff is not None:  # a prefill/decode part: vLLM's answer carries the prefill's handoff
            body["kv_transfer_params"] = handoff.params
        self._count_finished(endpoint, "200", started, assembled.usage.usage)
        return Response(dumps(body), media_type="application/json", headers=headers)

    async def _stream(self, request: Request, endpoint: str, call, response_id: str, chunks_of, started: float,
                      headers: dict[str, str]) -> Response:
        usage = openai_out.StreamUsage(call.stream.include_usage, call.stream.continuous_usage)
        if endpoint == "chat":
            shape = openai_out.ChatStream(response_id, call.model, usage, call.logprobs, call.role)
        else:
            shape = openai_out.CompletionStream(response_id, call.model, usage, call.logprobs is not None, call.n,
                                                await self._echo(call))
        # A chat's stream starts when the engine's first token arrives, with each choice's role
        # chunk (as vLLM's server starts it on the engine's first output), before derender has
        # turned the token into text; a completion's with its first text. With continuous usage
        # stats the role chunks carry the prompt's token count, which derender's first chunk
        # brings: the chat's stream then starts there. Errors before the stream starts are HTTP
        # statuses, later ones are reported in the stream.
        roles_on_first_token = endpoint == "chat" and not call.stream.continuous_usage
        generating = asyncio.get_running_loop().create_future() if roles_on_first_token else None
        chunks = chunks_of(call, on_generating=None if generating is None else lambda: generating.set_result(None))
        first = asyncio.ensure_future(_next_or_none(chunks))
        try:
            await asyncio.wait((first,) if generating is None else (first, generating),
                               return_when=asyncio.FIRST_COMPLETED)
            if first.done():
                first.result()  # the pipeline's error, before anything was sent
        except BaseException:
            await _close(first, chunks)
            raise
        self.metrics.ttft.labels(endpoint).observe(time.monotonic() - started)
        opening = _role_chunks(endpoint, call, shape, generating, first)
        handoff = getattr(call, "handoff", None)
        return StreamingResponse(self._events(endpoint, shape, opening, first, chunks, started, handoff),
                                 media_type="text/event-stream", headers={**headers, "cache-control": "no-cache"})

    async def _events(self, endpoint: str, shape, opening: list[dict], first: asyncio.Future, chunks: AsyncIterator,
                      started: float, handoff=None) -> AsyncIterator[bytes]:
        """`handoff`: a prefill part's answer (chat_extras.Handoff), added to the chunk that
        ends the choice (vLLM's streamed chat drops it; a router needs it for the decode call)."""
        status = "200"
        try:
            for event in opening:
                yield b"data: " + dumps(event) + b"\n\n"
            chunk = await first
            if chunk is not None:
                event = shape.chunk(chunk)
                if event is not None:
                    yield b"data: " + dumps(_handed_off(event, handoff)) + b"\n\n"
                async for chunk in chunks:
                    event = shape.chunk(chunk)
                    if event is not None:
                        yield b"data: " + dumps(_handed_off(event, handoff)) + b"\n\n"
            final = shape.final()
            if final is not None:
                yield b"data: " + dumps(final) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            status = "499"  # the client went away; closing `chunks` cancels the engine stream
            raise
        except Exception as exc:  # noqa: BLE001 - reported in the stream, then the stream ends
            error = from_exception(exc)
            status = str(error.status)
            yield b"data: " + dumps(error.json()) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            await _close(first, chunks)
            self._release()
            self._count_finished(endpoint, status, started, shape.usage.usage if status == "200" else None)

    def _count_finished(self, endpoint: str, status: str, started: float, usage) -> None:
        self.metrics.requests.labels(endpoint, status).inc()
        self.metrics.duration.labels(endpoint).observe(time.monotonic() - started)
        if usage is not None:
            self.metrics.prompt_tokens.inc(usage.prompt_tokens)
            self.metrics.completion_tokens.inc(usage.completion_tokens)

    async def models(self, request: Request) -> Response:
        try:
            self.authorize(request)
            await self.check_ready()
            name = await self.served_model()
            info = await self.model_info()
            adapters = await self.lora_adapters()
        except (TitoError, Exception) as exc:
            return error_response(from_exception(exc))
        base = {"id": name, "object": "model", "created": self.created, "owned_by": "tito",
                "max_model_len": info.max_context_length}
        # An adapter's card names its base model as `parent`, as vLLM's list does.
        return JSONResponse({"object": "list", "data": [base] + [
            {**base, "id": adapter.name, "root": adapter.path or adapter.name, "parent": name}
            for adapter in adapters]})

    async def check_ready(self) -> None:
        """Raise UNAVAILABLE (503) unless every service is SERVING, as /health answers. The model
        list is what clients poll for readiness (vLLM's server listens only once its model is
        loaded), so it must not answer while a chat sent next would get MODEL_LOADING."""
        states = await self.upstream.health()
        waiting = {name: state for name, state in states.items() if state != "SERVING"}
        if waiting:
            said = ", ".join(f"{name} {state}" for name, state in waiting.items())
            loading = all(state == "NOT_SERVING" for state in waiting.values())
            raise Unavailable(f"not ready yet ({said}); retry shortly (GET /health says when)",
                              reason=MODEL_LOADING if loading else UPSTREAM_ERROR)

    async def health(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except TitoError as exc:
            return error_response(from_exception(exc))
        states = await self.upstream.health()
        serving = all(state == "SERVING" for state in states.values())
        return JSONResponse({"status": "ok" if serving else "unavailable", "services": states},
                            status_code=200 if serving else 503)

    async def prometheus(self, request: Request) -> Response:
        try:
            self.authorize(request)
        except TitoError as exc:
            return error_response(from_exception(exc))
        return Response(self.metrics.exposition(), media_type=CONTENT_TYPE)

    async def load_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/load_lora_adapter {"lora_name", "lora_path"}: loaded on every engine."""
        return await self._update_adapters(request, ("lora_name", "lora_path"), "added")

    async def unload_lora_adapter(self, request: Request) -> Response:
        """vLLM's POST /v1/unload_lora_adapter {"lora_name"}: unloaded from every engine."""
        return await self._update_adapters(request, ("lora_name",), "removed")

    async def _update_adapters(self, request: Request, fields: tuple[str, ...], done: str) -> Response:
        try:
            self.authorize(request)
            body = openai_in.parse_body(await self.read_body(request))
            values = []
            for field in fields:
                value = body.get(field)
                if not isinstance(value, str) or not value:
                    raise InvalidArgument(f"{field} is required: a non-empty string", reason="INVALID_REQUEST",
                                          field=field)
                values.append(value)
            if done == "added":
                await self.upstream.load_lora_adapter(*values)
            else:
                await self.upstream.unload_lora_adapter(*values)
        except (TitoError, Exception) as exc:
            return error_response(from_exception(exc))
        self._adapters_at = float("-inf")  # the next request naming it asks the engines again
        # vLLM's answer, word for word (plain text).
        return Response(f"Success: LoRA adapter '{values[0]}' {done} successfully.", media_type="text/plain")

    # -- the application --------------------------------------------------------------------------

    def asgi(self) -> Starlette:
        async def http_error(request: Request, exc: HTTPException) -> Response:
            if exc.status_code in (404, 405):
                error = from_exception(NotFound(f"no endpoint {request.method} {request.url.path[:128]} "
                                                f"(POST /v1/chat/completions, POST /v1/completions, "
                                                f"GET /v1/models, GET /health, GET /metrics)",
                                                reason=UNKNOWN_ENDPOINT))
                error = HttpError(exc.status_code, error.message, error.code)
            else:
                error = HttpError(exc.status_code, str(exc.detail), "INVALID_REQUEST")
            return error_response(error)

        async def client_gone(request: Request, exc: ClientDisconnect) -> Response:
            return Response(status_code=499)

        routes = [
            Route("/v1/chat/completions", self.chat_completions, methods=["POST"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/health", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            *self.vllm.routes(),  # vLLM's token-in/token-out API (vllm_api/)
        ]
        if self.lora_updating:
            routes += [Route("/v1/load_lora_adapter", self.load_lora_adapter, methods=["POST"]),
                       Route("/v1/unload_lora_adapter", self.unload_lora_adapter, methods=["POST"])]
        return Starlette(routes=routes, exception_handlers={HTTPException: http_error, ClientDisconnect: client_gone})


def _role_chunks(endpoint: str, call, shape, generating: asyncio.Future | None, first: asyncio.Future) -> list[dict]:
    """The role chunks a chat's stream opens with: when the engine's first token arrived, or with
    continuous usage stats when derender's first chunk did (its usage counts the prompt). None for
    a completion, or when the stream ended or its first chunk came first: derender's chunks then
    carry the role."""
    if endpoint != "chat":
        return []
    n, echo = max(1, call.request.sampling.n), _chat_echo(call)
    if generating is not None and generating.done():
        return shape.roles(n, echo=echo)
    head = first.result() if generating is None and first.done() else None
    if head is None and echo:
        return shape.roles(n, echo=echo)  # the echo comes first, so the role chunks do too
    return shape.roles(n, head.usage.prompt_tokens, echo) if head is not None else []


def _chat_echo(call) -> str | None:
    """The text vLLM's `echo` puts before a chat's answer (chat_extras), None for most chats."""
    return getattr(call, "echo", None)


def _handed_off(event: dict, handoff) -> dict:
    """`event` with the prefill's `kv_transfer_params` when it ends a choice of a prefill part."""
    if handoff is not None and handoff.params is not None and any(
            choice.get("finish_reason") is not None for choice in event.get("choices", ())):
        event["kv_transfer_params"] = handoff.params
    return event


async def _next_or_none(chunks: AsyncIterator):
    """The stream's first chunk, None when it ends without one."""
    try:
        return await anext(chunks)
    except StopAsyncIteration:
        return None


async def _close(first: asyncio.Future, chunks: AsyncIterator) -> None:
    """Stop a stream (its engine request with it): the read of its first chunk, then the rest."""
    if not first.done():
        first.cancel()
    try:
        await first
    except BaseException:  # noqa: BLE001 - cancelled or failed: reported already, or nobody is left to tell
        pass
    try:
        await chunks.aclose()
    except BaseException:  # noqa: BLE001 - already cancelled or failed; nothing left to free
        pass


async def _disconnected(request: Request) -> None:
    """Returns when the client has gone away (the body has been read by then)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return
