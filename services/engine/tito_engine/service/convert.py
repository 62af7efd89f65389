"""Protobuf <-> domain conversion for the engine (protobuf messages only, no grpc).

Requests become `request.GenerateInput` (media items as `multimodal.domain.MediaItem`s), outputs,
KV events and Encode's descriptors become messages; nothing below the servicer sees a message.
"""

from __future__ import annotations

import json

from tito.errors import InvalidArgument
from tito.structured_output import StructuredOutputSpec, spec_from_proto
from tito.v1 import engine_pb2, multimodal_pb2, sampling_pb2

from tito_engine.kv_transfer import KvDecode, KvHandle, KvLayout, KvPrefill, KvRole
from tito_engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from tito_engine.lora_types import LoraAdapterInfo
from tito_engine.multimodal.domain import EncoderCacheDescriptor, MediaItem, Placeholder, RawTensor
from tito_engine.multimodal.items import MODALITY_NAMES
from tito_engine.request import ChoiceOutput, FinishReason, GenerateInput, RawSamplingParams, TokenLogprob

_FINISH_REASONS = {
    FinishReason.STOP: engine_pb2.FINISH_REASON_STOP,
    FinishReason.LENGTH: engine_pb2.FINISH_REASON_LENGTH,
    FinishReason.ABORT: engine_pb2.FINISH_REASON_ABORT,
}


#: A modality's wire number by its name (GetModelInfo): MODALITY_NAMES the other way round.
MODALITIES = {name: value for value, name in MODALITY_NAMES.items()}
#: GetModelInfo's kv_transfer_protocol by the name backend/kv_transfers.py gives it.
KV_TRANSFER_PROTOCOLS = {"none": engine_pb2.KV_TRANSFER_PROTOCOL_NONE, "tito": engine_pb2.KV_TRANSFER_PROTOCOL_TITO,
                         "vllm_connector": engine_pb2.KV_TRANSFER_PROTOCOL_VLLM_CONNECTOR}


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
        logit_bias=dict(params.logit_bias),
        prior_output_tokens=params.prior_output_tokens,
    )


def structured_output_from_proto(params: sampling_pb2.SamplingParams) -> StructuredOutputSpec | None:
    return spec_from_proto(params.structured_output) if params.HasField("structured_output") else None


def _modality_name(value: int) -> str:
    # proto3 keeps enum values it does not know: admission refuses them (UNSUPPORTED_MODALITY).
    return MODALITY_NAMES.get(value, f"modality {value}")


def _tensors_from_proto(tensors) -> dict[str, RawTensor]:
    # `.data` is read once here: each read of a message's bytes field is a copy of the tensor.
    return {name: RawTensor(tensor.dtype, tuple(tensor.shape), tensor.data) for name, tensor in tensors.items()}


def descriptor_from_proto(ec: multimodal_pb2.EncoderCacheDescriptor) -> EncoderCacheDescriptor:
    return EncoderCacheDescriptor(store_id=ec.store_id, uri=ec.uri, key=ec.key, dtype=ec.dtype, shape=tuple(ec.shape),
                                  byte_size=ec.byte_size, checksum=ec.checksum,
                                  model_fingerprint=ec.model_fingerprint, auth_tag=ec.auth_tag,
                                  auth_key_id=ec.auth_key_id)


def descriptor_to_proto(ec: EncoderCacheDescriptor) -> multimodal_pb2.EncoderCacheDescriptor:
    return multimodal_pb2.EncoderCacheDescriptor(
        store_id=ec.store_id, uri=ec.uri, key=ec.key, dtype=ec.dtype, shape=list(ec.shape), byte_size=ec.byte_size,
        checksum=ec.checksum, model_fingerprint=ec.model_fingerprint, auth_tag=ec.auth_tag,
        auth_key_id=ec.auth_key_id)


def item_from_proto(item: multimodal_pb2.MultiModalItem) -> MediaItem:
    placeholder = item.placeholder
    return MediaItem(
        modality=item.modality, mm_hash=item.mm_hash,
        placeholder=Placeholder(placeholder.offset, placeholder.length, tuple(placeholder.is_embed))
        if item.HasField("placeholder") else None,
        kwargs=_tensors_from_proto(item.kwargs), metadata=_tensors_from_proto(item.metadata),
        ec_descriptor=descriptor_from_proto(item.ec_descriptor) if item.HasField("ec_descriptor") else None,
        auth_tag=item.auth_tag, auth_key_id=item.auth_key_id)


