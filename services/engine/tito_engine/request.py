"""The engine's domain objects: resolved sampling options, requests, their choices, outputs.

Nothing here imports grpc: the servicer converts protos to these and back.
"""

from __future__ import annotations

import enum
import functools
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:  # the shared types sit below the multimodal layer: the name is an annotation only
    from tito_engine.multimodal.domain import MediaItem


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"


@dataclass(frozen=True)
class LogitBias:
    """OpenAI's logit_bias, checked: `biases[i]` is added to the logit of `token_ids[i]` (ids
    ascending, each once). A value, so a request's options stay hashable and immutable."""

    token_ids: tuple[int, ...]
    biases: tuple[float, ...]

    @classmethod
    def from_mapping(cls, bias: dict[int, float]) -> "LogitBias | None":
        """The bias of a token id -> bias mapping; None for an empty one (no bias at all)."""
        if not bias:
            return None
        ordered = sorted(bias.items())
        return cls(tuple(token_id for token_id, _ in ordered), tuple(float(value) for _, value in ordered))

    def as_dict(self) -> dict[int, float]:
        return dict(zip(self.token_ids, self.biases))


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
    structured_output: Any = None  # constraints.StructuredOutputSpec or None
    logit_bias: dict[int, float] = field(default_factory=dict)  # token id -> bias, unchecked
    prior_output_tokens: int = 0  # request migration: the prompt's last ids are this choice's output


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
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logprobs: bool = False
    top_logprobs: int = 0  # alternatives per position (validation: needs logprobs)
    structured_output: Any = None  # constraints.StructuredOutputSpec (validated) or None
    logit_bias: LogitBias | None = None  # None: no bias
    # Request migration: the prompt's last `prior_output_tokens` ids are output an earlier engine
    # generated; seeded draws and presence/frequency penalties go on from there.
    prior_output_tokens: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def wants_logprobs(self) -> bool:
        return self.logprobs

    @functools.cached_property
    def plain_greedy(self) -> bool:
        """Argmax of the raw logits is the whole story (the sampler's fast path)."""
        return (self.greedy and not self.has_penalties and not self.wants_logprobs and self.min_tokens == 0
                and self.logit_bias is None)


@dataclass
class GenerateInput:
    """A Generate call as the domain sees it, before validation."""

    request_id: str
    token_ids: list[int]
    sampling: RawSamplingParams
    # Modality names of the request's media items, in order (e.g. ["image"]).
    mm_modalities: list[str] = field(default_factory=list)
    # The media items (made from the wire's mm_features at the servicer); admission checks them (features.py).
    mm_items: tuple[MediaItem, ...] = ()
    # Mixed into prefix-cache keys: requests only share cached prompt blocks with the same salt.
    cache_salt: str = ""
    # The LoRA adapter to generate with, by name ("" = the base model).
    lora_name: str = ""
    # Prefill/decode disaggregation: this request's part (kv_transfer.KvPrefill / KvDecode); None: both here.
    kv_transfer: Any = None
    # vLLM's kv_transfer_params as the caller sent them (a JSON object), for vLLM's own KV connector.
    kv_connector_params: dict | None = None


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_tokens: int = 0


@dataclass(frozen=True)
class RequestTimings:
    """When a request reached each phase, in time.monotonic() seconds (one clock for every process
    of a Linux machine, so the engine's core process and vLLM's can report them). The queue-time
    metric and the engine's trace spans (queue, prefill, decode) are derived from these."""

    arrival: float  # submitted to the engine
    scheduled: float | None  # first given a slot (None: never ran)
    first_token: float | None  # first token sampled
    finished: float  # last output


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float  # natural log, under the raw model distribution (before penalties/temperature/filters)
    rank: int  # 1-based among all tokens at the position


@dataclass(frozen=True)
class PositionLogprobs:
    sampled: TokenLogprob
    top: tuple[TokenLogprob, ...] = ()


@dataclass  # not frozen: one is built per token, and frozen dataclasses build ~3x slower
class ChoiceOutput:
    """New tokens of one choice since its previous output; the last one carries the finish."""

    index: int
    token_ids: tuple[int, ...]
    finish_reason: FinishReason | None = None
    matched_stop_token_id: int | None = None
    usage: Usage | None = None
    logprobs: tuple[PositionLogprobs, ...] = ()  # one per token id when requested
    timings: RequestTimings | None = None  # on the request's last output, when the backend knows them
    #: Prompt tokens the engine found in its prefix cache, on a choice's first output (None on the
    #: others): a face that ends a choice before the backend does (SMG's stop strings) reports it
    #: without the final usage.
    cached_tokens: int | None = None
    kv_pinned: Any = None  # kv_transfer.KvPinned, on a prefill request's last output
    kv_stats: Any = None  # kv_transfer.TransferStats, on a decode request's last output of choice 0
    kv_connector_params: dict | None = None  # vLLM's connector's answer, on the last output of choice 0

    def merged_with(self, later: "ChoiceOutput") -> "ChoiceOutput":
        """This output followed by `later` of the same choice, as one message."""
        return ChoiceOutput(self.index, self.token_ids + later.token_ids, later.finish_reason,
                            later.matched_stop_token_id, later.usage, self.logprobs + later.logprobs,
                            later.timings or self.timings,
                            cached_tokens=self.cached_tokens if self.cached_tokens is not None else later.cached_tokens,
                            kv_pinned=later.kv_pinned or self.kv_pinned, kv_stats=later.kv_stats or self.kv_stats,
                            kv_connector_params=later.kv_connector_params or self.kv_connector_params)

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


