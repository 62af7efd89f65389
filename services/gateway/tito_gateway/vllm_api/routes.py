"""The HTTP handlers of vLLM's token-in/token-out API on the gateway (Starlette routes).

Thin, as the gateway's own: each handler checks the caller (bearer token, body size,
concurrency) as `Gateway` does, parses the body (generate_in, derender_in, openai_in), runs it
through tito's client (render, the engine the router picks, derender) and writes vLLM's shapes
(render_out, generate_out, openai_out). Every error goes through the gateway's one mapping
(errors.from_exception) and is written in vLLM's error JSON (shapes). A streamed generate reports
an error found before its first token as an HTTP status, and one found later as an SSE
`data: {"error": ...}` event before `[DONE]`, as vLLM's does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Container
from dataclasses import dataclass
from typing import Any

import grpc
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response, StreamingResponse
from starlette.routing import Route

from tito import kv_params
from tito.errors import InvalidArgument, ResourceExhausted, TitoError
from tito.logs import bind_request_id
from tito.v1 import derender_pb2, multimodal_pb2
from tito_gateway import openai_in, openai_out
from tito_gateway.errors import HttpError, from_exception
from tito_gateway.vllm_api import (chat_extras, derender_in, derender_stream, generate_in, generate_out, media,
                                   messages_in, mm_serde, render_out, responses_in, reuse, shapes)

#: The prefix vLLM gives a generate's request id in its answer (`generate-tokens-<id>`).
GENERATE_PREFIX = "generate-tokens-"
#: Parameters of vLLM's render endpoints that the OpenAI endpoints do not take.
RENDER_ONLY = ("mm_payload", "request_id", "priority")
MM_PAYLOADS = ("tensors", "none")
#: Engine / render field names (what errors.openai_param leaves of them) -> vLLM's body names.
SAMPLING_PARAMS = {"temperature", "top_p", "top_k", "min_p", "seed", "n", "max_tokens", "min_tokens",
                   "presence_penalty", "frequency_penalty", "repetition_penalty", "stop_token_ids", "ignore_eos",
                   "logprobs"}

Handler = Callable[[Request, dict, str], Awaitable[Response]]


def dumps(value) -> bytes:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def vllm_param(param: str | None) -> str | None:
    """A field the engine named, as vLLM's generate body names it."""
    if param is None:
        return None
    if param == "top_logprobs":
        return "sampling_params.logprobs"
    if param in SAMPLING_PARAMS or param.split("[")[0] in ("logit_bias", "stop_token_ids"):
        return f"sampling_params.{param}"
    if param.startswith("structured_output"):
        return "sampling_params.structured_outputs" + param[len("structured_output"):]
    if param.startswith("mm_features"):
        return "features"
    if param.startswith(kv_params.FIELD):  # errors.openai_param named it in vLLM's terms already
        return param
    return media.render_param(param)


def error_response(error: HttpError, headers: dict | None = None, param: str | None = None) -> Response:
    return Response(dumps(shapes.error_json(error, param)), status_code=error.status,
                    media_type="application/json", headers=headers)


