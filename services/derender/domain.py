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
    thinking_enabled: bool = False
    prompt_opens_reasoning: bool = False
    n: int = 1
    logprobs: bool = False


@dataclass(frozen=True)
class EngineUsage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class EngineOutput:
    """One GenerateResponse: the new tokens of one choice since its previous message."""

    index: int
    token_ids: tuple[int, ...] = ()
    finish_reason: FinishReason | None = None
    matched_stop_token_id: int | None = None
    usage: EngineUsage | None = None


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
    tool_calls: list = field(default_factory=list)

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
