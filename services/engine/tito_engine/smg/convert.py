"""SMG's `vllm.grpc.engine.VllmEngine` messages <-> the engine's domain objects (protobuf only, no
grpc): the same `GenerateInput` tito.v1's converter makes, so both faces share admission and
everything below it.

What SMG means by each field is what its own vLLM servicer (PyPI smg-grpc-servicer) does with it:
`top_p` and `repetition_penalty` 0 mean unset, `n` 0 means 1, `logprobs` k asks for the sampled
token's logprob plus the k best alternatives, a negative `seed` is a seed like any other, and the
finish reasons are spelled "stop", "length", "abort". What this engine cannot serve is refused by
name (UNSUPPORTED_FIELD), never silently dropped. `kv_transfer_params_json` (vLLM's connector
handoff, which SMG forwards from the prefill worker's answer to the decode worker) is mapped onto
tito's prefill/decode roles as the gateway's vLLM HTTP API maps it (tito.kv_params).
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

from smg_grpc_proto import vllm_engine_pb2
from smg_grpc_proto.generated import common_pb2

from tito import kv_params
from tito.errors import InvalidArgument, TitoError
from tito.structured_output import StructuredOutputSpec, spec_from_proto

from tito_engine.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KvEventBatch
from tito_engine.model_info import ModelInfo
from tito_engine.multimodal.items import MODALITY_NAMES
from tito_engine.request import ChoiceOutput, FinishReason, GenerateInput, RawSamplingParams
from tito_engine.backend.interface import LoadSnapshot
from tito_engine.kv_transfer import KvHandle
from tito_engine.service.convert import handle_to_proto, kv_role_from_proto
from tito_engine.smg.facts import ModelFacts
from tito_engine.smg.media import media_from_proto
from tito_engine.smg.stops import StopStringOptions, check_stop_strings
from tito_engine.smg.stream import FaceOutput

UNSUPPORTED_FIELD = "UNSUPPORTED_FIELD"
FINISH_REASONS = {FinishReason.STOP: "stop", FinishReason.LENGTH: "length", FinishReason.ABORT: "abort"}
#: What GetServerInfo calls this protocol's worker (the value SMG's own vLLM servicer sends).
SERVER_TYPE = "vllm-grpc"
#: The modalities GetServerInfo's `mm_item_limits` label names (those a router request carries).
ITEM_LIMIT_MODALITIES = ("image", "video")
#: tito's field paths (admission names tito.v1's fields) and this protocol's names for them.
_FIELD_NAMES = (
    ("token_ids", "tokenized.input_ids"),
    ("sampling_params.top_logprobs", "sampling_params.logprobs"),
    ("sampling_params.structured_output.", "sampling_params."),
    # The i-th media item in prompt order, over mm_inputs and extra_mm_inputs together.
    ("mm_features.items", "mm_inputs.items"),
    # Prefill/decode: tito's handle rides in the JSON (tito.kv_params.HANDLE_KEY).
    ("kv_transfer.decode.handle", f"kv_transfer_params_json.{kv_params.HANDLE_KEY}"),
    (kv_params.FIELD, "kv_transfer_params_json"),
    ("kv_transfer", "kv_transfer_params_json"),
)
_U64 = (1 << 64) - 1


@dataclass(frozen=True)
class SmgGenerate:
    """A Generate request of this protocol as the domain sees it: tito's input, and what only this
    face does (the stream's shape, stop strings)."""

    generate: GenerateInput
    stream: bool
    stops: StopStringOptions | None
    stop_token_ids: frozenset[int]  # matched_token_id is reported for these (not for EOS), as vLLM does


def smg_field(path: str) -> str:
    """A tito field path in this protocol's names (`token_ids[3]` -> `tokenized.input_ids[3]`)."""
    for tito_name, smg_name in _FIELD_NAMES:
        if path.startswith(tito_name):
            return smg_name + path[len(tito_name):]
    return path


def with_smg_fields(error: TitoError) -> TitoError:
    """`error` with its field paths (and the message's mentions of them) in this protocol's names."""
    message = error.message
    violations = []
    for violation in error.violations:
        renamed = smg_field(violation.field)
        message = message.replace(violation.field, renamed)
        violations.append(dataclasses.replace(violation, field=renamed,
                                              description=violation.description.replace(violation.field, renamed)))
    rebuilt = type(error)(message, reason=error.reason, violations=violations, metadata=error.metadata)
    return rebuilt


def _unsupported(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(message, reason=UNSUPPORTED_FIELD, field=field)


def _optional(message, name: str):
    return getattr(message, name) if message.HasField(name) else None


def constraint_from_proto(params: vllm_engine_pb2.SamplingParams) -> StructuredOutputSpec | None:
    """The oneof `constraint` as tito's spec: tito.v1's StructuredOutput has the same oneof, with the
    same kinds, names and meanings; only `json_object` false (set, but asking for nothing) differs."""
    if params.WhichOneof("constraint") == "json_object" and not params.json_object:
        return None
    return spec_from_proto(params)


def sampling_from_proto(params: vllm_engine_pb2.SamplingParams) -> RawSamplingParams:
    logprobs = _optional(params, "logprobs")
    if logprobs is not None and logprobs < 0:
        raise _unsupported("sampling_params.logprobs", f"logprobs {logprobs} asks for every token's logprob; this "
                           f"engine returns the sampled token's and up to 20 alternatives: send 0 to 20")
    if params.HasField("prompt_logprobs"):
        raise _unsupported("sampling_params.prompt_logprobs", "this engine does not compute prompt logprobs; "
                           "leave prompt_logprobs unset")
    seed = _optional(params, "seed")
    return RawSamplingParams(
        max_tokens=_optional(params, "max_tokens"),
        min_tokens=params.min_tokens,
        temperature=_optional(params, "temperature"),
        top_p=params.top_p or None,
        top_k=params.top_k,
        min_p=params.min_p,
        seed=None if seed is None else seed & _U64,  # int32 here, uint64 in tito: the same bits
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        repetition_penalty=params.repetition_penalty or None,
        stop_token_ids=tuple(params.stop_token_ids),
        ignore_eos=params.ignore_eos,
        n=params.n or None,
        logprobs=logprobs is not None,
        top_logprobs=logprobs or 0,
        structured_output=constraint_from_proto(params),
        logit_bias=dict(params.logit_bias),
    )


def _check_served(request: vllm_engine_pb2.GenerateRequest) -> None:
    """Refuse the request fields this engine does not serve, each by name."""
    kind = request.WhichOneof("input")
    if kind != "tokenized":
        raise InvalidArgument("this engine takes token ids only: send tokenized.input_ids (SMG tokenizes with the "
                              "files GetTokenizer serves), not text", reason="TOKENIZED_INPUT_REQUIRED",
                              field="text" if kind == "text" else "tokenized")
    if request.HasField("media_refs"):
        raise _unsupported("media_refs", "this worker does not fetch media (GetServerInfo.mm_processor is empty): "
                           "send preprocessed mm_inputs")
    if (request.HasField("mm_inputs") or request.extra_mm_inputs) and \
            request.sampling_params.HasField("truncate_prompt_tokens"):
        raise _unsupported("sampling_params.truncate_prompt_tokens", "a prompt with media is not truncated (its "
                           "placeholders would move); leave truncate_prompt_tokens unset")
    if request.HasField("kv_transfer_params"):
        raise _unsupported("kv_transfer_params", "the legacy typed field carries a Mooncake host and port, no "
                                                 "prefill/decode role: send kv_transfer_params_json")
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        raise InvalidArgument(f"data_parallel_rank {request.data_parallel_rank}: this engine is one rank (0)",
                              reason="INVALID_REQUEST", field="data_parallel_rank")


def _kv_parts(request: vllm_engine_pb2.GenerateRequest) -> dict:
    """The request's part in a prefill/decode split (GenerateInput's kv_transfer and
    kv_connector_params), from vLLM's `kv_transfer_params` JSON."""
    if not request.HasField("kv_transfer_params_json"):
        return {}
    try:
        params = json.loads(request.kv_transfer_params_json)
    except ValueError:
        raise InvalidArgument("kv_transfer_params_json is not JSON: send the object the prefill worker's "
                              "GenerateComplete carried, or {\"do_remote_decode\": true} to prefill",
                              reason="INVALID_REQUEST", field="kv_transfer_params_json") from None
    try:
        transfer = kv_params.kv_transfer_from_params(params)
    except TitoError as error:
        raise with_smg_fields(error) from None
    if transfer is None:
        return {}
    return {"kv_transfer": kv_role_from_proto(transfer), "kv_connector_params": params}


def kv_params_json(handle: KvHandle, address: str) -> str:
    """A prefill's `kv_transfer_params_json` for SMG to forward to the decode worker: tito's handle
    and `address`, where this engine serves EngineService (PullKvBlocks)."""
    return json.dumps(kv_params.params_from_handle(handle_to_proto(handle), address), separators=(",", ":"))


def _prompt(request: vllm_engine_pb2.GenerateRequest, max_context_length: int) -> list[int]:
    ids = list(request.tokenized.input_ids)
    params = request.sampling_params
    if not params.HasField("truncate_prompt_tokens"):
        return ids
    keep = params.truncate_prompt_tokens
    if keep == -1:
        keep = max_context_length  # vLLM's -1: the model's context
    if keep < 1:
        raise InvalidArgument(f"truncate_prompt_tokens {keep}: send -1 (the context limit) or a count >= 1",
                              reason="INVALID_SAMPLING_PARAMS", field="sampling_params.truncate_prompt_tokens")
    return ids[-keep:]


def generate_from_proto(request: vllm_engine_pb2.GenerateRequest, *, max_context_length: int) -> SmgGenerate:
    _check_served(request)
    params = request.sampling_params
    stops = tuple(params.stop)
    check_stop_strings(stops, "sampling_params.stop")
    sampling = sampling_from_proto(params)
    prompt = _prompt(request, max_context_length)
    items = media_from_proto(request, prompt)
    generate = GenerateInput(request_id=request.request_id, token_ids=prompt, sampling=sampling,
                             mm_modalities=[MODALITY_NAMES.get(item.modality, f"modality {item.modality}")
                                            for item in items], mm_items=items, **_kv_parts(request))
    options = StopStringOptions(stops, params.include_stop_str_in_output, params.skip_special_tokens,
                                params.min_tokens) if stops else None
    return SmgGenerate(generate, request.stream, options, frozenset(params.stop_token_ids))


def _output_logprobs(output: ChoiceOutput, with_top: bool) -> vllm_engine_pb2.OutputLogProbs | None:
    if not output.logprobs:
        return None
    proto = vllm_engine_pb2.OutputLogProbs()
    for position in output.logprobs:
        proto.token_logprobs.append(position.sampled.logprob)
        proto.token_ids.append(position.sampled.token_id)
        if with_top:
            proto.top_logprobs.add(values=[entry.logprob for entry in position.top],
                                   token_ids=[entry.token_id for entry in position.top])
    return proto


def chunk_to_proto(face: FaceOutput, prompt_tokens: int, top_logprobs: int) -> vllm_engine_pb2.GenerateResponse:
    output = face.output
    return vllm_engine_pb2.GenerateResponse(chunk=vllm_engine_pb2.GenerateStreamChunk(
        token_ids=output.token_ids, prompt_tokens=prompt_tokens, completion_tokens=len(output.token_ids),
        cached_tokens=output.usage.cached_tokens if output.usage else 0,
        output_logprobs=_output_logprobs(output, top_logprobs > 0), index=output.index))


def complete_to_proto(face: FaceOutput, prompt_tokens: int, top_logprobs: int,
                      stop_token_ids: frozenset[int], kv_transfer_params_json: str | None = None
                      ) -> vllm_engine_pb2.GenerateResponse:
    """A choice's `complete`: streamed, it repeats its last chunk's tokens (as vLLM's servicer
    does; SMG counts the chunks), not streamed it carries all of them. `kv_transfer_params_json`:
    a prefill's handoff (kv_params_json)."""
    output = face.output
    complete = vllm_engine_pb2.GenerateComplete(
        output_ids=output.token_ids, finish_reason=FINISH_REASONS[output.finish_reason],
        prompt_tokens=prompt_tokens, completion_tokens=len(output.token_ids),
        cached_tokens=output.usage.cached_tokens if output.usage else 0,
        output_logprobs=_output_logprobs(output, top_logprobs > 0), index=output.index)
    if face.matched_stop is not None:
        complete.matched_stop_str = face.matched_stop
    elif output.matched_stop_token_id is not None and output.matched_stop_token_id in stop_token_ids:
        complete.matched_token_id = output.matched_stop_token_id
    if kv_transfer_params_json is not None:
        complete.kv_transfer_params_json = kv_transfer_params_json
    return vllm_engine_pb2.GenerateResponse(complete=complete)


def model_info_to_proto(info: ModelInfo, facts: ModelFacts, model_dir: str) -> vllm_engine_pb2.GetModelInfoResponse:
    return vllm_engine_pb2.GetModelInfoResponse(
        model_path=model_dir, is_generation=True, max_context_length=info.max_context_length,
        vocab_size=info.vocab_size, supports_vision=bool(info.modalities), served_model_name=info.model_id,
        tokenizer_path=model_dir, model_type=facts.model_type, architectures=facts.architectures,
        eos_token_ids=info.eos_token_ids, pad_token_id=facts.pad_token_id, bos_token_id=facts.bos_token_id,
        # tito leaves at least one position to generate in
        max_req_input_len=info.max_context_length - 1,
        default_sampling_params_json=facts.sampling_defaults_json)


def mm_item_limits(modalities: tuple[str, ...], max_items: int) -> str:
    """SMG's `mm_item_limits` label ("image=8,video=8", sorted; "" for a text model), which SMG's own
    media pipeline holds requests to. tito's limit (`--max-mm-items`) counts a request's items of
    every modality together, so each modality is labelled with the whole limit: SMG then refuses
    what the engine surely would, and the engine still refuses a mix above its total itself."""
    return ",".join(f"{modality}={max_items}" for modality in sorted(ITEM_LIMIT_MODALITIES)
                    if modality in modalities and max_items > 0)


#: The largest value of an int32 field.
_I32_MAX = (1 << 31) - 1


def server_info_to_proto(info: ModelInfo, load: LoadSnapshot, *, max_running_sequences: int, block_size: int,
                         uptime_seconds: float, last_receive_timestamp: float, max_mm_items: int,
                         largest_media_item: int) -> vllm_engine_pb2.GetServerInfoResponse:
    # mm_encoder_budget: the most encoder rows one item may bring and still be admitted
    # (Admission.largest_media_item). tito's encoder cache is sized in bytes and its scheduler
    # places an item of any size in one chunk, so the context and the KV cache are what bound it.
    return vllm_engine_pb2.GetServerInfoResponse(
        mm_item_limits=mm_item_limits(info.modalities, max_mm_items),
        mm_encoder_budget=min(largest_media_item, _I32_MAX),
        active_requests=load.running_requests + load.waiting_requests, is_paused=False,
        last_receive_timestamp=last_receive_timestamp, uptime_seconds=uptime_seconds, server_type=SERVER_TYPE,
        data_parallel_size=1, kv_cache_dtype="auto", block_size=block_size, model_dtype=f"torch.{info.dtype}",
        multimodal_encoder_dtype=info.dtype if info.modalities else "", max_num_seqs=max_running_sequences,
        # Grammars apply from the first generated token: tito's engine runs no reasoning parser.
        constrained_decoding_start="first_token")


def scheduler_load_to_proto(load: LoadSnapshot, max_running_sequences: int) -> vllm_engine_pb2.SchedulerLoad:
    total = load.kv_blocks_total * load.kv_block_size
    used = load.kv_blocks_used * load.kv_block_size
    usage = used / total if total else 0.0
    return vllm_engine_pb2.SchedulerLoad(
        dp_rank=0, num_running_reqs=load.running_requests, num_waiting_reqs=load.waiting_requests,
        num_total_reqs=load.running_requests + load.waiting_requests, num_used_tokens=used,
        max_total_num_tokens=total, token_usage=usage, utilization=usage,
        max_running_requests=max_running_sequences)


def block_hash(digest: bytes | int) -> int:
    """A block id as the protocol's int64: a digest folds to its last eight bytes, big-endian (the
    integer vLLM sends for it); SMG uses it as the block's identity only."""
    value = int.from_bytes(digest[-8:], "big") if isinstance(digest, bytes) else digest & _U64
    return value - (1 << 64) if value >= 1 << 63 else value


def _stored(event: BlockStored) -> common_pb2.KvBlocksStored:
    stored = common_pb2.KvBlocksStored(tier=common_pb2.KV_CACHE_TIER_DEVICE,
                                       locality=common_pb2.KV_CACHE_LOCALITY_LOCAL)
    keys = event.extra_keys or (None,) * len(event.block_hashes)
    for position, (digest, block_keys) in enumerate(zip(event.block_hashes, keys)):
        start = position * event.block_size
        block = stored.blocks.add(block_hash=block_hash(digest), block_size=event.block_size,
                                  token_ids=event.token_ids[start:start + event.block_size])
        if block_keys is not None:
            for media in block_keys.media:
                block.extra_keys.add(multimodal=common_pb2.KvMultimodalKey(identifier=media.mm_hash,
                                                                           offset=media.offset))
            if block_keys.cache_salt:
                stored.cache_salt = block_keys.cache_salt
    if event.parent_block_hash is not None:
        stored.parent_block_hash = block_hash(event.parent_block_hash)
    if event.medium:
        stored.medium = event.medium
    if event.lora_name:
        stored.lora_name = event.lora_name
    return stored


def kv_batch_to_proto(batch: KvEventBatch, first_event_id: int) -> common_pb2.KvEventBatch:
    """One batch of the engine's KV event log; its events numbered from `first_event_id`. The
    blocks are the engine's own cache (tier DEVICE, local), on CPU engines too: the cache its
    forward passes read."""
    proto = common_pb2.KvEventBatch(sequence_number=batch.sequence, timestamp=batch.timestamp)
    if batch.data_parallel_rank is not None:
        proto.dp_rank = batch.data_parallel_rank
    for offset, event in enumerate(batch.events):
        entry = proto.events.add(event_id=first_event_id + offset)
        if isinstance(event, BlockStored):
            entry.stored.CopyFrom(_stored(event))
        elif isinstance(event, BlockRemoved):
            entry.removed.block_hashes.extend(block_hash(digest) for digest in event.block_hashes)
            entry.removed.tier = common_pb2.KV_CACHE_TIER_DEVICE
            if event.medium:
                entry.removed.medium = event.medium
        elif isinstance(event, AllBlocksCleared):
            entry.cleared.SetInParent()
        else:  # pragma: no cover - the log holds only these three
            raise TypeError(f"unknown KV event {event!r}")
    return proto