def media_from_proto(message) -> tuple[MediaItem, ...]:
    """The items of a request's `mm_features` (a GenerateRequest or an EncodeRequest)."""
    if not message.HasField("mm_features"):
        return ()
    return tuple(item_from_proto(item) for item in message.mm_features.items)


def generate_input_from_proto(request: engine_pb2.GenerateRequest) -> GenerateInput:
    items = media_from_proto(request)
    return GenerateInput(
        request_id=request.request_id,
        token_ids=list(request.token_ids),
        sampling=sampling_from_proto(request.sampling_params),
        mm_modalities=[_modality_name(item.modality) for item in items],
        mm_items=items,
        cache_salt=request.cache_salt,
        lora_name=request.lora_name,
        kv_transfer=kv_role_from_proto(request.kv_transfer) if request.HasField("kv_transfer") else None,
        kv_connector_params=connector_params_from_proto(request.kv_transfer),
    )


def connector_params_from_proto(transfer: engine_pb2.KvTransfer) -> dict | None:
    """KvTransfer.connector_params_json as the object it must hold, None when empty."""
    if not transfer.connector_params_json:
        return None
    try:
        params = json.loads(transfer.connector_params_json)
    except ValueError:
        params = None
    if not isinstance(params, dict):
        raise InvalidArgument("kv_transfer.connector_params_json must be a JSON object (vLLM's kv_transfer_params)",
                              reason="INVALID_REQUEST", field="kv_transfer.connector_params_json")
    return params


def kv_role_from_proto(transfer: engine_pb2.KvTransfer) -> KvRole | None:
    role = transfer.WhichOneof("role")
    if role == "prefill":
        return KvPrefill(transfer.prefill.pin_seconds or None)
    if role == "decode":
        return KvDecode(handle_from_proto(transfer.decode.handle), transfer.decode.source_address)
    return None


def handle_from_proto(handle: engine_pb2.KvTransferHandle) -> KvHandle:
    layout = handle.layout
    return KvHandle(handle.transfer_id, handle.request_id, handle.engine_id, handle.block_count, handle.block_size,
                    handle.num_tokens, handle.dtype, KvLayout(layout.num_layers, layout.kv_heads, layout.head_dim),
                    handle.expires_at, handle.prompt_digest, handle.model_fingerprint, handle.auth_key_id,
                    handle.auth_tag)


def handle_to_proto(handle: KvHandle) -> engine_pb2.KvTransferHandle:
    layout = handle.layout
    return engine_pb2.KvTransferHandle(
        transfer_id=handle.transfer_id, request_id=handle.request_id, engine_id=handle.engine_id,
        block_count=handle.block_count, block_size=handle.block_size, num_tokens=handle.num_tokens,
        dtype=handle.dtype, layout=engine_pb2.KvBlockLayout(num_layers=layout.num_layers, kv_heads=layout.kv_heads,
                                                            head_dim=layout.head_dim),
        expires_at=handle.expires_at, prompt_digest=handle.prompt_digest, model_fingerprint=handle.model_fingerprint,
        auth_key_id=handle.auth_key_id, auth_tag=handle.auth_tag)


def lora_adapter_to_proto(adapter: LoraAdapterInfo) -> engine_pb2.LoraAdapterInfo:
    return engine_pb2.LoraAdapterInfo(name=adapter.name, path=adapter.path, rank=adapter.rank,
                                      target_modules=list(adapter.target_modules),
                                      active_requests=adapter.active_requests, resident=adapter.resident)


def _token_logprob(entry: TokenLogprob) -> engine_pb2.TokenLogprob:
    return engine_pb2.TokenLogprob(token_id=entry.token_id, logprob=entry.logprob, rank=entry.rank)


def output_to_proto(output: ChoiceOutput, handle: KvHandle | None = None) -> engine_pb2.GenerateResponse:
    """A choice's output; `handle`: a prefill request's KV transfer handle, on its last output."""
    response = engine_pb2.GenerateResponse(index=output.index, token_ids=output.token_ids)
    if handle is not None:
        response.kv_transfer_handle.CopyFrom(handle_to_proto(handle))
    if output.kv_connector_params is not None:
        response.kv_connector_params_json = json.dumps(output.kv_connector_params, separators=(",", ":"))
    if output.kv_stats is not None:
        stats = output.kv_stats
        response.kv_transfer_stats.blocks_pulled = stats.blocks_pulled
        response.kv_transfer_stats.blocks_cached = stats.blocks_cached
        response.kv_transfer_stats.bytes_pulled = stats.bytes_pulled
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
