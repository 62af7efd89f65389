"""The engine's domain objects: resolved sampling options, requests, their choices, outputs.

Nothing here imports grpc: the servicer converts protos to these and back.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any, Callable


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass
class RawSamplingParams:
    """Sampling parameters as received; None means "absent" for the proto's optional fields."""

    max_tokens: int | None = None
    min_tokens: int = 0
    temperature: float | None = None
    top_p: float | None = None
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float | None = None
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    n: int | None = None
    logprobs: bool = False
    top_logprobs: int = 0


@dataclass(frozen=True)
class SamplingOptions:
    """Validated sampling options with every default applied."""

    max_tokens: int  # already capped by the context limit
    min_tokens: int = 0
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = disabled
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: frozenset[int] = frozenset()
    ignore_eos: bool = False
    n: int = 1

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


@dataclass
class GenerateInput:
    """A Generate call as the domain sees it, before validation."""

    request_id: str
    token_ids: list[int]
    sampling: RawSamplingParams
    # Modality names of the request's media items, in order (e.g. ["image"]).
    mm_modalities: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class ChoiceOutput:
    """New tokens of one choice since its previous output; the last one carries the finish."""

    index: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    matched_stop_token_id: int | None = None
    usage: Usage | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Sequence:
    """One choice of a request: its generated tokens, KV cache and random generator."""

    def __init__(self, index: int, generator: Any):
        self.index = index
        self.output_ids: list[int] = []
        self.cache: Any = None  # owned by the model runner (an HF DynamicCache in this phase)
        self.generator = generator
        self.finish_reason: FinishReason | None = None
        self.matched_stop_token_id: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def free(self) -> None:
        self.cache = None


class Request:
    """A validated request living in the engine; `deliver` receives its ChoiceOutputs."""

    def __init__(self, request_id: str, prompt_ids: list[int], options: SamplingOptions,
                 deliver: Callable[[ChoiceOutput | BaseException], None]):
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.options = options
        self.deliver = deliver
        self.sequences: list[Sequence] = []
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.failed = False  # ended by an engine error; never schedule it

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(seq.finished for seq in self.sequences)

    def unfinished(self) -> list[Sequence]:
        return [seq for seq in self.sequences if not seq.finished]

    def usage_for(self, seq: Sequence) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(seq.output_ids))