class VllmApi:
    """vLLM's endpoints over a `Gateway`'s upstream, limits and metrics."""

    def __init__(self, gateway) -> None:
        self.gateway = gateway
        self.rendered_chats = reuse.RenderedChats()  # the render endpoint's answers, for the reuse path
        self.kept_metadata = media.KeptMetadata()  # items' metadata by hash, for hashes-only features

    @property
    def pipeline(self):
        return self.gateway.upstream.pipeline

    def routes(self) -> list[Route]:
        endpoints = (("/v1/chat/completions/render", "render_chat", self.render_chat),
                     ("/v1/completions/render", "render_completion", self.render_completion),
                     ("/v1/messages/render", "render_messages", self.render_messages),
                     ("/v1/responses/render", "render_responses", self.render_responses),
                     ("/inference/v1/generate", "generate", self.generate),
                     ("/v1/chat/completions/derender", "derender_chat", self.derender_chat),
                     ("/v1/completions/derender", "derender_completion", self.derender_completion),
                     ("/inference/v1/abort_requests", "abort_requests", self.abort))
        return [Route(path, self._endpoint(name, handler), methods=["POST"]) for path, name, handler in endpoints]

    def _endpoint(self, name: str, handler: Handler):
        async def endpoint(request: Request) -> Response:
            return await self._serve(request, name, handler)
        return endpoint

    async def _serve(self, request: Request, name: str, handler: Handler) -> Response:
        """The caller's checks, the body, then `handler`; one error mapping in vLLM's shape."""
        gateway = self.gateway
        started = time.monotonic()
        headers: dict[str, str] = {}
        admitted = False
        try:
            gateway.authorize(request)
            rid = gateway.request_id(request)
            headers["x-request-id"] = rid
            bind_request_id(rid)
            if gateway.active >= gateway.max_concurrent_requests:
                raise ResourceExhausted(f"the gateway is serving as many requests as it allows "
                                        f"({gateway.max_concurrent_requests}); retry shortly",
                                        reason="TOO_MANY_REQUESTS")
            gateway.active += 1
            gateway.metrics.in_flight.inc()
            admitted = True
            values = openai_in.parse_body(await gateway.read_body(request))
            response = await handler(request, values, rid)
            response.headers.update(headers)
            if isinstance(response, StreamingResponse):
                admitted = False  # the stream releases its slot when it ends
            else:
                self._count(name, str(response.status_code), started)
            return response
        except ClientDisconnect:
            self._count(name, "499", started)
            return Response(status_code=499)
        except (TitoError, Exception) as exc:  # the one mapping (errors.from_exception)
            error = from_exception(exc)
            self._count(name, str(error.status), started)
            # The gateway's own refusals name vLLM's field already; a service's is translated.
            if isinstance(exc, TitoError):
                param = media.render_param(exc.field) if name == "generate" else exc.field
            else:
                param = vllm_param(error.param) if name == "generate" else None
            return error_response(error, headers, param)
        finally:
            if admitted:
                self._release()

    def _release(self) -> None:
        self.gateway.active -= 1
        self.gateway.metrics.in_flight.dec()

    def _count(self, name: str, status: str, started: float) -> None:
        self.gateway.metrics.requests.labels(name, status).inc()
        self.gateway.metrics.duration.labels(name).observe(time.monotonic() - started)

    # -- render ------------------------------------------------------------------------------------

    @staticmethod
    def _render_options(values: dict) -> tuple[dict, str | None, bool]:
        """vLLM's render-only parameters taken out of `values` (the rest is an OpenAI body): the
        request id, and whether media items carry their tensors (`mm_payload`, vLLM's default
        "tensors")."""
        rest = {key: value for key, value in values.items() if key not in RENDER_ONLY}
        payload = openai_in._string(values.get("mm_payload"), "mm_payload")
        if payload is not None and payload not in MM_PAYLOADS:
            raise openai_in.invalid("mm_payload", f"must be one of {', '.join(MM_PAYLOADS)}")
        if openai_in._integer(values.get("priority"), "priority", -(2**63), 2**63 - 1):
            raise openai_in.unsupported("priority", "tito's engines schedule first come, first served")
        return rest, openai_in._string(values.get("request_id"), "request_id"), payload != "none"

    async def render_chat(self, request: Request, values: dict, rid: str) -> Response:
        rest, given_id, tensors = self._render_options(values)
        return await self._render_chat(rest, f"chatcmpl-{given_id or rid}", values.get("stream_options"), tensors)

    async def render_messages(self, request: Request, values: dict, rid: str) -> Response:
        """Anthropic's Messages body, rendered as the chat vLLM converts it to (messages_in)."""
        rest, given_id, tensors = self._render_options(values)
        return await self._render_chat(messages_in.to_chat(rest), f"chatcmpl-{given_id or rid}", None, tensors)

    async def render_responses(self, request: Request, values: dict, rid: str) -> Response:
        """OpenAI's Responses body, rendered as the chat vLLM builds for it (responses_in); the
        request id is `resp_<id>`, as vLLM names a response."""
        rest, given_id, tensors = self._render_options(values)
        return await self._render_chat(responses_in.to_chat(rest), f"resp_{given_id or rid}", None, tensors)

    async def _render_chat(self, chat: dict, request_id: str, stream_options: dict | None,
                           wants_tensors: bool) -> Response:
        """An OpenAI chat body through render, answered as vLLM's GenerateRequest. Render is
        asked for tensors only when they go into the answer (vLLM's serialized form, which
        needs the vllm package); else for metadata. Either way each item's metadata is kept by
        hash, for hashes-only generates."""
        call = openai_in.parse_chat(chat, await self.gateway.served_model(),
                                    await self.gateway.adapter_names(chat))
        call.request.mm_payload = (multimodal_pb2.MM_PAYLOAD_TENSORS if wants_tensors
                                   else multimodal_pb2.MM_PAYLOAD_METADATA)
        call.request.request_id = request_id
        pipeline = self.pipeline
        rendered = await pipeline.render.RenderChat(call.request, timeout=pipeline.timeout,
                                                    metadata=pipeline._metadata)
        items = rendered.generate_request.mm_features.items
        # Only a media chat needs vLLM's serializer (importing vLLM takes seconds: text never pays it).
        tensors = bool(items) and wants_tensors and mm_serde.available()
        if items and wants_tensors and not tensors:
            raise openai_in.unsupported("mm_payload", "media tensors in vLLM's serialized form need the vllm "
                                                      "package on the gateway; send mm_payload \"none\" (hashes "
                                                      "and placeholders), or generate with content_parts")
        self.kept_metadata.keep(items)
        self.rendered_chats.put(reuse.chat_key(chat), rendered)
        body = render_out.generate_request_json(rendered.generate_request, rendered.derender_context, call.model,
                                                call.stream.stream, stream_options, tensors)
        return Response(dumps(body), media_type="application/json")

    async def render_completion(self, request: Request, values: dict, rid: str) -> Response:
        rest, given_id, _ = self._render_options(values)  # a prompt has no media
        call = openai_in.parse_completion(rest, await self.gateway.served_model(),
                                          await self.gateway.adapter_names(rest))
        if call.echo:
            raise openai_in.unsupported("echo", "the render endpoint returns what the engine runs; echo is the "
                                                "answer's (vLLM's render drops it too)")
        call.set_request_id(f"cmpl-{given_id or rid}")
        pipeline = self.pipeline
        rendered = await asyncio.gather(*(pipeline.render.RenderCompletion(one, timeout=pipeline.timeout,
                                                                           metadata=pipeline._metadata)
                                          for one in call.requests))
        body = [render_out.generate_request_json(one.generate_request, one.derender_context, call.model,
                                                 call.stream.stream, values.get("stream_options"))
                for one in rendered]
        return Response(dumps(body), media_type="application/json")

    # -- the chat's reuse path -------------------------------------------------------------------

    def parse_chat(self, values: dict, served_model: str, adapters: Container[str] = ()) -> openai_in.ChatCall:
        """openai_in.parse_chat (`adapters`: the LoRA adapters `model` may name), plus vLLM's
        `kv_transfer_params` (reuse.py's forwarded ids, tito.kv_params' prefill/decode part) and
        `echo` (chat_extras)."""
        echo = chat_extras.echo_flag(values)
        rest, forwarded, transfer_params = reuse.split_forwarded(values)
        rest.pop("echo", None)
        transfer = kv_params.kv_transfer_from_params(transfer_params) if transfer_params else None
        call = openai_in.parse_chat(rest, served_model, adapters)
        if forwarded is None and transfer is None and not echo:
            return call
        return chat_extras.VllmChatCall(
            call.model, call.request, call.stream, call.logprobs, call.role,
            prompt_ids=tuple(forwarded.ids) if forwarded else (), key=reuse.chat_key(rest),
            features=forwarded.features if forwarded else None, kv_transfer=transfer,
            handoff=chat_extras.Handoff() if transfer is not None else None,
            echo=chat_extras.echo_text(rest["messages"], call.role) if echo else None)

    def parse_completion(self, values: dict, served_model: str, adapters: Container[str] = ()
                         ) -> openai_in.CompletionCall:
        """openai_in.parse_completion, plus prefill/decode's `kv_transfer_params` (one prompt)."""
        rest, transfer = chat_extras.split_transfer(values)
        call = openai_in.parse_completion(rest, served_model, adapters)
        if transfer is None:
            return call
        if len(call.requests) != 1:
            raise openai_in.invalid(kv_params.FIELD, "a prefill/decode part holds one prompt: send each prompt in "
                                                     "its own request")
        return chat_extras.VllmCompletionCall(call.model, call.requests, call.stream, call.logprobs, call.echo,
                                              kv_transfer=transfer)

    def completion_chunks(self, call: chat_extras.VllmCompletionCall) -> AsyncIterator:
        """The one prompt's chunks as the engine's part in a split, its answer to `call.handoff`
        (in the span a plain completion has)."""
        pipeline = self.pipeline

        async def prepare(metadata):
            return self._with_transfer(await pipeline.render.RenderCompletion(
                call.requests[0], timeout=pipeline.timeout, metadata=metadata), call.kv_transfer)

        return pipeline.stream_prepared("completion", call.requests[0].request_id, prepare,
                                        on_response=self._on_response(call.handoff))

    def chat_chunks(self, call: chat_extras.VllmChatCall, on_generating=None) -> AsyncIterator:
        """The chat's chunks: on its forwarded ids (the render answer the render endpoint kept for
        them, else render's answer now, for derender's context) or as rendered now; with its part
        in a prefill/decode split, whose answer goes to `call.handoff`. Traced as a plain chat."""
        async def prepare(metadata):
            rendered = await (self._reused(call, metadata) if call.reused else self._rendered(call, metadata))
            return self._with_transfer(rendered, call.kv_transfer)

        return self.pipeline.stream_prepared("chat", call.request.request_id, prepare, on_generating,
                                             self._on_response(call.handoff))

    @staticmethod
    def _with_transfer(rendered, transfer):
        """`rendered` with the engine's part in a prefill/decode split (`transfer`, when one)."""
        if transfer is not None:
            rendered.generate_request.kv_transfer.CopyFrom(transfer)
        return rendered

    def _on_response(self, handoff: chat_extras.Handoff | None):
        """What reads a prefill's answer into `handoff` from the engine's responses (None: no split)."""
        if handoff is None:
            return None
        return lambda response, address: self._hand_off(handoff, response, address)

    async def _rendered(self, call: chat_extras.VllmChatCall, metadata):
        return await self.pipeline.render.RenderChat(call.request, timeout=self.pipeline.timeout, metadata=metadata)

    async def _reused(self, call: chat_extras.VllmChatCall, metadata):
        info = await self.gateway.model_info()
        for index, token in enumerate(call.prompt_ids):
            if info.vocab_size and token >= info.vocab_size:  # vLLM checks before its stream starts too
                raise openai_in.invalid(reuse.FIELD, f"[{index}] is {token}, outside the vocabulary "
                                                     f"[0, {info.vocab_size})")
        rendered = self.rendered_chats.get(call.key, call.prompt_ids)
        if rendered is None:
            call.request.mm_payload = multimodal_pb2.MM_PAYLOAD_NONE  # the media come forwarded
            rendered = await self._rendered(call, metadata)
        reuse.with_forwarded_ids(rendered, call.prompt_ids, call.request.request_id)
        rendered.generate_request.ClearField("mm_features")
        if call.features is not None:
            self.kept_metadata.fill(call.features.items)
            rendered.generate_request.mm_features.CopyFrom(call.features)
        # This chat's stream options, not those of the render call that made the kept answer.
        rendered.derender_context.usage_in_every_chunk = call.request.usage_in_every_chunk
        return rendered

    @staticmethod
    def _hand_off(handoff: chat_extras.Handoff, response, address: str | None) -> None:
        params = _handoff_params(response, lambda: address)
        if params is not None:
            handoff.params = params

    # -- generate ----------------------------------------------------------------------------------

    async def generate(self, request: Request, values: dict, rid: str) -> Response:
        call = generate_in.parse_generate(values, await self.gateway.served_model())
        if not call.request.request_id:
            call.request.request_id = rid
        if call.content_parts is not None:
            await self._render_content_parts(call)
        else:
            self.kept_metadata.fill(call.request.mm_features.items)
        response_id = GENERATE_PREFIX + call.request.request_id
        model = call.model or await self.gateway.served_model()
        responses = self.pipeline.generate(call.request)
        if call.stream:
            return await self._generate_stream(call, response_id, responses)
        whole = generate_out.Whole(call)

        async def collect() -> None:
            async for response in responses:
                whole.add(response)
                whole.kv_transfer_params = self._handoff(call, response) or whole.kv_transfer_params

        await _unless_gone(request, collect())
        return Response(dumps(whole.json(response_id, model)), media_type="application/json")

    def _handoff(self, call: generate_in.GenerateCall, response) -> dict | None:
        """A prefill answer's `kv_transfer_params` (_handoff_params), from the engine running it."""
        return _handoff_params(response, lambda: self.pipeline.engine_address(call.request.request_id))

    async def _render_content_parts(self, call: generate_in.GenerateCall) -> None:
        """vLLM's `content_parts`: render renders the media (a one-message chat of those parts,
        with tensors) and its items are placed in the caller's token ids (media.place_items)."""
        served = await self.gateway.served_model()
        chat = openai_in.parse_chat({"model": served, "messages": [{"role": "user", "content": call.content_parts}]},
                                    served)
        chat.request.mm_payload = multimodal_pb2.MM_PAYLOAD_TENSORS
        chat.request.request_id = call.request.request_id
        pipeline = self.pipeline
        rendered = await pipeline.render.RenderChat(chat.request, timeout=pipeline.timeout,
                                                    metadata=pipeline._metadata)
        items = rendered.generate_request.mm_features.items
        ids, placed = media.place_items(call.request.token_ids, rendered.generate_request.token_ids, items)
        self.kept_metadata.keep(items)
        del call.request.token_ids[:]
        call.request.token_ids.extend(ids)
        call.request.mm_features.CopyFrom(multimodal_pb2.MultiModalFeatures(items=placed))

    async def _generate_stream(self, call, response_id: str, responses: AsyncIterator) -> Response:
        started = time.monotonic()
        try:
            first = await _next_or_none(responses)  # an error before the first token is an HTTP status
        except BaseException:
            await responses.aclose()
            raise
        self.gateway.metrics.ttft.labels("generate").observe(time.monotonic() - started)
        shape = generate_out.Stream(call, response_id)
        return StreamingResponse(self._events(shape, first, responses), media_type="text/event-stream",
                                 headers={"cache-control": "no-cache"})

    async def _events(self, shape: generate_out.Stream, first, responses: AsyncIterator) -> AsyncIterator[bytes]:
        started = time.monotonic()
        status = "200"
        try:
            response = first
            while response is not None:
                chunk = shape.chunk(response, self._handoff(shape.call, response))
                if chunk is not None:
                    yield b"data: " + dumps(chunk) + b"\n\n"
                response = await _next_or_none(responses)
            final = shape.final()
            if final is not None:
                yield b"data: " + dumps(final) + b"\n\n"
            yield b"data: [DONE]\n\n"
        except (asyncio.CancelledError, GeneratorExit):
            status = "499"  # the client went away; closing `responses` cancels the engine stream
            raise
        except Exception as exc:  # noqa: BLE001 - reported in the stream, then the stream ends
            error = from_exception(exc)
            status = str(error.status)
            yield b"data: " + dumps(shapes.error_json(error, vllm_param(error.param))) + b"\n\n"
            yield b"data: [DONE]\n\n"
        finally:
            with contextlib.suppress(BaseException):
                await responses.aclose()
            self._release()
            self._count("generate", status, started)

    async def abort(self, request: Request, values: dict, rid: str) -> Response:
        ids = values.get("request_ids")
        if ids is None:
            raise InvalidArgument("Missing 'request_ids' in request body", reason="INVALID_REQUEST",
                                  field="request_ids")
        if not isinstance(ids, list) or any(not isinstance(one, str) for one in ids):
            raise InvalidArgument("request_ids must be an array of strings", reason="INVALID_REQUEST",
                                  field="request_ids")
        # Either spelling: the id the caller sent, or the one the generate answer carries.
        await self.pipeline.abort([one.removeprefix(GENERATE_PREFIX) for one in ids])
        return Response(status_code=200)

    # -- derender ----------------------------------------------------------------------------------

    async def derender_chat(self, request: Request, values: dict, rid: str) -> Response:
        if derender_stream.is_streamed(values):
            return await self.derender_chat_chunk(values, rid)
        body = openai_in.Body(values, derender_in.CHAT_FIELDS)
        served = await self.gateway.served_model()
        model = body.string("model") or served
        generated = values.get("generate_response")
        prompt_tokens = body.integer("prompt_tokens", 0, openai_in.UINT32_MAX)
        responses = derender_in.engine_responses(generated, "generate_response", prompt_tokens)
        given = derender_in.given_prompt_ids(values, generated, "generate_response")
        logprobs = any(response.logprobs for response in responses)
        context, logprobs = await self._chat_context(body, generated.get("request_id", ""), given, prompt_tokens,
                                                     len(responses), logprobs)
        assembled = openai_out.Assembled()
        await self._derender(context, responses, assembled, 0, 1)
        response_id = generated.get("request_id") or f"chatcmpl-{rid}"
        return Response(dumps(openai_out.chat_completion(response_id, model, assembled, logprobs)),
                        media_type="application/json")

    async def _chat_context(self, body: openai_in.Body, request_id: str, prompt_ids: list[int] | None,
                            prompt_tokens: int | None, n: int, logprobs: bool
                            ) -> tuple[derender_pb2.DerenderContext, bool]:
        """Derender's context for a chat: render's for `chat_request` (its parsers, tools and
        thinking switch), else a plain one where no parser is configured; and whether the
        answer carries logprobs. Render's answer is the one the render endpoint kept for this
        chat and `prompt_ids` (the caller's prompt) where it has one (`RenderedChats`: a router
        that rendered here pays render once per chat, not again for every derender), else
        render's answer now."""
        chat_values = body.obj("chat_request")
        if chat_values is not None:
            call = openai_in.parse_chat(chat_values, await self.gateway.served_model(),
                                        await self.gateway.adapter_names(chat_values))
            context = self._kept_context(chat_values, prompt_ids, call)
            if context is None:
                call.request.mm_payload = multimodal_pb2.MM_PAYLOAD_NONE  # derender needs no tensors
                pipeline = self.pipeline
                rendered = await pipeline.render.RenderChat(call.request, timeout=pipeline.timeout,
                                                            metadata=pipeline._metadata)
                context = rendered.derender_context
            context.n = max(context.n, n)
            context.prompt_tokens = prompt_tokens or 0
            return context, call.logprobs
        info = await self.gateway.model_info()
        if info.reasoning_parser or info.tool_parser:
            raise openai_in.invalid("chat_request", "chat_request is required when a tool or reasoning parser "
                                                    "is configured because plain detokenization would leak raw "
                                                    "parser markup into content.")
        seed = derender_in.seed_tail(prompt_ids)
        return derender_in.plain_context(request_id, seed, prompt_tokens or 0, n, logprobs), logprobs

    def _kept_context(self, chat_values: dict, prompt_ids: list[int] | None, call: openai_in.ChatCall
                      ) -> derender_pb2.DerenderContext | None:
        """Derender's context from the render answer kept for this chat body and these prompt ids
        (None: none is kept), with this call's stream options (not part of the key)."""
        if not prompt_ids:
            return None
        kept = self.rendered_chats.get(reuse.chat_key(chat_values), prompt_ids)
        if kept is None:
            return None
        context = kept.derender_context  # of a copy (RenderedChats.get): the kept answer stays as it was
        context.usage_in_every_chunk = call.request.usage_in_every_chunk
        return context

    async def derender_chat_chunk(self, values: dict, rid: str) -> Response:
        """One chunk of a streamed chat derender: the chat's context on the first chunk (no
        `stream_state`), derender's sealed state after; the chunk and the new state."""
        chunk = await self._chunk_call(values, derender_stream.CHAT_FIELDS)
        context, logprobs = chunk.resumed, chunk.logprobs
        if context is None:
            given = derender_in.given_prompt_ids(values, values.get("generate_chunk"), "generate_chunk")
            context, logprobs = await self._chat_context(chunk.body, chunk.request_id, given, chunk.prompt_tokens, 1,
                                                         logprobs)
        chunks, state = await self._derender_step(context, chunk.responses)
        choices = [derender_stream.chat_choice(response.index, chunks.get(response.index), logprobs)
                   for response in chunk.responses]
        return chunk.reply(f"chatcmpl-{rid}", "chat.completion.chunk", choices, state)

    async def derender_completion_chunk(self, values: dict, rid: str) -> Response:
        """One chunk of a streamed completion derender (as derender_chat_chunk, no parsers)."""
        chunk = await self._chunk_call(values, derender_stream.COMPLETION_FIELDS)
        context, logprobs = chunk.resumed, chunk.logprobs
        if context is None:
            completion = chunk.body.obj("completion_request")
            text = None
            if completion is not None:
                call = openai_in.parse_completion(completion, await self.gateway.served_model(),
                                                  await self.gateway.adapter_names(completion))
                text = derender_in.text_options(call.requests[0].sampling)
            seed = derender_in.seed_ids(values, values.get("generate_chunk"), "generate_chunk")
            context = derender_in.plain_context(chunk.request_id, seed, chunk.prompt_tokens or 0, 1, logprobs, text)
        chunks, state = await self._derender_step(context, chunk.responses)
        choices = [derender_stream.completion_choice(response.index, chunks.get(response.index), logprobs)
                   for response in chunk.responses]
        return chunk.reply(f"cmpl-{rid}", "text_completion", choices, state)

    async def _chunk_call(self, values: dict, fields) -> "_ChunkCall":
        """What both streamed derenders read first: the body, the chunk's responses and usage, and
        the context to resume when the caller sent derender's state (None: the first chunk)."""
        body = openai_in.Body(values, fields)
        model = body.string("model") or await self.gateway.served_model()
        prompt_tokens = body.integer("prompt_tokens", 0, openai_in.UINT32_MAX)
        request_id, responses, usage = derender_stream.chunk_responses(values.get("generate_chunk"))
        state = derender_stream.state_bytes(values.get(derender_stream.FIELD))
        return _ChunkCall(body, model, prompt_tokens, request_id, responses, usage,
                          derender_pb2.DerenderContext(resume_state=state) if state else None,
                          any(response.logprobs for response in responses))

    async def _derender_step(self, context: derender_pb2.DerenderContext, responses: list
                             ) -> tuple[dict[int, derender_pb2.ChatChunk], bytes]:
        """One resumable Derender stream: the context (new or a state), the chunk's responses,
        then derender's sealed state. Its chunks by choice index (one at most per response)."""
        context.return_state = True
        chunks: dict[int, derender_pb2.ChatChunk] = {}
        state = b""

        async def requests():
            yield derender_pb2.DerenderRequest(context=context)
            for response in responses:
                yield derender_pb2.DerenderRequest(generate_response=response)

        pipeline = self.pipeline
        try:
            async for reply in pipeline.derender.Derender(requests(), timeout=pipeline.timeout,
                                                          metadata=pipeline._metadata):
                if reply.stream_state:
                    state = reply.stream_state
                else:
                    chunks[reply.chunk.index] = reply.chunk
        except grpc.RpcError as exc:  # derender names its context's field; the caller sent `stream_state`
            if context.resume_state and _status_lost(exc):
                await self._check_state(context)  # raises derender's own refusal of the state
            error = from_exception(exc)
            if error.param and "resume_state" in error.param:
                raise InvalidArgument(error.message, reason=error.code or "STREAM_STATE_INVALID",
                                      field=derender_stream.FIELD) from None
            raise
        return chunks, state

    async def _check_state(self, context: derender_pb2.DerenderContext) -> None:
        """Send derender the resumed context alone; its refusal of the state, as InvalidArgument
        naming `stream_state` (nothing when it takes the state)."""
        pipeline = self.pipeline

        async def only_context():
            yield derender_pb2.DerenderRequest(context=context)

        try:
            async for _ in pipeline.derender.Derender(only_context(), timeout=pipeline.timeout,
                                                      metadata=pipeline._metadata):
                pass
        except grpc.RpcError as exc:
            error = from_exception(exc)
            if error.param and "resume_state" in error.param:
                raise InvalidArgument(error.message, reason=error.code or "STREAM_STATE_INVALID",
                                      field=derender_stream.FIELD) from None

    async def derender_completion(self, request: Request, values: dict, rid: str) -> Response:
        if derender_stream.is_streamed(values):
            return await self.derender_completion_chunk(values, rid)
        body = openai_in.Body(values, derender_in.COMPLETION_FIELDS)
        served = await self.gateway.served_model()
        model = body.string("model") or served
        generated = values.get("generate_responses")
        if not isinstance(generated, list) or not generated:
            raise openai_in.invalid("generate_responses", "is required: a non-empty array of generate responses")
        counts = values.get("prompt_tokens") or [None] * len(generated)
        seeds = values.get("prompt_token_ids") or [None] * len(generated)
        if len(counts) != len(generated) or len(seeds) != len(generated):
            raise openai_in.invalid("prompt_tokens", "prompt_tokens and prompt_token_ids must hold one entry per "
                                                     "generate response")
        completion = body.obj("completion_request")
        text = None
        if completion is not None:
            call = openai_in.parse_completion(completion, served, await self.gateway.adapter_names(completion))
            text = derender_in.text_options(call.requests[0].sampling)
        per_prompt = [derender_in.engine_responses(one, f"generate_responses[{p}]",
                                                   openai_in._integer(counts[p], f"prompt_tokens[{p}]", 0,
                                                                      openai_in.UINT32_MAX))
                      for p, one in enumerate(generated)]
        n = max(len(responses) for responses in per_prompt) or 1
        logprobs = any(r.logprobs for responses in per_prompt for r in responses)
        assembled = openai_out.Assembled(n)
        for p, responses in enumerate(per_prompt):
            seed = derender_in.seed_ids({"prompt_token_ids": seeds[p]}, generated[p], f"prompt_token_ids[{p}]")
            context = derender_in.plain_context(str(generated[p].get("request_id", "")), seed,
                                                responses[0].usage.prompt_tokens if responses else 0,
                                                len(responses), logprobs, text)
            await self._derender(context, responses, assembled, p, n)
        response_id = generated[0].get("request_id") or f"cmpl-{rid}"
        return Response(dumps(openai_out.text_completion(response_id, model, assembled, logprobs)),
                        media_type="application/json")

    async def _derender(self, context: derender_pb2.DerenderContext, responses: list, assembled, prompt: int,
                        n: int) -> None:
        """One Derender stream: the context, then every response; its chunks into `assembled`
        (renumbered for prompt `prompt` of a completion, as merge numbers them)."""
        async def requests():
            yield derender_pb2.DerenderRequest(context=context)
            for response in responses:
                yield derender_pb2.DerenderRequest(generate_response=response)

        pipeline = self.pipeline
        async for reply in pipeline.derender.Derender(requests(), timeout=pipeline.timeout,
                                                      metadata=pipeline._metadata):
            chunk = reply.chunk
            chunk.index += prompt * n
            assembled.add(chunk)


