from google.protobuf import struct_pb2 as _struct_pb2
from tito.v1 import chat_pb2 as _chat_pb2
from tito.v1 import derender_pb2 as _derender_pb2
from tito.v1 import engine_pb2 as _engine_pb2
from tito.v1 import multimodal_pb2 as _multimodal_pb2
from tito.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class SamplingOptions(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty", "repetition_penalty", "stop", "stop_token_ids", "ignore_eos", "n", "logprobs", "top_logprobs", "include_stop_str_in_output", "skip_special_tokens", "spaces_between_special_tokens", "structured_output", "logit_bias")
    class LogitBiasEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    STRUCTURED_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    LOGIT_BIAS_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    seed: int
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    ignore_eos: bool
    n: int
    logprobs: bool
    top_logprobs: int
    include_stop_str_in_output: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    structured_output: _sampling_pb2.StructuredOutput
    logit_bias: _containers.ScalarMap[int, float]
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_p: _Optional[float] = ..., top_k: _Optional[int] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., repetition_penalty: _Optional[float] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., ignore_eos: _Optional[bool] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., top_logprobs: _Optional[int] = ..., include_stop_str_in_output: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., structured_output: _Optional[_Union[_sampling_pb2.StructuredOutput, _Mapping]] = ..., logit_bias: _Optional[_Mapping[int, float]] = ...) -> None: ...

class ResponseFormat(_message.Message):
    __slots__ = ("type", "json_schema")
    TYPE_FIELD_NUMBER: _ClassVar[int]
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    type: str
    json_schema: JsonSchemaResponseFormat
    def __init__(self, type: _Optional[str] = ..., json_schema: _Optional[_Union[JsonSchemaResponseFormat, _Mapping]] = ...) -> None: ...

class JsonSchemaResponseFormat(_message.Message):
    __slots__ = ("name", "description", "schema", "strict")
    NAME_FIELD_NUMBER: _ClassVar[int]
    DESCRIPTION_FIELD_NUMBER: _ClassVar[int]
    SCHEMA_FIELD_NUMBER: _ClassVar[int]
    STRICT_FIELD_NUMBER: _ClassVar[int]
    name: str
    description: str
    schema: _struct_pb2.Struct
    strict: bool
    def __init__(self, name: _Optional[str] = ..., description: _Optional[str] = ..., schema: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., strict: _Optional[bool] = ...) -> None: ...

class MediaOptions(_message.Message):
    __slots__ = ("min_pixels", "max_pixels", "processor_kwargs")
    MIN_PIXELS_FIELD_NUMBER: _ClassVar[int]
    MAX_PIXELS_FIELD_NUMBER: _ClassVar[int]
    PROCESSOR_KWARGS_FIELD_NUMBER: _ClassVar[int]
    min_pixels: int
    max_pixels: int
    processor_kwargs: _struct_pb2.Struct
    def __init__(self, min_pixels: _Optional[int] = ..., max_pixels: _Optional[int] = ..., processor_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ...) -> None: ...

