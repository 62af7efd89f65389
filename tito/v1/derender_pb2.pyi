from google.rpc import status_pb2 as _status_pb2
from tito.v1 import chat_pb2 as _chat_pb2
from tito.v1 import engine_pb2 as _engine_pb2
from tito.v1 import sampling_pb2 as _sampling_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class DerenderContext(_message.Message):
    __slots__ = ("request_id", "prompt_tail_token_ids", "prompt_tokens", "text_options", "reasoning_parser", "tool_parser", "tools", "tool_choice", "thinking_enabled", "prompt_opens_reasoning", "n", "logprobs", "usage_in_every_chunk", "resume_state", "return_state")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TAIL_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEXT_OPTIONS_FIELD_NUMBER: _ClassVar[int]
    REASONING_PARSER_FIELD_NUMBER: _ClassVar[int]
    TOOL_PARSER_FIELD_NUMBER: _ClassVar[int]
    TOOLS_FIELD_NUMBER: _ClassVar[int]
    TOOL_CHOICE_FIELD_NUMBER: _ClassVar[int]
    THINKING_ENABLED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_OPENS_REASONING_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    USAGE_IN_EVERY_CHUNK_FIELD_NUMBER: _ClassVar[int]
    RESUME_STATE_FIELD_NUMBER: _ClassVar[int]
    RETURN_STATE_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt_tail_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt_tokens: int
    text_options: _sampling_pb2.OutputTextOptions
    reasoning_parser: str
    tool_parser: str
    tools: _containers.RepeatedCompositeFieldContainer[_chat_pb2.Tool]
    tool_choice: _chat_pb2.ToolChoice
    thinking_enabled: bool
    prompt_opens_reasoning: bool
    n: int
    logprobs: bool
    usage_in_every_chunk: bool
    resume_state: bytes
    return_state: bool
    def __init__(self, request_id: _Optional[str] = ..., prompt_tail_token_ids: _Optional[_Iterable[int]] = ..., prompt_tokens: _Optional[int] = ..., text_options: _Optional[_Union[_sampling_pb2.OutputTextOptions, _Mapping]] = ..., reasoning_parser: _Optional[str] = ..., tool_parser: _Optional[str] = ..., tools: _Optional[_Iterable[_Union[_chat_pb2.Tool, _Mapping]]] = ..., tool_choice: _Optional[_Union[_chat_pb2.ToolChoice, _Mapping]] = ..., thinking_enabled: _Optional[bool] = ..., prompt_opens_reasoning: _Optional[bool] = ..., n: _Optional[int] = ..., logprobs: _Optional[bool] = ..., usage_in_every_chunk: _Optional[bool] = ..., resume_state: _Optional[bytes] = ..., return_state: _Optional[bool] = ...) -> None: ...

class DerenderRequest(_message.Message):
    __slots__ = ("context", "generate_response")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    context: DerenderContext
    generate_response: _engine_pb2.GenerateResponse
    def __init__(self, context: _Optional[_Union[DerenderContext, _Mapping]] = ..., generate_response: _Optional[_Union[_engine_pb2.GenerateResponse, _Mapping]] = ...) -> None: ...

class ToolCallDelta(_message.Message):
    __slots__ = ("index", "id", "type", "name", "arguments")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    TYPE_FIELD_NUMBER: _ClassVar[int]
    NAME_FIELD_NUMBER: _ClassVar[int]
    ARGUMENTS_FIELD_NUMBER: _ClassVar[int]
    index: int
    id: str
    type: str
    name: str
    arguments: str
    def __init__(self, index: _Optional[int] = ..., id: _Optional[str] = ..., type: _Optional[str] = ..., name: _Optional[str] = ..., arguments: _Optional[str] = ...) -> None: ...

class TopLogprob(_message.Message):
    __slots__ = ("token", "token_id", "logprob", "bytes")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    token: str
    token_id: int
    logprob: float
    bytes: bytes
    def __init__(self, token: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., bytes: _Optional[bytes] = ...) -> None: ...

class TokenLogprobText(_message.Message):
    __slots__ = ("token", "token_id", "logprob", "bytes", "top_logprobs")
    TOKEN_FIELD_NUMBER: _ClassVar[int]
    TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    LOGPROB_FIELD_NUMBER: _ClassVar[int]
    BYTES_FIELD_NUMBER: _ClassVar[int]
    TOP_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    token: str
    token_id: int
    logprob: float
    bytes: bytes
    top_logprobs: _containers.RepeatedCompositeFieldContainer[TopLogprob]
    def __init__(self, token: _Optional[str] = ..., token_id: _Optional[int] = ..., logprob: _Optional[float] = ..., bytes: _Optional[bytes] = ..., top_logprobs: _Optional[_Iterable[_Union[TopLogprob, _Mapping]]] = ...) -> None: ...

