"""The seam between the engine service and what runs the model.

Two backends implement it: `native` (engine.Engine, tito's own continuous batching) and `vllm`
(tito_engine.vllm.backend.VllmEngine, vLLM's AsyncLLM). The servicer admits every request (admission.py)
before it reaches either, so both refuse the same requests the same way; a backend only queues,
schedules, generates and reports.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Container
from dataclasses import dataclass
from typing import Protocol

from tito.errors import InvalidArgument, ResourceExhausted, Unavailable

from tito_engine.backend.admission import AdmittedRequest, KVCapacity
from tito_engine.multimodal.domain import EncoderCacheDescriptor
from tito_engine.multimodal.features import CheckedFeatures
from tito_engine.multimodal.specs import ModelMultimodalSpec
from tito_engine.kv_events import KvEventLog
from tito_engine.lora_types import LoraAdapterInfo
from tito_engine.model_info import ModelInfo
from tito_engine.request import ChoiceOutput

BACKENDS = ("native", "vllm")


@dataclass(frozen=True)
class LoadSnapshot:
    """GetLoad's answer (tito.v1.GetLoadResponse), whichever backend measured it."""

    running_requests: int
    waiting_requests: int
    finished_requests: int
    kv_blocks_total: int = 0
    kv_blocks_used: int = 0
    kv_block_size: int = 0
    prefix_cache_hit_tokens: int = 0
    encoder_cache_hits: int = 0
    encoder_cache_misses: int = 0
    encoded_items: int = 0  # media items the encoder ran on since start
    encoder_store_loads: int = 0  # media items loaded from the shared encoder store since start
    lora_adapters: tuple[LoraAdapterInfo, ...] = ()  # the LoRA adapters held, with the requests using each


class EngineBackend(Protocol):
    """What the servicer needs from an engine."""

    info: ModelInfo  # GetModelInfo, and the limits admission checks against
    mm_spec: ModelMultimodalSpec | None  # media the model accepts (None: text only)
    max_running_sequences: int  # most choices (sequences) advanced together
    max_loras: int  # LoRA adapters resident at once (0: the backend serves none; admission refuses lora_name)
    max_lora_rank: int
    kv_capacity: KVCapacity  # the whole KV cache: admission refuses what could never fit
    # The most encoder rows one media item may bring that the backend itself will schedule (vLLM's
    # encoder budget); None: no bound of its own beyond the context and the KV cache (native).
    media_item_rows_limit: int | None
    # Called (from any thread) when the model process died: the server turns health NOT_SERVING.
    on_core_lost: Callable[[], None] | None
    # Called (from any thread) when a new model process serves again: health turns SERVING.
    on_core_restored: Callable[[], None] | None
    # What the prefix cache stores, evicts and clears, in vLLM's event shapes (SubscribeKvEvents).
    kv_events: KvEventLog
    # True when KV moves between engines through vLLM's own connector (the vllm backend): a
    # request's kv_connector_params go to it; False: tito's transfers (backend/kv_transfers.py).
    kv_connector: bool
    # The connector vLLM's --kv-transfer-config configured (its "kv_connector"); "" when none was
    # (the engine then takes no part in a split) and for the native backend.
    kv_connector_name: str

    def start(self) -> None:
        """Start serving (the model is loaded by the constructor)."""

    def stop(self, timeout: float = 10.0) -> None:
        """Abort what is live and release the model."""

    def generate(self, request: AdmittedRequest) -> AsyncIterator[ChoiceOutput]:
        """Stream the request's outputs; closing the iterator early aborts the request.

        Raises a TitoError (before the first output) for what only the backend can refuse: a
        duplicate live request id, a full queue, a metadata-only item it does not hold.
        """

    async def encode(self, features: CheckedFeatures) -> list[EncoderCacheDescriptor]:
        """Encode admitted items into the encoder cache; one descriptor each."""

    def abort(self, request_ids: list[str]) -> list[str]:
        """Abort live requests by id (their streams end with ABORT); return the ids found."""

    def load(self) -> LoadSnapshot:
        """The current load."""

    async def reset_prefix_cache(self) -> None:
        """Empty the prefix cache (kv_events then holds an AllBlocksCleared)."""

    async def load_lora_adapter(self, name: str, path: str) -> LoraAdapterInfo:
        """Load a LoRA adapter from `path` (under the engine's --lora-dir) as `name`; a TitoError
        (LORA_*) for what cannot be."""

    async def unload_lora_adapter(self, name: str) -> int:
        """Forget adapter `name` (NOT_FOUND when not held); the requests that still finish with it."""

    async def list_lora_adapters(self) -> tuple[LoraAdapterInfo, ...]:
        """The adapters held."""


def check_can_accept(request_id: str, *, live: Container[str], waiting: int, max_waiting: int, core_lost: bool,
                     stopping: bool) -> None:
    """The refusals every backend makes at submission, in the same words: a dead model process,
    shutdown, a duplicate live id, a full waiting queue."""
    if core_lost:
        raise Unavailable("the engine's model process exited; retry shortly or on another replica",
                          reason="ENGINE_CORE_LOST")
    if stopping:
        raise Unavailable("the engine is shutting down; retry on another replica", reason="SHUTTING_DOWN")
    if request_id in live:
        raise InvalidArgument(f"request_id {request_id!r} is already live; ids must be unique among running "
                              f"requests", reason="DUPLICATE_REQUEST_ID", field="request_id")
    if waiting >= max_waiting:
        raise ResourceExhausted(f"the engine's waiting queue is full ({max_waiting} requests); retry later",
                                reason="QUEUE_FULL")