class RenderChatRequest(_message.Message):
    __slots__ = ("request_id", "messages", "tools", "tool_choice", "chat_template", "chat_template_kwargs", "add_generation_prompt", "continue_final_message", "sampling", "mm_payload", "media_options", "cache_salt", "return_prompt_text", "response_format", "parallel_tool_calls", "usage_in_every_chunk", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    MESSAGES_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    CHAT_TEMPLATE_KWARGS_FIELD_NUMBER: _ClassVar[int]
    ADD_GENERATION_PROMPT_FIELD_NUMBER: _ClassVar[int]
    CONTINUE_FINAL_MESSAGE_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    MM_PAYLOAD_FIELD_NUMBER: _ClassVar[int]
    MEDIA_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    RESPONSE_FORMAT_FIELD_NUMBER: _ClassVar[int]
    PARALLEL_TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    USAGE_IN_EVERY_CHUNK_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    messages: _containers.RepeatedCompositeFieldContainer[_chat_pb2.ChatMessage]
    tools: _containers.RepeatedCompositeFieldContainer[_chat_pb2.Tool]
    tool_choice: _chat_pb2.ToolChoice
    chat_template: str
    chat_template_kwargs: _struct_pb2.Struct
    add_generation_prompt: bool
    continue_final_message: bool
    sampling: SamplingOptions
    mm_payload: _multimodal_pb2.MmPayload
    media_options: MediaOptions
    cache_salt: str
    return_prompt_text: bool
    response_format: ResponseFormat
    parallel_tool_calls: bool
    usage_in_every_chunk: bool
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., messages: _Optional[_Iterable[_Union[_chat_pb2.ChatMessage, _Mapping]]] = ..., tools: _Optional[_Iterable[_Union[_chat_pb2.Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[_chat_pb2.ToolChoice, _Mapping]] = ..., chat_template: _Optional[str] = ..., chat_template_kwargs: _Optional[_Union[_struct_pb2.Struct, _Mapping]] = ..., add_generation_prompt: _Optional[bool] = ..., continue_final_message: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., mm_payload: _Optional[_Union[_multimodal_pb2.MmPayload, str]] = ..., media_options: _Optional[_Union[MediaOptions, _Mapping]] = ..., cache_salt: _Optional[str] = ..., return_prompt_text: _Optional[bool] = ..., response_format: _Optional[_Union[ResponseFormat, _Mapping]] = ..., parallel_tool_calls: _Optional[bool] = ..., usage_in_every_chunk: _Optional[bool] = ..., lora_name: _Optional[str] = ...) -> None: ...

class RenderChatResponse(_message.Message):
    __slots__ = ("generate_request", "derender_context", "prompt_text")
    GENERATE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    DERENDER_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TEXT_FIELD_NUMBER: _ClassVar[int]
    generate_request: _engine_pb2.GenerateRequest
    derender_context: _derender_pb2.DerenderContext
    prompt_text: str
    def __init__(self, generate_request: _Optional[_Union[_engine_pb2.GenerateRequest, _Mapping]] = ..., derender_context: _Optional[_Union[_derender_pb2.DerenderContext, _Mapping]] = ..., prompt_text: _Optional[str] = ...) -> None: ...

class RenderCompletionRequest(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "add_special_tokens", "sampling", "cache_salt", "usage_in_every_chunk", "lora_name")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    USAGE_IN_EVERY_CHUNK_FIELD_NUMBER: _ClassVar[int]
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    add_special_tokens: bool
    sampling: SamplingOptions
    cache_salt: str
    usage_in_every_chunk: bool
    lora_name: str
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., add_special_tokens: _Optional[bool] = ..., sampling: _Optional[_Union[SamplingOptions, _Mapping]] = ..., cache_salt: _Optional[str] = ..., usage_in_every_chunk: _Optional[bool] = ..., lora_name: _Optional[str] = ...) -> None: ...

class RenderCompletionResponse(_message.Message):
    __slots__ = ("generate_request", "derender_context")
    GENERATE_REQUEST_FIELD_NUMBER: _ClassVar[int]
    DERENDER_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    generate_request: _engine_pb2.GenerateRequest
    derender_context: _derender_pb2.DerenderContext
    def __init__(self, generate_request: _Optional[_Union[_engine_pb2.GenerateRequest, _Mapping]] = ..., derender_context: _Optional[_Union[_derender_pb2.DerenderContext, _Mapping]] = ...) -> None: ...

class TokenizeRequest(_message.Message):
    __slots__ = ("text", "add_special_tokens", "return_token_strings")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    text: str
    add_special_tokens: bool
    return_token_strings: bool
    def __init__(self, text: _Optional[str] = ..., add_special_tokens: _Optional[bool] = ..., return_token_strings: _Optional[bool] = ...) -> None: ...

class TokenizeResponse(_message.Message):
    __slots__ = ("token_ids", "token_strings")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    TOKEN_STRINGS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    token_strings: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., token_strings: _Optional[_Iterable[str]] = ...) -> None: ...

class RenderServiceGetModelInfoRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class RenderServiceGetModelInfoResponse(_message.Message):
    __slots__ = ("model_id", "vocab_size", "max_context_length", "modalities", "reasoning_parser", "tool_parser", "has_chat_template", "tokenizer_vocab_size")
    MODEL_ID_FIELD_NUMBER: _ClassVar[int]
    VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_CONTEXT_LENGTH_FIELD_NUMBER: _ClassVar[int]
    MODALITIES_FIELD_NUMBER: _ClassVar[int]
    REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    TOOL_PARSER_FIELD_NUMBER: _ClassVar[int]
    HAS_CHAT_TEMPLATE_FIELD_NUMBER: _ClassVar[int]
    TOKENIZER_VOCAB_SIZE_FIELD_NUMBER: _ClassVar[int]
    model_id: str
    vocab_size: int
    max_context_length: int
    modalities: _containers.RepeatedScalarFieldContainer[_multimodal_pb2.Modality]
    reasoning_parser: str
    tool_parser: str
    has_chat_template: bool
    tokenizer_vocab_size: int
    def __init__(self, model_id: _Optional[str] = ..., vocab_size: _Optional[int] = ..., max_context_length: _Optional[int] = ..., modalities: _Optional[_Iterable[_Union[_multimodal_pb2.Modality, str]]] = ..., reasoning_parser: _Optional[str] = ..., tool_parser: _Optional[str] = ..., has_chat_template: _Optional[bool] = ..., tokenizer_vocab_size: _Optional[int] = ...) -> None: ...
