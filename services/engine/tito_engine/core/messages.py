"""What crosses the pipe between the engine server and its core: one frozen dataclass per kind.

The core dispatches commands by type (`match`), the server dispatches what comes back the same
way, so neither side unpacks tuples by position. Every class pickles (the core may run in a child
process); domain errors travel inside outputs as themselves (tito.errors pickles whole).

Server -> core: `AddRequest`, `AbortRequest`, `EncodeItems`, `ResetPrefixCache`, `LoadLora`,
`UnloadLora`, `ListLoras`, `ExportKv`, `PeekPrefix`, `StopCore`.
Core -> server: `CoreReady` or `CoreFailed` once at start-up (child process only), then one
`StepBatch` per step or per batch of commands that produced outputs, and `CoreStopped` last.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from tito_engine.kv_events import KvEvent
from tito_engine.kv_transfer import KvExport  # noqa: F401 - ExportKv's answer, with the transfer's types
from tito_engine.multimodal.domain import EncoderCacheDescriptor
from tito_engine.multimodal.features import CheckedFeatures
from tito_engine.lora_types import LoraAdapterInfo
from tito_engine.model_info import ModelInfo
from tito_engine.multimodal.specs import ModelMultimodalSpec
from tito_engine.request import SamplingOptions


@dataclass(frozen=True, slots=True)
class AddRequest:
    """Schedule a request. Keys are integers the server assigns per submission, so a late abort
    never hits a reused request id."""

    key: int
    request_id: str
    prompt_ids: list[int]
    options: SamplingOptions
    #: Phase 1 of media admission (done in the server); phase 2 (the encoder cache) runs at add.
    features: CheckedFeatures | None
    #: time.monotonic() at submission: one clock for both processes on Linux, so queue time and
    #: TTFT include the trip to the core.
    arrival_time: float
    cache_salt: str | None
    lora_name: str = ""  # the LoRA adapter ("" = the base model); the core's registry resolves it
    kv_pin: Any = None  # kv_transfer.KvPinOrder: a prefill request, whose prompt blocks are pinned at its end
    kv_import: Any = None  # kv_transfer.ImportedKv: a decode request's pulled prompt blocks


@dataclass(frozen=True, slots=True)
class AbortRequest:
    """Stop a request (it may not have arrived yet: the core remembers a bounded few)."""

    key: int


@dataclass(frozen=True, slots=True)
class EncodeItems:
    """The Encode RPC: encode admitted items into the encoder cache; answered under `key`."""

    key: int
    features: CheckedFeatures


@dataclass(frozen=True, slots=True)
class ResetPrefixCache:
    """Empty the prefix cache (the ResetPrefixCache RPC); answered under `key` with PrefixCacheReset."""

    key: int


@dataclass(frozen=True, slots=True)
class PrefixCacheReset:
    """The answer to ResetPrefixCache: the cache is empty (the AllBlocksCleared event is in the same batch)."""


@dataclass(frozen=True, slots=True)
class LoadLora:
    """LoadLoraAdapter: hold the adapter in `path` (under --lora-dir) as `name`; answered under
    `key` with LoraAdapters (the loaded one) or the refusal."""

    key: int
    name: str
    path: str


@dataclass(frozen=True, slots=True)
class UnloadLora:
    """UnloadLoraAdapter: forget `name` once its requests end; answered with LoraUnloaded."""

    key: int
    name: str


@dataclass(frozen=True, slots=True)
class ListLoras:
    """ListLoraAdapters: answered under `key` with LoraAdapters."""

    key: int


@dataclass(frozen=True, slots=True)
class LoraAdapters:
    """Adapters the core holds (for LoadLora: the one loaded)."""

    adapters: tuple[LoraAdapterInfo, ...]


@dataclass(frozen=True, slots=True)
class LoraUnloaded:
    """The answer to UnloadLora: requests still using the adapter."""

    active_requests: int


@dataclass(frozen=True, slots=True)
class ExportKv:
    """PullKvBlocks: hand out the blocks pinned under `transfer_id` from `first_block` on, once
    (the pin is released); answered under `key` with KvExport or the refusal."""

    key: int
    transfer_id: str
    first_block: int
    block_count: int  # what the handle says: checked against the pin
    num_tokens: int


@dataclass(frozen=True, slots=True)
class PeekPrefix:
    """A decode request's text prompt as the prefix cache keys it (its salt and its adapter, ""
    for the base model): answered under `key` with PrefixPeek, the leading blocks the prefix
    cache holds."""

    key: int
    prompt_ids: list[int]
    cache_salt: str
    lora_name: str = ""


@dataclass(frozen=True, slots=True)
class PrefixPeek:
    """The answer to PeekPrefix."""

    cached_blocks: int


@dataclass(frozen=True, slots=True)
class StopCore:
    """Abort everything in flight, answer with a last batch, and exit the loop."""


Command = (AddRequest | AbortRequest | EncodeItems | ResetPrefixCache | LoadLora | UnloadLora | ListLoras | ExportKv
           | PeekPrefix | StopCore)


@dataclass(frozen=True, slots=True)
class EncodeResult:
    """The Encode RPC's answer: one descriptor per item (the servicer makes the messages)."""

    descriptors: tuple[EncoderCacheDescriptor, ...]


@dataclass(frozen=True, slots=True)
class CoreLoad:
    """The core's counters after a step (GetLoad's source)."""

    running_requests: int
    waiting_requests: int
    finished_requests: int
    kv_blocks_used: int
    adds_seen: int  # AddRequests taken so far: the server counts the rest as waiting
    prefix_cache_hit_tokens: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    encoded_items: int = 0  # media items the encoder ran on
    encoder_store_loads: int = 0  # media items loaded from the shared encoder store
    lora_adapters: tuple[LoraAdapterInfo, ...] = ()  # the adapters held, with their requests


@dataclass(frozen=True, slots=True)
class StepBatch:
    """One step's outputs and the load after it.

    `outputs` holds (key, output, request_finished) triples, where output is a ChoiceOutput, an
    EncodeResult, a TitoError (the caller's mistake, found in the core) or an EngineStepError (a
    bug). Triples rather than objects: a step at concurrency 32 carries 32 of them, and pickling
    tuples costs a fraction of pickling instances."""

    outputs: list[tuple[int, Any, bool]]
    load: CoreLoad
    #: What the prefix cache stored, evicted and cleared in this step (kv_events, in order), and
    #: when (time.time() at the step's end).
    kv_events: tuple[KvEvent, ...] = ()
    timestamp: float = 0.0


@dataclass(frozen=True, slots=True)
class CoreReady:
    """The child process loaded the model: what the server needs to describe it and plan KV."""

    info: ModelInfo
    kv_blocks_total: int
    block_size: int
    mm_spec: ModelMultimodalSpec | None


@dataclass(frozen=True, slots=True)
class CoreFailed:
    """The child process could not start; `reason` is one line for the operator. `config_error`:
    the reason is a ConfigError's, which already names the flag or file to fix (passed on as is)."""

    reason: str
    config_error: bool = False


@dataclass(frozen=True, slots=True)
class CoreStopped:
    """The core loop has ended after a StopCore."""
