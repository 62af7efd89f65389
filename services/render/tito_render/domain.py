"""Render's vocabulary as plain dataclasses: what a request asks (`ChatRequest`,
`CompletionRequest`, `TokenizeRequest` and their parts) and what rendering produces (the prompt's
ids, its media items and what the engine and derender need besides: `RenderedPrompt`).

convert.py builds the requests from the wire messages and turns a `RenderedPrompt` into the
response at the servicer; nothing below it reads or builds a message, so the domain is tested with
these values alone. The request types keep what the wire can say and a check needs: presence
(None: the field was not set), unknown enum numbers (refused by the domain, naming the field) and
JSON objects (`JsonObject`) as they came, unchecked.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

from tito.media_parts import Placeholder, RawTensor
from tito.structured_output import StructuredOutputSpec

#: A `google.protobuf.Struct` as plain values, unchecked: every number a float (NaN and the
#: infinities included), null as None. messages.request_struct checks it and gives the template
#: its JSON (integral numbers as ints, keys sorted), naming the request's field when it cannot.
JsonObject = dict[str, Any]


class Modality(enum.IntEnum):
    """A media item's kind: the contract's `tito.v1.Modality` numbers."""

    UNSPECIFIED = 0
    IMAGE = 1
    VIDEO = 2
    AUDIO = 3


class MmPayload(enum.IntEnum):
    """What each media item carries to the engine: the contract's `tito.v1.MmPayload` numbers."""

    UNSPECIFIED = 0
    TENSORS = 1
    METADATA = 2
    NONE = 3


class ToolChoiceMode(enum.IntEnum):
    """The contract's `tito.v1.ToolChoiceMode` numbers."""

    UNSPECIFIED = 0
    AUTO = 1
    NONE = 2
    REQUIRED = 3


# ------------------------------------------------------------------------------------ requests


@dataclass(frozen=True, slots=True)
class ImageSource:
    """Where one image comes from: `url` or `data` (the one the request set; neither: empty)."""

    url: str | None = None
    data: bytes | None = None


@dataclass(frozen=True, slots=True)
class TextPart:
    KIND: ClassVar[str] = "text"  # the part's name in the request's field paths
    text: str


@dataclass(frozen=True, slots=True)
class ImagePart:
    KIND: ClassVar[str] = "image"
    source: ImageSource


@dataclass(frozen=True, slots=True)
class VideoPart:
    KIND: ClassVar[str] = "video"
    frames: tuple[ImageSource, ...]
    fps: float = 0.0


@dataclass(frozen=True, slots=True)
class EmptyPart:
    """A content part that sets none of text, image and video (refused, naming it)."""


ContentPart = TextPart | ImagePart | VideoPart | EmptyPart


@dataclass(frozen=True, slots=True)
class FunctionCall:
    """A past tool call's function: its arguments as JSON text or as an object (or neither)."""

    name: str = ""
    arguments: str | None = None
    arguments_object: JsonObject | None = None


@dataclass(frozen=True, slots=True)
class ToolCall:
    id: str = ""
    type: str = ""
    function: FunctionCall = FunctionCall()


@dataclass(frozen=True, slots=True)
class ChatMessage:
    role: str
    content: str | None = None
    content_parts: tuple[ContentPart, ...] = ()
    name: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    reasoning_content: str | None = None


@dataclass(frozen=True, slots=True)
class FunctionDefinition:
    name: str = ""
    description: str = ""
    parameters: JsonObject | None = None
    strict: bool | None = None


@dataclass(frozen=True, slots=True)
class Tool:
    type: str = ""
    function: FunctionDefinition = FunctionDefinition()


@dataclass(frozen=True, slots=True)
class ToolChoice:
    """A mode (a `ToolChoiceMode` number; an unknown one is kept to be refused) or, when
    `function_name` is not None, that one function."""

    mode: int = ToolChoiceMode.UNSPECIFIED
    function_name: str | None = None


@dataclass(frozen=True, slots=True)
class SamplingOptions:
    """The client's sampling options; None: not set (render resolves a default)."""

    max_tokens: int | None = None
    min_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool | None = None
    n: int | None = None
    logprobs: bool | None = None
    top_logprobs: int | None = None
    include_stop_str_in_output: bool | None = None
    skip_special_tokens: bool | None = None
    spaces_between_special_tokens: bool | None = None
    structured_output: StructuredOutputSpec | None = None
    logit_bias: Mapping[int, float] = field(default_factory=dict)


@dataclass(frozen=True, slots=True)
class MediaOptions:
    min_pixels: int | None = None
    max_pixels: int | None = None
    processor_kwargs: JsonObject | None = None