class ChatChunk(_message.Message):
    __slots__ = ("index", "role", "content", "reasoning_content", "tool_calls", "finish_reason", "matched_stop", "usage", "logprobs", "cancel_generation")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    ROLE_FIELD_NUMBER: _ClassVar[int]
    CONTENT_FIELD_NUMBER: _ClassVar[int]
    REASONING_CONTENT_FIELD_NUMBER: _ClassVar[int]
    TOOL_CALLS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    CANCEL_GENERATION_FIELD_NUMBER: _ClassVar[int]
    index: int
    role: str
    content: str
    reasoning_content: str
    tool_calls: _containers.RepeatedCompositeFieldContainer[ToolCallDelta]
    finish_reason: _engine_pb2.FinishReason
    matched_stop: str
    usage: _engine_pb2.Usage
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobText]
    cancel_generation: bool
    def __init__(self, index: _Optional[int] = ..., role: _Optional[str] = ..., content: _Optional[str] = ..., reasoning_content: _Optional[str] = ..., tool_calls: _Optional[_Iterable[_Union[ToolCallDelta, _Mapping]]] = ..., finish_reason: _Optional[_Union[_engine_pb2.FinishReason, str]] = ..., matched_stop: _Optional[str] = ..., usage: _Optional[_Union[_engine_pb2.Usage, _Mapping]] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobText, _Mapping]]] = ..., cancel_generation: _Optional[bool] = ...) -> None: ...

class DerenderResponse(_message.Message):
    __slots__ = ("chunk", "stream_state")
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    STREAM_STATE_FIELD_NUMBER: _ClassVar[int]
    chunk: ChatChunk
    stream_state: bytes
    def __init__(self, chunk: _Optional[_Union[ChatChunk, _Mapping]] = ..., stream_state: _Optional[bytes] = ...) -> None: ...

class DerenderBatchRequest(_message.Message):
    __slots__ = ("entries",)
    ENTRIES_FIELD_NUMBER: _ClassVar[int]
    entries: _containers.RepeatedCompositeFieldContainer[DerenderBatchEntry]
    def __init__(self, entries: _Optional[_Iterable[_Union[DerenderBatchEntry, _Mapping]]] = ...) -> None: ...

class DerenderBatchEntry(_message.Message):
    __slots__ = ("stream_id", "context", "generate_response", "close")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    GENERATE_RESPONSE_FIELD_NUMBER: _ClassVar[int]
    CLOSE_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    context: DerenderContext
    generate_response: _engine_pb2.GenerateResponse
    close: DerenderBatchClose
    def __init__(self, stream_id: _Optional[int] = ..., context: _Optional[_Union[DerenderContext, _Mapping]] = ..., generate_response: _Optional[_Union[_engine_pb2.GenerateResponse, _Mapping]] = ..., close: _Optional[_Union[DerenderBatchClose, _Mapping]] = ...) -> None: ...

class DerenderBatchClose(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DerenderBatchResponse(_message.Message):
    __slots__ = ("results",)
    RESULTS_FIELD_NUMBER: _ClassVar[int]
    results: _containers.RepeatedCompositeFieldContainer[DerenderBatchResult]
    def __init__(self, results: _Optional[_Iterable[_Union[DerenderBatchResult, _Mapping]]] = ...) -> None: ...

class DerenderBatchResult(_message.Message):
    __slots__ = ("stream_id", "chunk", "error", "ended")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    CHUNK_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    stream_id: int
    chunk: ChatChunk
    error: _status_pb2.Status
    ended: DerenderBatchEnded
    def __init__(self, stream_id: _Optional[int] = ..., chunk: _Optional[_Union[ChatChunk, _Mapping]] = ..., error: _Optional[_Union[_status_pb2.Status, _Mapping]] = ..., ended: _Optional[_Union[DerenderBatchEnded, _Mapping]] = ...) -> None: ...

class DerenderBatchEnded(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class DerenderFullRequest(_message.Message):
    __slots__ = ("context", "responses")
    CONTEXT_FIELD_NUMBER: _ClassVar[int]
    RESPONSES_FIELD_NUMBER: _ClassVar[int]
    context: DerenderContext
    responses: _containers.RepeatedCompositeFieldContainer[_engine_pb2.GenerateResponse]
    def __init__(self, context: _Optional[_Union[DerenderContext, _Mapping]] = ..., responses: _Optional[_Iterable[_Union[_engine_pb2.GenerateResponse, _Mapping]]] = ...) -> None: ...

class ChatChoice(_message.Message):
    __slots__ = ("index", "message", "finish_reason", "matched_stop", "logprobs")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    MESSAGE_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    MATCHED_STOP_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    index: int
    message: _chat_pb2.ChatMessage
    finish_reason: _engine_pb2.FinishReason
    matched_stop: str
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobText]
    def __init__(self, index: _Optional[int] = ..., message: _Optional[_Union[_chat_pb2.ChatMessage, _Mapping]] = ..., finish_reason: _Optional[_Union[_engine_pb2.FinishReason, str]] = ..., matched_stop: _Optional[str] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobText, _Mapping]]] = ...) -> None: ...

class DerenderFullResponse(_message.Message):
    __slots__ = ("choices", "usage")
    CHOICES_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    choices: _containers.RepeatedCompositeFieldContainer[ChatChoice]
    usage: _engine_pb2.Usage
    def __init__(self, choices: _Optional[_Iterable[_Union[ChatChoice, _Mapping]]] = ..., usage: _Optional[_Union[_engine_pb2.Usage, _Mapping]] = ...) -> None: ...

class DetokenizeRequest(_message.Message):
    __slots__ = ("token_ids", "skip_special_tokens", "spaces_between_special_tokens")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ...) -> None: ...

class DetokenizeResponse(_message.Message):
    __slots__ = ("text",)
    TEXT_FIELD_NUMBER: _ClassVar[int]
    text: str
    def __init__(self, text: _Optional[str] = ...) -> None: ...
