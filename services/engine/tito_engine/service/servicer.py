"""tito.v1.EngineService over grpc.aio: protos in, domain calls, protos out. Nothing else.

Every request passes the same admission (admission.py) and then goes to the backend seam
(backend.py): the native engine or vLLM, which cannot tell the servicer apart.
"""

from __future__ import annotations

import asyncio

from tito.errors import LoadingGate
from tito.logs import bind_request_id
from tito.structured_output import StructuredOutputSpec, spec_from_proto
from tito.v1 import engine_pb2, engine_pb2_grpc, multimodal_pb2, sampling_pb2

from tito_engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from tito_engine.service.admission import Admission
from tito_engine.service.backend import EngineBackend, LoadSnapshot
from tito_engine.multimodal.features import MODALITY_NAMES
from tito_engine.service.observe import RequestObserver
from tito_engine.request import ChoiceOutput, FinishReason, GenerateInput, RawSamplingParams, TokenLogprob

_FINISH_REASONS = {
    FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: engine_pb2.FINISH_REASON_ABORT,
}


_MODALITIES = {"image": multimodal_pb2.MODALITY_IMAGE, "video": multimodal_pb2.MODALITY_VIDEO,
               "audio": multimodal_pb2.MODALITY_AUDIO}


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


def sampling_from_proto(params: sampling_pb2.SamplingParams) -> RawSamplingParams:
    return RawSamplingParams(
        max_tokens=_optional(params, "max_tokens"),
        min_tokens=params.min_tokens,
        temperature=_optional(params, "temperature"),
        top_p=_optional(params, "top_p"),
        top_k=params.top_k,
        min_p=params.min_p,
        seed=_optional(params, "seed"),
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=_optional(params, "repetition_penalty"),
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        n=_optional(params, "n"),
        logprobs=params.logprobs,
        top_logprobs=params.top_logprobs,
        structured_output=structured_output_from_proto(params),
    )


def structured_output_from_proto(params: sampling_pb2.SamplingParams) -> StructuredOutputSpec | None:
    return spec_from_proto(params.structured_output) if params.HasField("structured_output") else None


def _modality_name(value: int) -> str:
    # proto3 keeps enum values it does not know: admission refuses them (UNSUPPORTED_MODALITY).
    return MODALITY_NAMES.get(value, f"modality {value}")


def generate_input_from_proto(request: engine_pb2.GenerateRequest) -> GenerateInput:
    return GenerateInput(
        request_id=request.request_id,
        token_ids=list(request.token_ids),
        sampling=sampling_from_proto(request.sampling_params),
        mm_modalities=[_modality_name(item.modality) for item in request.mm_features.items],
        mm_features=request.mm_features if request.HasField("mm_features") else None,
        cache_salt=request.cache_salt,
    )


def _token_logprob(entry: TokenLogprob) -> engine_pb2.TokenLogprob:
    return engine_pb2.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank)


def output_to_proto(output: ChoiceOutput) -> engine_pb2.GenerateResponse:
    response = engine_pb2.GenerateResponse(index=output.index, token_ids=output.token_ids)
    for position in output.logprobs:
        response.logprobs.append(engine_pb2.PositionLogprobs(
            sampled=_token_logprob(position.sampled), top=[_token_logprob(entry) for entry in position.top]))
    if output.finish_reason is not None:
        response.finish_reason = _FINISH_REASONS[output.finish_reason]
        if output.matched_stop_token_id is not None:
            response.matched_stop_token_id = output.matched_stop_token_id
    if output.usage is not None:
        response.usage.prompt_tokens = output.usage.prompt_tokens
        response.usage.completion_tokens = output.usage.completion_tokens
        response.usage.cached_tokens = output.usage.cached_tokens
    return response


def _block_id(digest: bytes | int) -> bytes:
    # vLLM's ids are 64-bit integers by default: their 8 bytes, big-endian.
    return digest if isinstance(digest, bytes) else digest.to_bytes(8, "big")


def kv_batch_to_proto(batch: KvEventBatch) -> engine_pb2.SubscribeKvEventsResponse:
    response = engine_pb2.SubscribeKvEventsResponse(sequence=batch.sequence, timestamp=batch.timestamp)
    if batch.data_parallel_rank is not None:
        response.data_parallel_rank = batch.data_parallel_rank
    for event in batch.events:
        entry = response.events.add()
        if isinstance(event, BlockStored):
            stored = entry.block_stored
            stored.block_hashes.extend(_block_id(digest) for digest in event.block_hashes)
            if event.parent_block_hash is not None:
                stored.parent_block_hash = _block_id(event.parent_block_hash)
            stored.token_ids.extend(event.token_ids)
            stored.block_size = event.block_size
            for keys in event.extra_keys or ():
                block = stored.extra_keys.add()
                if keys is not None:
                    block.cache_salt = keys.cache_salt
                    for media in keys.media:
                        block.media.add(mm_hash=media.mm_hash, offset=media.offset)
            stored.medium = event.medium or ""
            stored.lora_name = event.lora_name or ""
        elif isinstance(event, BlockRemoved):
            entry.block_removed.block_hashes.extend(_block_id(digest) for digest in event.block_hashes)
            entry.block_removed.medium = event.medium or ""
        elif isinstance(event, AllBlocksCleared):
            entry.all_blocks_cleared.SetInParent()
        else:  # pragma: no cover - the log holds only these three
            raise TypeError(f"unknown KV event {event!r}")
    return response