@dataclass(frozen=True, slots=True)
class JsonSchemaFormat:
    """response_format.json_schema: render reads only the schema (None: not sent)."""

    schema: JsonObject | None = None


@dataclass(frozen=True, slots=True)
class ResponseFormat:
    """OpenAI's response_format (`json_schema` None: not sent)."""

    type: str = ""
    json_schema: JsonSchemaFormat | None = None


@dataclass(frozen=True, slots=True)
class ChatRequest:
    """A RenderChat request."""

    messages: tuple[ChatMessage, ...] = ()
    request_id: str = ""
    tools: tuple[Tool, ...] = ()
    tool_choice: ToolChoice = ToolChoice()
    chat_template: str | None = None
    chat_template_kwargs: JsonObject | None = None
    add_generation_prompt: bool | None = None
    continue_final_message: bool = False
    sampling: SamplingOptions = SamplingOptions()
    mm_payload: int = MmPayload.UNSPECIFIED  # an unknown number is kept to be refused
    media_options: MediaOptions = MediaOptions()
    cache_salt: str = ""
    return_prompt_text: bool = False
    response_format: ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    usage_in_every_chunk: bool = False
    lora_name: str = ""  # the LoRA adapter the engine generates with ("" = the base model)


@dataclass(frozen=True, slots=True)
class CompletionRequest:
    """A RenderCompletion request: `prompt` (None: not set) or `prompt_token_ids`."""

    prompt: str | None = None
    prompt_token_ids: tuple[int, ...] = ()
    request_id: str = ""
    add_special_tokens: bool | None = None
    sampling: SamplingOptions = SamplingOptions()
    cache_salt: str = ""
    usage_in_every_chunk: bool = False
    lora_name: str = ""  # the LoRA adapter the engine generates with ("" = the base model)


@dataclass(frozen=True, slots=True)
class TokenizeRequest:
    text: str = ""
    add_special_tokens: bool = False
    return_token_strings: bool = False


# ------------------------------------------------------------------------------------- results


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media item for the engine (a `tito.v1.MultiModalItem`), signed when render has a key.

    The fields the tag covers are the wire's (tito.signing computes its canonical bytes from field
    values), so the tag made here verifies on the message convert.py builds."""

    modality: int  # a Modality number
    mm_hash: str
    placeholder: Placeholder
    kwargs: Mapping[str, RawTensor] = field(default_factory=dict)
    metadata: Mapping[str, RawTensor] = field(default_factory=dict)
    auth_tag: bytes = b""
    auth_key_id: str = ""
    # Render never attaches an EC descriptor (an engine's Encode answers with one); tito.signing reads it.
    ec_descriptor: None = None


@dataclass(frozen=True, slots=True)
class TextOptions:
    """What derender applies to the text (`tito.v1.OutputTextOptions`), every default explicit."""

    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = False


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """The resolved sampling parameters (`tito.v1.SamplingParams`): every value written out, so
    the engine never guesses; only `seed` may be absent (None)."""

    max_tokens: int
    min_tokens: int
    temperature: float
    top_p: float
    top_k: int
    min_p: float
    presence_penalty: float
    frequency_penalty: float
    repetition_penalty: float
    stop_token_ids: tuple[int, ...]
    ignore_eos: bool
    n: int
    logprobs: bool
    top_logprobs: int
    text_options: TextOptions
    seed: int | None = None
    # The checked constraint (structured.py), None: unconstrained.
    structured_output: StructuredOutputSpec | None = None
    # OpenAI's logit_bias, checked: (token id, bias) pairs in id order; empty: no bias.
    logit_bias: tuple[tuple[int, float], ...] = ()


@dataclass
class RenderedPrompt:
    """A rendered chat or completion: the engine's GenerateRequest and derender's context, as values."""

    request_id: str
    token_ids: list[int]
    sampling: SamplingParams
    cache_salt: str
    reasoning_parser: str
    tool_parser: str
    items: Sequence[MediaItem] = ()
    # Chat only: the resolved tool choice (None: a completion, which offers no tools). The tool
    # definitions reach derender as the request sent them: convert.py copies them across.
    tool_choice: ToolChoice | None = None
    thinking_enabled: bool = False
    prompt_opens_reasoning: bool = False
    prompt_text: str | None = None  # the templated text, when the request asked for it
    usage_in_every_chunk: bool = False  # derender's chunks all carry usage (the request asked for it)
    lora_name: str = ""  # the LoRA adapter the request names, for the engine ("" = the base model)


@dataclass(frozen=True, slots=True)
class Tokens:
    """A Tokenize answer: the ids, and their vocabulary strings when asked for."""

    token_ids: list[int]
    token_strings: list[str] | None = None
