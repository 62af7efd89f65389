"""What rendering produces, as plain dataclasses: the prompt's ids, its media items and what the
engine and derender need besides. convert.py turns a `RenderedPrompt` into the RenderChat /
RenderCompletion response at the servicer; nothing here builds a response message.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from tito.media_parts import Placeholder, RawTensor
from tito.v1 import chat_pb2, sampling_pb2


@dataclass(frozen=True, slots=True)
class MediaItem:
    """One media item for the engine (a `tito.v1.MultiModalItem`), signed when render has a key.

    The fields the tag covers are the wire's (tito.signing computes its canonical bytes from field
    values), so the tag made here verifies on the message convert.py builds."""

    modality: int  # tito.v1.Modality number
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
    # The checked constraint (structured.py builds the contract's message), None: unconstrained.
    structured_output: sampling_pb2.StructuredOutput | None = None
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
    # Chat only: the request's tool definitions and resolved tool choice, passed through to
    # derender as they came (None: a completion, which offers no tools).
    tools: Sequence[chat_pb2.Tool] = ()
    tool_choice: chat_pb2.ToolChoice | None = None
    thinking_enabled: bool = False
    prompt_opens_reasoning: bool = False
    prompt_text: str | None = None  # the templated text, when the request asked for it
    usage_in_every_chunk: bool = False  # derender's chunks all carry usage (the request asked for it)


@dataclass(frozen=True, slots=True)
class Tokens:
    """A Tokenize answer: the ids, and their vocabulary strings when asked for."""

    token_ids: list[int]
    token_strings: list[str] | None = None