class Sequence:
    """One choice of a request: its generated tokens, its KV blocks and its random generator."""

    def __init__(self, index: int, generator: Any = None):
        self.index = index
        self.output_ids: list[int] = []
        self.block_table: list[int] = []  # KV block ids, owned (or shared after a fork)
        self.num_computed = 0  # tokens of prompt + output whose K/V are in the cache
        self.awaiting_fork = False  # a choice n > 1 that starts from choice 0's prefilled prompt
        self.generator = generator  # sampler.ChoiceGenerator for seeded requests, else None
        self.prompt_mask: Any = None  # lazily built by the sampler for repetition_penalty
        self.logit_bias: Any = None  # the options' LogitBias as (ids, biases) tensors, lazily built by the sampler
        self.matcher: Any = None  # the grammar matcher of a constrained choice (constraints.py)
        self.finish_reason: FinishReason | None = None
        self.matched_stop_token_id: int | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(eq=False)
class Submission:
    """The serving process's record of a request it sent to the engine core: where its outputs go.

    The core keeps its own `Request` (choices, blocks, timings); the two share only the key the
    server assigned and the request id."""

    request_id: str
    key: int
    choices: int  # the request's n: its stream ends after this many finished choices
    deliver: Callable[[ChoiceOutput | BaseException], None]
    # When set (an asyncio loop), the engine batches this request's deliveries with others of the
    # same loop into one call_soon_threadsafe per step.
    loop: Any = None


class Request:
    """A validated request in the engine core (the scheduler's unit): its choices, their KV blocks,
    its timings."""

    def __init__(self, request_id: str, prompt_ids: list[int], options: SamplingOptions, mm: Any = None):
        # Outputs leave the core in step batches (core/messages.py StepBatch); the serving side's
        # Submission holds the stream that receives them.
        self.request_id = request_id
        self.prompt_ids = prompt_ids
        self.options = options
        self.mm = mm  # forward.MultiModalPrefill for multimodal prompts (attached by the core after encoding)
        self.has_media = mm is not None  # media items: in the prefix cache only with prefix_media
        # The media items as the prefix cache keys them (blocks.BlockMedia, one per item, in prompt
        # order), set by the core from the admitted items; None for a media request: kept out.
        self.prefix_media: tuple[Any, ...] | None = None
        self.sequences: list[Sequence] = []
        self.fork_blocks: list[int] = []  # blocks reserved for the choices' copies of the partial block
        self.admit_order = -1
        self.key = -1  # the engine's id of this submission (request ids may be reused later)
        self.cache_salt = ""
        # The LoRA adapter (empty: the base model): its name (KV events), the key its prefix-cache
        # blocks are chained under (name and weights' fingerprint), and its slot in the model.
        self.lora_name = ""
        self.lora_key = ""
        self.lora_slot = 0
        self.block_hashes: list[bytes] | None = None  # prefix-cache digests of the prompt's full blocks
        self.block_keys: list[Any] = []  # kv_events.BlockKeys per full block: what events publish
        self.cached_tokens = 0  # prompt tokens whose K/V came from the prefix cache (first admission)
        self.is_running = False  # in the scheduler's running set
        self.preemptions = 0
        self.arrival_time = time.monotonic()
        self.scheduled_time: float | None = None
        self.first_token_time: float | None = None
        self.finish_time: float | None = None
        self.failed = False  # ended by an engine error; never schedule it
        self.grammar: Any = None  # compiled structured-output grammar (constraints.py), set before queueing
        # Prefill/decode (kv_transfer.py): a prefill request's pin order (its blocks are pinned,
        # not freed, when it finishes: `pinned`), or a decode request's pulled blocks.
        self.kv_pin: Any = None  # kv_transfer.KvPinOrder
        self.pinned: Any = None  # kv_pins.Pin, once pinned
        self.imported_kv: Any = None  # kv_transfer.ImportedKv, until written into its blocks
        # A media prompt decoded from pulled KV skips the encoder; its items wait here in case it
        # must recompute after all (preempted: `awaiting_media_rows` until the core encodes them).
        self.media_unencoded: Any = None  # multimodal.items.ValidatedFeatures
        self.awaiting_media_rows = False

    @property
    def finished(self) -> bool:
        return bool(self.sequences) and all(seq.finished for seq in self.sequences)

    def unfinished(self) -> list[Sequence]:
        return [seq for seq in self.sequences if not seq.finished]

    def timings(self) -> RequestTimings:
        return RequestTimings(self.arrival_time, self.scheduled_time, self.first_token_time,
                              self.finish_time or time.monotonic())

    @property
    def prior_output_ids(self) -> list[int]:
        """A migrated choice's earlier output: the prompt's last `prior_output_tokens` ids."""
        prior = self.options.prior_output_tokens
        return self.prompt_ids[len(self.prompt_ids) - prior:] if prior else []

    def usage_for(self, seq: Sequence) -> Usage:
        return Usage(prompt_tokens=len(self.prompt_ids), completion_tokens=len(seq.output_ids),
                     cached_tokens=self.cached_tokens)
