"""The two seams of the native backend, as Protocols (what each side may rely on, nothing more).

- `CoreRunner`: what an `EngineCore` drives. The native model runner
  (`tito_engine.model.runner.ModelRunner`) is one; unit tests drive the core with fakes.
- `CoreHost`: where an `EngineCore` runs, as `Engine` talks to it: a thread of this process
  (`ThreadCore`) or a child process (`ProcessCore`). Commands go in with `send`, each step's outputs
  come back through `on_batch`, and `on_lost` says the host died (only a child process can).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

from tito_engine.core.messages import Command, StepBatch
from tito_engine.model_info import ModelInfo
from tito_engine.multimodal.specs import ModelMultimodalSpec
from tito_engine.scheduling.blocks import KVBlocks
from tito_engine.scheduling.plan import SampledTokens, StepPlan
from tito_engine.scheduling.scheduler import ChoiceState


class CoreRunner(Protocol):
    """The model side of an engine core: its identity and KV storage, one step's execution, and
    (for vision models; `mm_spec` None otherwise) the encoder and a prompt's media prefill."""

    info: ModelInfo
    cache: KVBlocks
    choice_state: ChoiceState
    mm_spec: ModelMultimodalSpec | None

    def run(self, plan: StepPlan) -> SampledTokens:
        """Execute one step's plan (forward and sampling)."""

    def encode(self, items: list) -> list:
        """Encoder outputs of media items, one tensor per item."""

    def multimodal_prefill(self, token_ids: list[int], items_with_rows: list) -> Any:
        """What a prompt's prefill needs of its media: rows per placeholder and positions."""

    def multimodal_positions(self, token_ids: list[int], items: list) -> Any:
        """The same without encoder rows (a prompt whose KV was computed on another engine)."""


class CoreHost(Protocol):
    """An engine core, hosted: the model's description, its KV geometry, and a command pipe."""

    info: ModelInfo
    mm_spec: ModelMultimodalSpec | None
    kv_blocks_total: int
    block_size: int
    max_loras: int  # LoRA adapter slots (0: no adapters)
    max_lora_rank: int

    def start(self, on_batch: Callable[[StepBatch], None], on_lost: Callable[[], None] | None = None) -> None:
        """Begin running; `on_batch` receives every step's outputs, `on_lost` the host's death."""

    def send(self, command: Command) -> None:
        """Hand the core a command (never blocks on the core's step)."""

    def stop(self, timeout: float) -> None:
        """Stop the core (its live requests are aborted) within about `timeout` seconds."""