def _handoff_params(response, address: Callable[[], str | None]) -> dict | None:
    """A prefill answer's `kv_transfer_params`: a vllm-backend engine's connector answer as it is,
    or (tito.kv_params) tito's handle and `address()`, where the engine that holds the KV serves
    (the decode engine pulls from it); None for a response that carries neither."""
    if response.kv_connector_params_json:
        return json.loads(response.kv_connector_params_json)
    if not response.HasField("kv_transfer_handle"):
        return None
    return kv_params.params_from_handle(response.kv_transfer_handle, address() or "")


async def _next_or_none(responses: AsyncIterator):
    try:
        return await anext(responses)
    except StopAsyncIteration:
        return None


async def _unless_gone(request: Request, work: Awaitable) -> None:
    """Run `work`; a client that goes away first cancels it (and the engine stream with it)."""
    task = asyncio.ensure_future(work)
    gone = asyncio.ensure_future(_disconnected(request))
    try:
        await asyncio.wait((task, gone), return_when=asyncio.FIRST_COMPLETED)
    finally:
        gone.cancel()
    if not task.done():
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
        raise ClientDisconnect()
    task.result()


async def _disconnected(request: Request) -> None:
    while True:
        if (await request.receive())["type"] == "http.disconnect":
            return


def _status_lost(error: grpc.RpcError) -> bool:
    """grpc's asyncio client overwrites the status of a stream the server ended while requests were
    still being written with INTERNAL "Internal error from Core" (grpc/grpc#36066): derender's
    refusal of a state can arrive so, depending on timing."""
    return error.code() == grpc.StatusCode.INTERNAL and "Internal error from Core" in (error.details() or "")


@dataclass(frozen=True)
class _ChunkCall:
    """One streamed derender call's inputs (VllmApi._chunk_call) and its answer's shape."""

    body: Any
    model: str
    prompt_tokens: int | None
    request_id: str
    responses: list
    usage: Any
    resumed: derender_pb2.DerenderContext | None  # derender's state sent back: the stream goes on
    logprobs: bool

    def reply(self, default_id: str, kind: str, choices: list, state: bytes) -> Response:
        chunk = {"id": self.request_id or default_id, "object": kind, "created": int(time.time()),
                 "model": self.model, "choices": choices,
                 "usage": derender_stream.usage_json(self.usage, self.prompt_tokens)}
        return Response(dumps({"chunk": chunk, "stream_state": derender_stream.state_text(state)}),
                        media_type="application/json")
