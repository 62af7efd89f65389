"""Many LoRA adapters in one batched forward: the resident adapters' weights stacked in slots, and
the linears that add each token's adapter.

Slot 0 is the base model; slots 1..max_loras hold resident adapters. For each layer and each of
the forward's fused linears (qkv, o, gate_up, down: families.py fuses q/k/v and gate/up), the
slots' A matrices are stacked into one `[slots, parts x max_rank, in]` tensor and their B
matrices into `[slots, out, parts x max_rank]`, B block-diagonal over the fused parts (q's rows
read q's rank columns only) and pre-multiplied by the adapter's scaling. An adapter of a smaller
rank, or one that leaves a module out, leaves zeros there, which add nothing.

A step's rows may use different adapters and the base model at once. Before the forward, the
runner groups the step's packed tokens by slot (`LoraSlots.begin_step`); each `LoraLinear` then
runs its base linear once over every token, as without adapters, and adds `(x A^T) B^T` to the
tokens of each adapter present in the step, one pair of small matmuls per adapter (a segmented
matmul): never a forward per adapter. Base-model tokens are never touched, so their results are
the same bits as in an engine without adapters, and a step with no adapter rows skips the whole
add (one attribute read per linear).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tito_engine.model.lora_files import BaseShapes, LoraAdapter, read_adapter
from tito_engine.scheduling.plan import RowInput

#: The forward's fused linears and the PEFT modules each one holds, in their row order.
FUSED_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}


class LoraStep:
    """The adapters of the step being run: (slot, packed token indices or None for every token)
    per adapter present; empty when every row uses the base model."""

    __slots__ = ("segments",)

    def __init__(self):
        self.segments: tuple[tuple[int, torch.Tensor | None], ...] = ()


class LoraLinear:
    """A fused linear plus the adapters of the step's tokens (see the module docstring)."""

    __slots__ = ("base", "a", "b", "step")

    def __init__(self, base: Any, a: torch.Tensor, b: torch.Tensor, step: LoraStep):
        self.base, self.a, self.b, self.step = base, a, b, step

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for slot, rows in self.step.segments:
            if rows is None:  # every token of the step uses this adapter
                y += (x @ self.a[slot].T) @ self.b[slot].T
            else:
                y.index_add_(0, rows, (x.index_select(0, rows) @ self.a[slot].T) @ self.b[slot].T)
        return y


@dataclass(frozen=True)
class _FusedLayout:
    """Where each PEFT module sits in a fused linear: its output rows and its rank columns."""

    out_ranges: dict[str, tuple[int, int]]
    parts: tuple[str, ...]


class LoraSlots:
    """The adapter slots of one loaded model (installed into its decoder's layers)."""

    def __init__(self, decoder: Any, max_loras: int, max_rank: int):
        family = decoder.family
        self.max_loras, self.max_rank = max_loras, max_rank
        self.dtype, self.device = decoder.dtype, decoder.device
        self.step = LoraStep()
        first = family.layers[0]
        heads, kv_heads, head_dim = family.num_heads, family.num_kv_heads, family.head_dim
        hidden, inter = first.qkv.shape[1], first.intermediate
        q, kv = heads * head_dim, kv_heads * head_dim
        self.shapes = BaseShapes(len(family.layers), {
            "q_proj": (q, hidden), "k_proj": (kv, hidden), "v_proj": (kv, hidden), "o_proj": (hidden, q),
            "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)})
        self._layouts = {name: _layout(parts, self.shapes) for name, parts in FUSED_TARGETS.items()}
        # Per layer, per fused linear: (A [slots, parts * rank, in], B [slots, out, parts * rank]).
        self._stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        slots = max_loras + 1
        for layer in family.layers:
            stacks = {}
            for name, layout in self._layouts.items():
                base = getattr(layer, name)
                out_features, in_features = base.shape
                width = len(layout.parts) * max_rank
                a = torch.zeros(slots, width, in_features, dtype=self.dtype, device=self.device)
                b = torch.zeros(slots, out_features, width, dtype=self.dtype, device=self.device)
                stacks[name] = (a, b)
                setattr(layer, name, LoraLinear(base, a, b, self.step))
            self._stacks.append(stacks)

    def read(self, directory: Path) -> LoraAdapter:
        """A checked adapter from its directory (lora_files.read_adapter against this model)."""
        return read_adapter(directory, self.shapes, self.max_rank, self.dtype)

    @torch.inference_mode()
    def write(self, slot: int, adapter: LoraAdapter) -> None:
        """Put `adapter` in `slot` (1..max_loras), replacing what was there."""
        self.clear(slot)
        rank = adapter.rank
        for (layer, module), (a, b) in adapter.weights.items():
            name = next(name for name, parts in FUSED_TARGETS.items() if module in parts)
            layout = self._layouts[name]
            stack_a, stack_b = self._stacks[layer][name]
            column = layout.parts.index(module) * self.max_rank
            start, end = layout.out_ranges[module]
            stack_a[slot, column:column + rank] = a.to(self.device)
            stack_b[slot, start:end, column:column + rank] = (b.float() * adapter.scaling).to(self.device, self.dtype)

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        """Zero `slot`, so that nothing of a former adapter is left in it."""
        if not 1 <= slot <= self.max_loras:
            raise ValueError(f"slot {slot} is not an adapter slot (1..{self.max_loras})")
        for stacks in self._stacks:
            for a, b in stacks.values():
                a[slot].zero_()
                b[slot].zero_()

    def begin_step(self, rows: list[RowInput]) -> None:
        """Group the step's packed tokens by their row's adapter slot (the forward packs the rows'
        tokens in order)."""
        ranges: dict[int, list[tuple[int, int]]] = {}
        offset = 0
        for row in rows:
            count = len(row.token_ids)
            if row.lora_slot:
                ranges.setdefault(row.lora_slot, []).append((offset, offset + count))
            offset += count
        if not ranges:
            self.step.segments = ()
            return
        segments = []
        for slot, spans in ranges.items():
            if len(spans) == 1 and spans[0] == (0, offset):
                segments.append((slot, None))
                continue
            index = [position for start, end in spans for position in range(start, end)]
            segments.append((slot, torch.tensor(index, dtype=torch.long, device=self.device)))
        self.step.segments = tuple(segments)

    def end_step(self) -> None:
        self.step.segments = ()


def _layout(parts: tuple[str, ...], shapes: BaseShapes) -> _FusedLayout:
    ranges, start = {}, 0
    for module in parts:
        out_features = shapes.features[module][0]
        ranges[module] = (start, start + out_features)
        start += out_features
    return _FusedLayout(ranges, parts)
