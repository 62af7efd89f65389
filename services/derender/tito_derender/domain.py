"""Derender's domain vocabulary: what a request expects, what the engine sent, what we emit.

Plain dataclasses (no protobuf, no grpc), built by `convert.py` at the edge.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field

from tito_derender.detokenizer import TextOptions


class FinishReason(str, enum.Enum):
    """Why a choice ended (the OpenAI strings)."""

    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    TOOL_CALLS = "tool_calls"


class ToolChoiceMode(str, enum.Enum):
    """How the model may use tools (the contract's ToolChoice, UNSPECIFIED already resolved)."""

    AUTO = "auto"
    NONE = "none"
    REQUIRED = "required"
    NAMED = "named"  # one function, named in RequestContext.tool_choice_function


@dataclass(frozen=True)
class RequestContext:
    """Everything derender knows about one request (from DerenderContext)."""

    request_id: str = ""
    prompt_tail_token_ids: tuple[int, ...] = ()
    prompt_tokens: int = 0
    text: TextOptions = TextOptions()
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    reasoning_parser: str = ""
    tool_parser: str = ""
    #: Names of the functions offered to the model.
    tool_names: tuple[str, ...] = ()
    #: (name, JSON-schema parameters) of the offered functions, for the parsers that read
    #: them (SCHEMA_READING_TOOL_PARSERS); empty for the others.
    tool_schemas: tuple[tuple[str, dict], ...] = ()
    tool_choice: ToolChoiceMode = ToolChoiceMode.NONE
    tool_choice_function: str = ""
    thinking_enabled: bool = False
    prompt_opens_reasoning: bool = False
    n: int = 1
    logprobs: bool = False
    #: Every chunk carries usage (a choice's other chunks: the prompt and its tokens so far).
    usage_in_every_chunk: bool = False


@dataclass(frozen=True)
class EngineUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class TokenLogprob:
    """One token with its log-probability, as the engine reports it (ids only)."""

    token_id: int
    logprob: float
    rank: int = 0


@dataclass(frozen=True)
class PositionLogprobs:
    """The engine's logprobs at one generated position: the sampled token and the top ones."""

    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass(frozen=True)
class EngineOutput:
    """One GenerateResponse: the new tokens of one choice since its previous message."""

    index: int
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    matched_stop_token_id: int | None = None
    usage: EngineUsage | None = None
    #: Empty, or one entry per token id.
    logprobs: tuple[PositionLogprobs, ...] = ()


@dataclass(frozen=True)
class TopLogprobText:
    token: str
    token_id: int
    logprob: float
    bytes: bytes


@dataclass(frozen=True)
class TokenLogprobText:
    """A position's logprobs with text: `token` is the token decoded on its own, `bytes` its
    raw bytes (a partial UTF-8 character for byte tokens)."""

    token: str
    token_id: int
    logprob: float
    bytes: bytes
    top_logprobs: tuple[TopLogprobText, ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    """A streamed piece of one tool call (the OpenAI shape): the first delta of a call has the
    id, type and name; later ones only the index and an argument fragment."""

    index: int
    id: str = ""
    type: str = ""
    name: str = ""
    arguments: str = ""


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass
class OutputDelta:
    """What one step of a choice's pipeline produced. Stages (stop strings, reasoning and tool
    parsers) take one and return one, so each can move text between the fields or end the choice."""

    content: str = ""
    reasoning_content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def is_empty(self) -> bool:
        return not (self.content or self.reasoning_content or self.tool_calls)


@dataclass(frozen=True)
class Chunk:
    """One OpenAI-style chat chunk for one choice."""

    index: int
    role: str = ""
    content: str = ""
    reasoning_content: str = ""
    tool_calls: tuple = ()
    finish_reason: FinishReason | None = None
    matched_stop: str = ""
    usage: Usage | None = None
    cancel_generation: bool = False
    logprobs: tuple[TokenLogprobText, ...] = ()
