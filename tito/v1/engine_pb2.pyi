from tito.v1 import multimodal_pb2 as _multimodal_pb2
from tito.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_ABORT: _ClassVar[FinishReason]
    FINISH_REASON_TOOL_CALLS: _ClassVar[FinishReason]

class KvTransferProtocol(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    KV_TRANSFER_PROTOCOL_UNSPECIFIED: _ClassVar[KvTransferProtocol]
    KV_TRANSFER_PROTOCOL_NONE: _ClassVar[KvTransferProtocol]
    KV_TRANSFER_PROTOCOL_TITO: _ClassVar[KvTransferProtocol]
    KV_TRANSFER_PROTOCOL_VLLM_CONNECTOR: _ClassVar[KvTransferProtocol]
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_ABORT: FinishReason
FINISH_REASON_TOOL_CALLS: FinishReason
KV_TRANSFER_PROTOCOL_UNSPECIFIED: KvTransferProtocol
KV_TRANSFER_PROTOCOL_NONE: KvTransferProtocol
KV_TRANSFER_PROTOCOL_TITO: KvTransferProtocol
KV_TRANSFER_PROTOCOL_VLLM_CONNECTOR: KvTransferProtocol

class GenerateRequest(_message.Message):
    __slots__ = ("request_id", "token_ids", "mm_features", "sampling_params", "cache_salt", "lora_name", "kv_transfer")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MM_FEATURES_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    mm_features: _multimodal_pb2.MultiModalFeatures
    sampling_params: _sampling_pb2.SamplingParams
    cache_salt: str
    lora_name: str
    kv_transfer: KvTransfer
    def __init__(self, request_id: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., mm_features: _Optional[_Union[_multimodal_pb2.MultiModalFeatures, _Mapping]] = ..., sampling_params: _Optional[_Union[_sampling_pb2.SamplingParams, _Mapping]] = ..., cache_salt: _Optional[str] = ..., lora_name: _Optional[str] = ..., kv_transfer: _Optional[_Union[KvTransfer, _Mapping]] = ...) -> None: ...

class KvTransfer(_message.Message):
    __slots__ = ("prefill", "decode", "connector_params_json")
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    CONNECTOR_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    prefill: KvPrefill
    decode: KvDecode
    connector_params_json: str
    def __init__(self, prefill: _Optional[_Union[KvPrefill, _Mapping]] = ..., decode: _Optional[_Union[KvDecode, _Mapping]] = ..., connector_params_json: _Optional[str] = ...) -> None: ...

class KvPrefill(_message.Message):
    __slots__ = ("pin_seconds",)
    PIN_SECONDS_FIELD_NUMBER: _ClassVar[int]
    pin_seconds: float
    def __init__(self, pin_seconds: _Optional[float] = ...) -> None: ...

class KvDecode(_message.Message):
    __slots__ = ("handle", "source_address")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    SOURCE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    handle: KvTransferHandle
    source_address: str
    def __init__(self, handle: _Optional[_Union[KvTransferHandle, _Mapping]] = ..., source_address: _Optional[str] = ...) -> None: ...

class KvTransferHandle(_message.Message):
    __slots__ = ("transfer_id", "request_id", "engine_id", "block_count", "block_size", "num_tokens", "dtype", "layout", "expires_at", "prompt_digest", "model_fingerprint", "auth_key_id", "auth_tag")
    TRANSFER_ID_FIELD_NUMBER: _ClassVar[int]
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ENGINE_ID_FIELD_NUMBER: _ClassVar[int]
    BLOCK_COUNT_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    NUM_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_FIELD_NUMBER: _ClassVar[int]
    EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    AUTH_KEY_ID_FIELD_NUMBER: _ClassVar[int]
    AUTH_TAG_FIELD_NUMBER: _ClassVar[int]
    transfer_id: str
    request_id: str
    engine_id: str
    block_count: int
    block_size: int
    num_tokens: int
    dtype: str
    layout: KvBlockLayout
    expires_at: float
    prompt_digest: bytes
    model_fingerprint: str
    auth_key_id: str
    auth_tag: bytes
    def __init__(self, transfer_id: _Optional[str] = ..., request_id: _Optional[str] = ..., engine_id: _Optional[str] = ..., block_count: _Optional[int] = ..., block_size: _Optional[int] = ..., num_tokens: _Optional[int] = ..., dtype: _Optional[str] = ..., layout: _Optional[_Union[KvBlockLayout, _Mapping]] = ..., expires_at: _Optional[float] = ..., prompt_digest: _Optional[bytes] = ..., model_fingerprint: _Optional[str] = ..., auth_key_id: _Optional[str] = ..., auth_tag: _Optional[bytes] = ...) -> None: ...

class KvBlockLayout(_message.Message):
    __slots__ = ("num_layers", "kv_heads", "head_dim")
    NUM_LAYERS_FIELD_NUMBER: _ClassVar[int]
    KV_HEADS_FIELD_NUMBER: _ClassVar[int]
    HEAD_DIM_FIELD_NUMBER: _ClassVar[int]
    num_layers: int
    kv_heads: int
    head_dim: int
    def __init__(self, num_layers: _Optional[int] = ..., kv_heads: _Optional[int] = ..., head_dim: _Optional[int] = ...) -> None: ...

class TokenLogprob(_message.Message):
    __slots__ = ("token_id", "logprob", "rank")
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    token_id: int
    logprob: float
    rank: int
    def __init__(self, token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., rank: _Optional[int] = ...) -> None: ...

class PositionLogprobs(_message.Message):
    __slots__ = ("sampled", "top")
    SAMPLED_FIELD_NUMBER: _ClassVar[int]
    TOP_FIELD_NUMBER: _ClassVar[int]
    sampled: TokenLogprob
    top: _containers.RepeatedCompositeFieldContainer[TokenLogprob]
    def __init__(self, sampled: _Optional[_Union[TokenLogprob, _Mapping]] = ..., top: _Optional[_Iterable[_Union[TokenLogprob, _Mapping]]] = ...) -> None: ...

class Usage(_message.Message):
    __slots__ = ("prompt_tokens", "completion_tokens", "cached_tokens")
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    COMPLETION_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CACHED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int
    def __init__(self, prompt_tokens: _Optional[int] = ..., completion_tokens: _Optional[int] = ..., cached_tokens: _Optional[int] = ...) -> None: ...

class GenerateResponse(_message.Message):
    __slots__ = ("index", "token_ids", "logprobs", "finish_reason", "matched_stop_token_id", "usage", "kv_transfer_handle", "kv_transfer_stats", "kv_connector_params_json")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_HANDLE_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_STATS_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_PARAMS_JSON_FIELD_NUMBER: _ClassVar[int]
    index: int
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    logprobs: _containers.RepeatedCompositeFieldContainer[PositionLogprobs]
    finish_reason: FinishReason
    matched_stop_token_id: int
    usage: Usage
    kv_transfer_handle: KvTransferHandle
    kv_transfer_stats: KvTransferStats
    kv_connector_params_json: str
    def __init__(self, index: _Optional[int] = ..., token_ids: _Optional[_Iterable[int]] = ..., logprobs: _Optional[_Iterable[_Union[PositionLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., matched_stop_token_id: _Optional[int] = ..., usage: _Optional[_Union[Usage, _Mapping]] = ..., kv_transfer_handle: _Optional[_Union[KvTransferHandle, _Mapping]] = ..., kv_transfer_stats: _Optional[_Union[KvTransferStats, _Mapping]] = ..., kv_connector_params_json: _Optional[str] = ...) -> None: ...

class KvTransferStats(_message.Message):
    __slots__ = ("blocks_pulled", "blocks_cached", "bytes_pulled")
    BLOCKS_PULLED_FIELD_NUMBER: _ClassVar[int]
    BLOCKS_CACHED_FIELD_NUMBER: _ClassVar[int]
    BYTES_PULLED_FIELD_NUMBER: _ClassVar[int]
    blocks_pulled: int
    blocks_cached: int
    bytes_pulled: int
    def __init__(self, blocks_pulled: _Optional[int] = ..., blocks_cached: _Optional[int] = ..., bytes_pulled: _Optional[int] = ...) -> None: ...

class EncodeRequest(_message.Message):
    __slots__ = ("request_id", "mm_features")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MM_FEATURES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    mm_features: _multimodal_pb2.MultiModalFeatures
    def __init__(self, request_id: _Optional[str] = ..., mm_features: _Optional[_Union[_multimodal_pb2.MultiModalFeatures, _Mapping]] = ...) -> None: ...

class EncodeResponse(_message.Message):
    __slots__ = ("descriptors",)
    DESCRIPTORS_FIELD_NUMBER: _ClassVar[int]
    descriptors: _containers.RepeatedCompositeFieldContainer[_multimodal_pb2.EncoderCacheDescriptor]
    def __init__(self, descriptors: _Optional[_Iterable[_Union[_multimodal_pb2.EncoderCacheDescriptor, _Mapping]]] = ...) -> None: ...

class AbortRequest(_message.Message):
    __slots__ = ("request_ids",)
    REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class AbortResponse(_message.Message):
    __slots__ = ("aborted_request_ids",)
    ABORTED_REQUEST_IDS_FIELD_NUMBER: _ClassVar[int]
    aborted_request_ids: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, aborted_request_ids: _Optional[_Iterable[str]] = ...) -> None: ...

class EngineServiceGetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ModalityInfo(_message.Message):
    __slots__ = ("modality", "placeholder_token", "placeholder_token_id")
    MODALITY_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_TOKEN_FIELD_NUMBER: _ClassVar[int]
    PLACEHOLDER_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    modality: _multimodal_pb2.Modality
    placeholder_token: str
    placeholder_token_id: int
    def __init__(self, modality: _Optional[_Union[_multimodal_pb2.Modality, str]] = ..., placeholder_token: _Optional[str] = ..., placeholder_token_id: _Optional[int] = ...) -> None: ...

class EngineServiceGetModelInfoResponse(_message.Message):
    __slots__ = ("model_id", "vocab_size", "max_context_length", "eos_token_ids", "modalities", "dtype", "device", "model_fingerprint", "max_running_requests", "tokenizer_vocab_size", "lora_adapters", "max_loras", "max_lora_rank", "kv_transfer_protocol", "kv_connector")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    EOS_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    MODALITIES_FIELD_NUMBER: _ClassVar[int]
    DTYPE_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MODEL_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    MAX_RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORAS_FIELD_NUMBER: _ClassVar[int]
    MAX_LORA_RANK_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_PROTOCOL_FIELD_NUMBER: _ClassVar[int]
    KV_CONNECTOR_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    max_context_length: int
    eos_token_ids: _containers.RepeatedScalarFieldContainer[int]
    modalities: _containers.RepeatedCompositeFieldContainer[ModalityInfo]
    dtype: str
    device: str
    model_fingerprint: str
    max_running_requests: int
    tokenizer_vocab_size: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    max_loras: int
    max_lora_rank: int
    kv_transfer_protocol: KvTransferProtocol
    kv_connector: str
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., eos_token_ids: _Optional[_Iterable[int]] = ..., modalities: _Optional[_Iterable[_Union[ModalityInfo, _Mapping]]] = ..., dtype: _Optional[str] = ..., device: _Optional[str] = ..., model_fingerprint: _Optional[str] = ..., max_running_requests: _Optional[int] = ..., tokenizer_vocab_size: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ..., max_loras: _Optional[int] = ..., max_lora_rank: _Optional[int] = ..., kv_transfer_protocol: _Optional[_Union[KvTransferProtocol, str]] = ..., kv_connector: _Optional[str] = ...) -> None: ...

class GetLoadRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class GetLoadResponse(_message.Message):
    __slots__ = ("running_requests", "waiting_requests", "kv_blocks_total", "kv_blocks_used", "kv_block_size", "encoder_cache_hits", "encoder_cache_misses", "prefix_cache_hit_tokens", "finished_requests", "encoded_items", "encoder_store_loads", "draining", "lora_adapters")
    RUNNING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    WAITING_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_TOTAL_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCKS_USED_FIELD_NUMBER: _ClassVar[int]
    KV_BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_HITS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_CACHE_MISSES_FIELD_NUMBER: _ClassVar[int]
    PREFIX_CACHE_HIT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    ENCODED_ITEMS_FIELD_NUMBER: _ClassVar[int]
    ENCODER_STORE_LOADS_FIELD_NUMBER: _ClassVar[int]
    DRAINING_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    running_requests: int
    waiting_requests: int
    kv_blocks_total: int
    kv_blocks_used: int
    kv_block_size: int
    encoder_cache_hits: int
    encoder_cache_misses: int
    prefix_cache_hit_tokens: int
    finished_requests: int
    encoded_items: int
    encoder_store_loads: int
    draining: bool
    lora_adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, running_requests: _Optional[int] = ..., waiting_requests: _Optional[int] = ..., kv_blocks_total: _Optional[int] = ..., kv_blocks_used: _Optional[int] = ..., kv_block_size: _Optional[int] = ..., encoder_cache_hits: _Optional[int] = ..., encoder_cache_misses: _Optional[int] = ..., prefix_cache_hit_tokens: _Optional[int] = ..., finished_requests: _Optional[int] = ..., encoded_items: _Optional[int] = ..., encoder_store_loads: _Optional[int] = ..., draining: _Optional[bool] = ..., lora_adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...

class SubscribeKvEventsRequest(_message.Message):
    __slots__ = ("start_sequence",)
    START_SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    start_sequence: int
    def __init__(self, start_sequence: _Optional[int] = ...) -> None: ...

class SubscribeKvEventsResponse(_message.Message):
    __slots__ = ("sequence", "timestamp", "events", "data_parallel_rank")
    SEQUENCE_FIELD_NUMBER: _ClassVar[int]
    TIMESTAMP_FIELD_NUMBER: _ClassVar[int]
    EVENTS_FIELD_NUMBER: _ClassVar[int]
    DATA_PARALLEL_RANK_FIELD_NUMBER: _ClassVar[int]
    sequence: int
    timestamp: float
    events: _containers.RepeatedCompositeFieldContainer[KvCacheEvent]
    data_parallel_rank: int
    def __init__(self, sequence: _Optional[int] = ..., timestamp: _Optional[float] = ..., events: _Optional[_Iterable[_Union[KvCacheEvent, _Mapping]]] = ..., data_parallel_rank: _Optional[int] = ...) -> None: ...

class KvCacheEvent(_message.Message):
    __slots__ = ("block_stored", "block_removed", "all_blocks_cleared")
    BLOCK_STORED_FIELD_NUMBER: _ClassVar[int]
    BLOCK_REMOVED_FIELD_NUMBER: _ClassVar[int]
    ALL_BLOCKS_CLEARED_FIELD_NUMBER: _ClassVar[int]
    block_stored: BlockStored
    block_removed: BlockRemoved
    all_blocks_cleared: AllBlocksCleared
    def __init__(self, block_stored: _Optional[_Union[BlockStored, _Mapping]] = ..., block_removed: _Optional[_Union[BlockRemoved, _Mapping]] = ..., all_blocks_cleared: _Optional[_Union[AllBlocksCleared, _Mapping]] = ...) -> None: ...

class BlockStored(_message.Message):
    __slots__ = ("block_hashes", "parent_block_hash", "token_ids", "block_size", "extra_keys", "medium", "lora_name")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    PARENT_BLOCK_HASH_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BLOCK_SIZE_FIELD_NUMBER: _ClassVar[int]
    EXTRA_KEYS_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    parent_block_hash: bytes
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    block_size: int
    extra_keys: _containers.RepeatedCompositeFieldContainer[BlockExtraKeys]
    medium: str
    lora_name: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., parent_block_hash: _Optional[bytes] = ..., token_ids: _Optional[_Iterable[int]] = ..., block_size: _Optional[int] = ..., extra_keys: _Optional[_Iterable[_Union[BlockExtraKeys, _Mapping]]] = ..., medium: _Optional[str] = ..., lora_name: _Optional[str] = ...) -> None: ...

class BlockExtraKeys(_message.Message):
    __slots__ = ("media", "cache_salt")
    MEDIA_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    media: _containers.RepeatedCompositeFieldContainer[BlockMediaKey]
    cache_salt: str
    def __init__(self, media: _Optional[_Iterable[_Union[BlockMediaKey, _Mapping]]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class BlockMediaKey(_message.Message):
    __slots__ = ("mm_hash", "offset")
    MM_HASH_FIELD_NUMBER: _ClassVar[int]
    OFFSET_FIELD_NUMBER: _ClassVar[int]
    mm_hash: str
    offset: int
    def __init__(self, mm_hash: _Optional[str] = ..., offset: _Optional[int] = ...) -> None: ...

class BlockRemoved(_message.Message):
    __slots__ = ("block_hashes", "medium")
    BLOCK_HASHES_FIELD_NUMBER: _ClassVar[int]
    MEDIUM_FIELD_NUMBER: _ClassVar[int]
    block_hashes: _containers.RepeatedScalarFieldContainer[bytes]
    medium: str
    def __init__(self, block_hashes: _Optional[_Iterable[bytes]] = ..., medium: _Optional[str] = ...) -> None: ...

class AllBlocksCleared(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ResetPrefixCacheResponse(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DrainRequest(_message.Message):
    __slots__ = ("grace_seconds",)
    GRACE_SECONDS_FIELD_NUMBER: _ClassVar[int]
    grace_seconds: float
    def __init__(self, grace_seconds: _Optional[float] = ...) -> None: ...

class DrainResponse(_message.Message):
    __slots__ = ("in_flight_requests",)
    IN_FLIGHT_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    in_flight_requests: int
    def __init__(self, in_flight_requests: _Optional[int] = ...) -> None: ...

class LoraAdapterInfo(_message.Message):
    __slots__ = ("name", "path", "rank", "target_modules", "active_requests", "resident")
    NAME_FIELD_NUMBER: _ClassVar[int]
    PATH_FIELD_NUMBER: _ClassVar[int]
    RANK_FIELD_NUMBER: _ClassVar[int]
    TARGET_MODULES_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    RESIDENT_FIELD_NUMBER: _ClassVar[int]
    name: str
    path: str
    rank: int
    target_modules: _containers.RepeatedScalarFieldContainer[str]
    active_requests: int
    resident: bool
    def __init__(self, name: _Optional[str] = ..., path: _Optional[str] = ..., rank: _Optional[int] = ..., target_modules: _Optional[_Iterable[str]] = ..., active_requests: _Optional[int] = ..., resident: _Optional[bool] = ...) -> None: ...

class LoadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name", "lora_path")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_path: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_path: _Optional[str] = ...) -> None: ...

class LoadLoraAdapterResponse(_message.Message):
    __slots__ = ("adapter",)
    ADAPTER_FIELD_NUMBER: _ClassVar[int]
    adapter: LoraAdapterInfo
    def __init__(self, adapter: _Optional[_Union[LoraAdapterInfo, _Mapping]] = ...) -> None: ...

class UnloadLoraAdapterRequest(_message.Message):
    __slots__ = ("lora_name",)
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    def __init__(self, lora_name: _Optional[str] = ...) -> None: ...

class UnloadLoraAdapterResponse(_message.Message):
    __slots__ = ("active_requests",)
    ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    active_requests: int
    def __init__(self, active_requests: _Optional[int] = ...) -> None: ...

class ListLoraAdaptersRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ListLoraAdaptersResponse(_message.Message):
    __slots__ = ("adapters",)
    ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    adapters: _containers.RepeatedCompositeFieldContainer[LoraAdapterInfo]
    def __init__(self, adapters: _Optional[_Iterable[_Union[LoraAdapterInfo, _Mapping]]] = ...) -> None: ...

class PullKvBlocksRequest(_message.Message):
    __slots__ = ("handle", "first_block")
    HANDLE_FIELD_NUMBER: _ClassVar[int]
    FIRST_BLOCK_FIELD_NUMBER: _ClassVar[int]
    handle: KvTransferHandle
    first_block: int
    def __init__(self, handle: _Optional[_Union[KvTransferHandle, _Mapping]] = ..., first_block: _Optional[int] = ...) -> None: ...

class PullKvBlocksResponse(_message.Message):
    __slots__ = ("block_index", "data", "byte_size", "checksum")
    BLOCK_INDEX_FIELD_NUMBER: _ClassVar[int]
    DATA_FIELD_NUMBER: _ClassVar[int]
    BYTE_SIZE_FIELD_NUMBER: _ClassVar[int]
    CHECKSUM_FIELD_NUMBER: _ClassVar[int]
    block_index: int
    data: bytes
    byte_size: int
    checksum: bytes
    def __init__(self, block_index: _Optional[int] = ..., data: _Optional[bytes] = ..., byte_size: _Optional[int] = ..., checksum: _Optional[bytes] = ...) -> None: ...