class EngineServicer(engine_pb2_grpc.EngineServiceServicer):
    def __init__(self):
        self._backend: LoadingGate[EngineBackend] = LoadingGate("the engine")
        self._admission: Admission | None = None
        self._observer: RequestObserver | None = None

    def attach(self, backend: EngineBackend, admission: Admission, observer: RequestObserver | None = None) -> None:
        """Start answering with `backend` (the server is bound before the model finishes loading);
        `observer` measures and traces each Generate stream (None: metrics and tracing are off)."""
        self._admission = admission
        self._observer = observer
        self._backend.open(backend)

    def load_now(self) -> LoadSnapshot | None:
        """The backend's load, or None while the model loads (for metrics read at scrape time)."""
        return self._backend.get().load() if self._backend.is_open else None

    @property
    def _engine(self) -> EngineBackend:
        return self._backend.get()

    async def Generate(self, request: engine_pb2.GenerateRequest, context):
        if request.request_id:
            bind_request_id(request.request_id)
        backend = self._engine
        generate = generate_input_from_proto(request)
        if generate.sampling.structured_output is not None:  # checking a grammar can take ms: off the loop
            admitted = await asyncio.to_thread(self._admission.admit, generate)
        else:
            admitted = self._admission.admit(generate)
        outputs = backend.generate(admitted)
        if self._observer is not None:
            outputs = self._observer.observe(outputs)
        try:
            async for output in outputs:
                yield output_to_proto(output)
        finally:
            await outputs.aclose()  # on cancel: aborts the request in the engine

    async def Encode(self, request: engine_pb2.EncodeRequest, context):
        if request.request_id:
            bind_request_id(request.request_id)
        backend = self._engine
        features = request.mm_features if request.HasField("mm_features") else None
        descriptors = await backend.encode(self._admission.admit_encode(features))
        return engine_pb2.EncodeResponse(descriptors=self._admission.sign_descriptors(descriptors))

    async def Abort(self, request: engine_pb2.AbortRequest, context):
        return engine_pb2.AbortResponse(aborted_request_ids=self._engine.abort(list(request.request_ids)))

    async def GetModelInfo(self, request, context):
        info = self._engine.info
        return engine_pb2.EngineServiceGetModelInfoResponse(
            model_id=info.model_id,
            vocab_size=info.vocab_size,
            max_context_length=info.max_context_length,
            eos_token_ids=info.eos_token_ids,
            dtype=info.dtype,
            device=info.device,
            model_fingerprint=info.fingerprint,
            max_running_requests=self._engine.max_running_sequences,
            tokenizer_vocab_size=info.tokenizer_vocab_size or info.vocab_size,
            modalities=[engine_pb2.ModalityInfo(modality=_MODALITIES[name], placeholder_token=token,
                                                placeholder_token_id=token_id)
                        for name, token, token_id in info.placeholders if name in _MODALITIES],
        )

    async def GetLoad(self, request, context):
        load = self._engine.load()
        return engine_pb2.GetLoadResponse(
            running_requests=load.running_requests,
            waiting_requests=load.waiting_requests,
            finished_requests=load.finished_requests,
            kv_blocks_total=load.kv_blocks_total,
            kv_blocks_used=load.kv_blocks_used,
            kv_block_size=load.kv_block_size,
            prefix_cache_hit_tokens=load.prefix_cache_hit_tokens,
            encoder_cache_hits=load.encoder_cache_hits,
            encoder_cache_misses=load.encoder_cache_misses,
            encoded_items=load.encoded_items,
            encoder_store_loads=load.encoder_store_loads,
        )

    async def SubscribeKvEvents(self, request: engine_pb2.SubscribeKvEventsRequest, context):
        start = request.start_sequence if request.HasField("start_sequence") else None
        batches = self._engine.kv_events.subscribe(start)
        try:
            async for batch in batches:
                yield kv_batch_to_proto(batch)
        finally:
            await batches.aclose()

    async def ResetPrefixCache(self, request, context):
        await self._engine.reset_prefix_cache()
        return engine_pb2.ResetPrefixCacheResponse()
