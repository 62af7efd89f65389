"""A fake of the three services behind the gateway, faithful where the gateway's tests need it:
each request crosses the protobuf wire as it would on its way to render."""

from __future__ import annotations

import hashlib

import grpc
import numpy as np
from grpc_status import rpc_status

from tito import tensors
from tito.errors import InvalidArgument
from tito.grpc_errors import status_for
from tito.v1 import derender_pb2, engine_pb2, multimodal_pb2, render_pb2, sampling_pb2

SERVED = "served-model"
SERVING = {"render": "SERVING", "engine": "SERVING", "derender": "SERVING"}


class FakeRender:
    """Render's GetModelInfo, as the gateway calls it."""

    def __init__(self, model_id: str) -> None:
        self.model_id = model_id

    async def GetModelInfo(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        return render_pb2.RenderServiceGetModelInfoResponse(model_id=self.model_id, max_context_length=4096)


class FakePipeline:
    """What the gateway uses of AsyncChatPipeline. Each request is serialized and parsed back, as
    gRPC carries it to render (so what protobuf cannot encode or decode fails here as it would
    there), kept in `requests`, and answered with one finished chunk per choice."""

    def __init__(self, model_id: str) -> None:
        self.render = FakeRender(model_id)
        self._metadata = ()
        self.requests: list = []

    async def stream_chat(self, request, on_generating=None):
        self.requests.append(type(request).FromString(request.SerializeToString()))
        if on_generating is not None:
            on_generating()
        for index in range(max(1, request.sampling.n)):
            yield derender_pb2.ChatChunk(index=index, role="assistant", content="ok",
                                         finish_reason=engine_pb2.FINISH_REASON_STOP,
                                         usage=engine_pb2.Usage(prompt_tokens=3, completion_tokens=1))

    stream_completion = stream_chat


class FakeUpstream:
    """Upstream's face: the pipeline, each service's health (`states`, settable) and the engines'
    LoRA adapters (`adapters`, names; `adapter_lists` counts the times they were asked for)."""

    def __init__(self, model_id: str) -> None:
        self.pipeline = FakePipeline(model_id)
        self.states = dict(SERVING)
        self.adapters: list[str] = []
        self.adapter_lists = 0

    async def lora_adapters(self) -> list[engine_pb2.LoraAdapterInfo]:
        self.adapter_lists += 1
        return [engine_pb2.LoraAdapterInfo(name=name, path=f"adapters/{name}") for name in self.adapters]

    async def load_lora_adapter(self, name: str, path: str) -> None:
        self.adapters.append(name)

    async def unload_lora_adapter(self, name: str) -> None:
        self.adapters.remove(name)

    async def health(self) -> dict[str, str]:
        return dict(self.states)


# -- the token-in/token-out path (vLLM's API on the gateway) -----------------------------------

#: The fake model's vocabulary: ids in [0, VOCAB) are valid, as the engine checks them.
VOCAB = 1000
#: Where the fake engine serves, as a prefill answer names it.
ENGINE_ADDRESS = "127.0.0.1:50051"


def prompt_ids_of(text: str) -> list[int]:
    """The fake render's tokenizer: one id per character."""
    return [ord(character) % VOCAB for character in text] or [1]


#: The fake render's image placeholder token, and how many an image expands to.
IMAGE_TOKEN = VOCAB - 1
IMAGE_SPAN = 4


def image_item(url: str, offset: int, payload: int) -> multimodal_pb2.MultiModalItem:
    """An image item as render gives it: a hash of the URL, its span, metadata (a Qwen2-VL-like
    `image_grid_thw`) and, with tensors asked for, `pixel_values` made from the URL's bytes."""
    item = multimodal_pb2.MultiModalItem(modality=multimodal_pb2.MODALITY_IMAGE,
                                         mm_hash=hashlib.sha256(url.encode()).hexdigest()[:32],
                                         placeholder=multimodal_pb2.PlaceholderRange(offset=offset, length=IMAGE_SPAN))
    if payload != multimodal_pb2.MM_PAYLOAD_NONE:
        item.metadata["image_grid_thw"].CopyFrom(tensors.from_numpy(np.array([[1, 2, 8]], dtype=np.int64)))
    if payload in (multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_UNSPECIFIED):
        pixels = np.frombuffer(hashlib.sha256(url.encode()).digest(), dtype=np.uint8)[:16].astype(np.float32)
        item.kwargs["pixel_values"].CopyFrom(tensors.from_numpy(pixels.reshape(IMAGE_SPAN * 4, 1)))
    return item


class FakeRenderer(FakeRender):
    """Render's RenderChat and RenderCompletion: a prompt of one id per character of the messages'
    text (an image part: IMAGE_SPAN placeholder ids and its item, image_item), the sampling
    options resolved as render resolves the ones the tests use, and a call count per RPC
    (`calls`)."""

    def __init__(self, model_id: str) -> None:
        super().__init__(model_id)
        self.calls: dict[str, int] = {"RenderChat": 0, "RenderCompletion": 0}

    async def GetModelInfo(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        return render_pb2.RenderServiceGetModelInfoResponse(model_id=self.model_id, max_context_length=4096,
                                                           vocab_size=VOCAB)

    async def RenderChat(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.calls["RenderChat"] += 1
        request = type(request).FromString(request.SerializeToString())
        ids: list[int] = []
        items = []
        for message in request.messages:
            ids += prompt_ids_of(f"{message.role}:{message.content}")
            for part in message.content_parts:
                if part.HasField("image"):
                    items.append(image_item(part.image.url, len(ids), request.mm_payload))
                    ids += [IMAGE_TOKEN] * IMAGE_SPAN
                else:
                    ids += prompt_ids_of(part.text)
        rendered = self._rendered(render_pb2.RenderChatResponse, request, ids)
        rendered.generate_request.mm_features.items.extend(items)
        return rendered

    async def RenderCompletion(self, request, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        self.calls["RenderCompletion"] += 1
        request = type(request).FromString(request.SerializeToString())
        ids = list(request.prompt_token_ids) or prompt_ids_of(request.prompt)
        return self._rendered(render_pb2.RenderCompletionResponse, request, ids)

    @staticmethod
    def _rendered(kind, request, ids: list[int]):
        options = request.sampling
        params = sampling_pb2.SamplingParams(stop_token_ids=options.stop_token_ids, logprobs=options.logprobs,
                                             top_logprobs=options.top_logprobs)
        for name in ("max_tokens", "temperature", "top_p", "seed", "n"):
            if options.HasField(name):
                setattr(params, name, getattr(options, name))
        generate = engine_pb2.GenerateRequest(request_id=request.request_id, token_ids=ids, sampling_params=params,
                                              cache_salt=request.cache_salt)
        context = derender_pb2.DerenderContext(
            request_id=request.request_id, prompt_tail_token_ids=ids[-4:], prompt_tokens=len(ids),
            n=max(1, options.n), logprobs=options.logprobs,
            text_options=sampling_pb2.OutputTextOptions(stop=options.stop))
        return kind(generate_request=generate, derender_context=context)


class FakeEngine:
    """The engine's Generate and Abort: refuses ids outside [0, VOCAB) as the engine does; choice
    i answers max_tokens (default 4) ids counting up from the prompt's last id plus i (plus the
    seed, when sampling), with logprobs when asked, and a prefill request's handle (kv_transfer.prefill) on choice 0's
    last response; `aborted` keeps what Abort was sent."""

    def __init__(self) -> None:
        self.requests: list[engine_pb2.GenerateRequest] = []
        self.aborted: list[str] = []

    async def generate(self, request: engine_pb2.GenerateRequest):
        request = engine_pb2.GenerateRequest.FromString(request.SerializeToString())
        self.requests.append(request)
        for index, token in enumerate(request.token_ids):
            if token >= VOCAB:
                raise InvalidArgument(f"token_ids[{index}] is {token}, outside the vocabulary [0, {VOCAB})",
                                      reason="TOKEN_ID_OUT_OF_RANGE", field=f"token_ids[{index}]")
        params = request.sampling_params
        count = params.max_tokens if params.HasField("max_tokens") else 4
        shift = params.seed if params.HasField("seed") and params.temperature > 0 else 0
        for choice in range(params.n if params.HasField("n") else 1):
            ids = [(request.token_ids[-1] + choice + shift + k + 1) % VOCAB for k in range(count)]
            for position, token in enumerate(ids):
                last = position == len(ids) - 1
                yield engine_pb2.GenerateResponse(
                    index=choice, token_ids=[token],
                    logprobs=[_position(token, params.top_logprobs)] if params.logprobs else [],
                    finish_reason=engine_pb2.FINISH_REASON_LENGTH if last else engine_pb2.FINISH_REASON_UNSPECIFIED,
                    usage=engine_pb2.Usage(prompt_tokens=len(request.token_ids), completion_tokens=count)
                    if last else None,
                    kv_transfer_handle=_handle(request) if last and choice == 0 else None)

    async def abort(self, request_ids: list[str]) -> list[str]:
        self.aborted.extend(request_ids)
        return list(request_ids)


def _handle(request: engine_pb2.GenerateRequest) -> engine_pb2.KvTransferHandle | None:
    """A prefill request's handle, as a native engine's last response carries it (None otherwise)."""
    if request.kv_transfer.WhichOneof("role") != "prefill":
        return None
    return engine_pb2.KvTransferHandle(transfer_id=f"t-{request.request_id}", engine_id="fake-engine",
                                       request_id=request.request_id, num_tokens=len(request.token_ids))


def _position(token: int, top: int) -> engine_pb2.PositionLogprobs:
    sampled = engine_pb2.TokenLogprob(token_id=token, logprob=-0.25, rank=1)
    others = [engine_pb2.TokenLogprob(token_id=(token + k) % VOCAB, logprob=-1.0 - k, rank=k + 1)
              for k in range(1, top)]
    return engine_pb2.PositionLogprobs(sampled=sampled, top=[sampled, *others][:top])


class FakeDerender:
    """Derender's Derender stream: each engine response's ids as text (`<id>` each), its end with
    the finish reason and usage (completion tokens of every choice finished so far, as derender
    counts them). The contexts its streams opened with, in `contexts`."""

    def __init__(self) -> None:
        self.contexts: list[derender_pb2.DerenderContext] = []

    def Derender(self, requests, timeout=None, metadata=None):  # noqa: N802 - the stub's name
        return self._chunks(requests)

    async def _chunks(self, requests):
        context, finished = None, 0
        async for message in requests:
            if message.HasField("context"):
                context = message.context
                self.contexts.append(context)
                continue
            response = message.generate_response
            chunk = derender_pb2.ChatChunk(index=response.index, content="".join(f"<{t}>" for t in response.token_ids),
                                           finish_reason=response.finish_reason)
            if response.finish_reason:
                finished += response.usage.completion_tokens
                chunk.usage.CopyFrom(engine_pb2.Usage(prompt_tokens=context.prompt_tokens, completion_tokens=finished))
            yield derender_pb2.DerenderResponse(chunk=chunk)


class TokensPipeline(FakePipeline):
    """FakePipeline with render, the engine and derender behind the token-in/token-out path and
    the chat (render -> engine -> derender, or a render answer kept -> engine -> derender)."""

    def __init__(self, model_id: str) -> None:
        super().__init__(model_id)
        self.render = FakeRenderer(model_id)
        self.engine = FakeEngine()
        self.derender = FakeDerender()
        self.timeout = 10.0

    def generate(self, request):
        return self.engine.generate(request)

    async def stream_chat(self, request, on_generating=None):
        async for chunk in self.stream_prepared("chat", request.request_id, lambda metadata: self.render.RenderChat(
                request), on_generating):
            yield chunk

    async def stream_prepared(self, name, request_id, prepare, on_generating=None, on_response=None):
        rendered = await prepare(None)

        async def requests():
            yield derender_pb2.DerenderRequest(context=rendered.derender_context)
            async for response in self.engine.generate(rendered.generate_request):
                if on_response is not None:
                    on_response(response, ENGINE_ADDRESS)
                yield derender_pb2.DerenderRequest(generate_response=response)

        async for reply in self.derender.Derender(requests()):
            yield reply.chunk

    async def abort(self, request_ids):
        return await self.engine.abort(request_ids)


class TokensUpstream(FakeUpstream):
    def __init__(self, model_id: str) -> None:
        super().__init__(model_id)
        self.pipeline = TokensPipeline(model_id)


class FakeRpcError(grpc.RpcError):
    """What grpc raises on a failed call: code(), details() and the status trailers."""

    def __init__(self, error=None, code=grpc.StatusCode.UNAVAILABLE, details="connection refused"):
        self._status = rpc_status.to_status(status_for(error)) if error is not None else None
        self._code = self._status.code if self._status else code
        self._details = self._status.details if self._status else details

    def code(self):
        return self._code

    def details(self):
        return self._details

    def trailing_metadata(self):
        return self._status.trailing_metadata if self._status else ()
