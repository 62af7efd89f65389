"""Many LoRA adapters in one batched forward: the resident adapters' weights stacked in slots, and
the linears that add each token's adapter.

Slot 0 is the base model; slots 1..max_loras hold resident adapters. For each layer and each of
the forward's fused linears (qkv, o, gate_up, down: families.py fuses q/k/v and gate/up), the
slots' A matrices are stacked into one `[slots, W, in]` tensor and their B matrices, transposed,
into `[slots, W, out]`, where W = parts x max_rank: B is block-diagonal over the fused parts (q's
outputs read q's rank columns only) and pre-multiplied by the adapter's scaling. An adapter of a
smaller rank, or one that leaves a module out, leaves zeros there, which add nothing.

A step's rows may use different adapters and the base model at once. Before the forward, the
runner groups the step's packed tokens by their row's slot (`LoraSlots.begin_step`); each
`LoraLinear` runs its base linear once over every token, exactly as without adapters, then adds
`(x A^T) B` to each adapter's tokens with that slot's matrices, never a forward per adapter. When
the adapters' token groups are close in size (decode rows spread over the adapters), the groups
are padded to one width and the add is one gather, two batched matmuls over the slots' stacks and
one scatter-add (`BatchedAdapters`); otherwise (a long prefill beside a few decode tokens) it is
one small matmul pair per adapter present in the step (a segmented matmul). Base-model tokens are never
written (the add goes to the adapter tokens' rows only), so their results are the same bits as in
an engine without adapters, and a step with no adapter rows skips the add entirely (one attribute
read per linear).

One masked product against every slot at once (four tensor operations per linear whatever the
number of adapters) was measured against this and lost: on CPU a small matmul's time grows with
its columns from a few dozen on, and max_loras x the rank of columns cost more than the
operations it saved (bench/lora.py's model on 2 shared AMD EPYC cores, 32 decode rows over 4
adapters: 44 ms a step against 30, the base model alone 21).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tito_engine.model.lora_files import BaseShapes, LoraAdapter, read_adapter
from tito_engine.scheduling.plan import RowInput

#: How much padding the batched add may do: its groups' tokens at most this many times the step's
#: adapter tokens (decode rows evenly spread over the adapters pad little; a long prefill beside
#: a few decode tokens would pad a lot and takes the per-adapter products instead).
PADDING_LIMIT = 1.5

#: The forward's fused linears and the PEFT modules each one holds, in their row order.
FUSED_TARGETS = {"qkv": ("q_proj", "k_proj", "v_proj"), "o": ("o_proj",), "gate_up": ("gate_proj", "up_proj"),
                 "down": ("down_proj",)}


@dataclass(frozen=True)
class BatchedAdapters:
    """A step's adapter tokens as equal groups, one per slot lo..hi-1, each `width` tokens long:
    `tokens` [(hi - lo) * width], the packed position of each group entry; a group shorter than
    `width` repeats its first token, and `padding` (None: none) lists those repeats, whose inputs
    are zeroed so that they add exactly nothing."""

    tokens: torch.Tensor
    padding: torch.Tensor | None
    lo: int
    hi: int
    width: int


class LoraStep:
    """The adapters of the step being run (`LoraSlots.begin_step`): `rows`, the packed tokens of
    adapter rows (None: every token), and per adapter present its slot, its tokens' places among
    `rows` (None: all of them) and their packed positions (None: every token); or, when several
    adapters' groups are close enough in size, `batched` instead (two batched matmuls for all of
    them). `active` is False when every row uses the base model."""

    __slots__ = ("active", "rows", "segments", "batched")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.active = False
        self.rows: torch.Tensor | None = None
        self.segments: list[tuple[int, torch.Tensor | None, torch.Tensor | None]] = []
        self.batched: BatchedAdapters | None = None


class LoraLinear:
    """A fused linear plus the adapters of the step's tokens (see the module docstring).
    `a`: `[slots, W, in]`; `b`: `[slots, W, out]` (B transposed, scaled)."""

    __slots__ = ("base", "a", "b", "step")

    def __init__(self, base: Any, a: torch.Tensor, b: torch.Tensor, step: LoraStep):
        self.base, self.a, self.b, self.step = base, a, b, step

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        if not step.active:
            return y
        if step.batched is not None:
            _add_batched(y, x, self.a, self.b, step.batched)
            return y
        rows = step.rows
        xs = x if rows is None else x.index_select(0, rows)
        for slot, own, target in step.segments:
            part = xs if own is None else xs.index_select(0, own)
            _add(y, target, (part @ self.a[slot].T) @ self.b[slot])
        return y


def _add_batched(y: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, plan: BatchedAdapters) -> None:
    """y[tokens] += (x[tokens] A^T) B per slot group: one gather, two batched matmuls, one
    scatter-add, however many adapters (the groups' slots lo..hi-1 are a view of the stacks)."""
    groups = plan.hi - plan.lo
    xs = x.index_select(0, plan.tokens)
    if plan.padding is not None:
        xs.index_fill_(0, plan.padding, 0)
    xs = xs.view(groups, plan.width, -1)
    delta = torch.bmm(torch.bmm(xs, a[plan.lo:plan.hi].transpose(1, 2)), b[plan.lo:plan.hi])
    y.index_add_(0, plan.tokens, delta.view(groups * plan.width, -1))


def _add(y: torch.Tensor, rows: torch.Tensor | None, delta: torch.Tensor) -> None:
    """y[rows] += delta (rows None: every row), in place."""
    if rows is None:
        y += delta
    else:
        y.index_add_(0, rows, delta)


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
        # Per layer, per fused linear: (A [slots, W, in], B transposed [slots, W, out]), W = parts * rank.
        self._stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        slots = max_loras + 1
        for layer in family.layers:
            stacks = {}
            for name, layout in self._layouts.items():
                base = getattr(layer, name)
                out_features, in_features = base.shape
                width = len(layout.parts) * max_rank
                a = torch.zeros(slots, width, in_features, dtype=self.dtype, device=self.device)
                b = torch.zeros(slots, width, out_features, dtype=self.dtype, device=self.device)
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
            scaled = (b.float() * adapter.scaling).T
            stack_b[slot, column:column + rank, start:end] = scaled.to(self.device, self.dtype)

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
        tokens in order) and build what LoraLinear needs for this step."""
        step = self.step
        step.clear()
        index: list[int] = []
        slots: list[int] = []
        offset = 0
        for row in rows:
            count = len(row.token_ids)
            if row.lora_slot:
                index.extend(range(offset, offset + count))
                slots.extend([row.lora_slot] * count)
            offset += count
        if not index:
            return
        step.active = True
        if len(index) < offset:
            step.rows = torch.tensor(index, dtype=torch.long, device=self.device)
        present = sorted(set(slots))
        if len(present) == 1:
            step.segments = [(present[0], None, step.rows)]
            return
        step.batched = self._batched(index, slots, present)
        if step.batched is not None:
            return
        for slot in present:
            own = [place for place, token_slot in enumerate(slots) if token_slot == slot]
            step.segments.append((slot, torch.tensor(own, dtype=torch.long, device=self.device),
                                  torch.tensor([index[place] for place in own], dtype=torch.long, device=self.device)))

    def _batched(self, index: list[int], slots: list[int], present: list[int]) -> BatchedAdapters | None:
        """The step's adapter tokens as equal groups per slot (BatchedAdapters), or None when
        padding them would cost more than PADDING_LIMIT x their own work (a long prefill beside
        a few decode tokens: the per-adapter products are cheaper then)."""
        groups: dict[int, list[int]] = {slot: [] for slot in range(present[0], present[-1] + 1)}
        for position, slot in zip(index, slots):
            groups[slot].append(position)
        width = max(len(group) for group in groups.values())
        if len(groups) * width > PADDING_LIMIT * len(index):
            return None
        tokens: list[int] = []
        padding: list[int] = []
        filler = index[0]  # an adapter token: a zero delta added to it changes nothing
        for group in groups.values():
            padding.extend(range(len(tokens) + len(group), len(tokens) + width))
            tokens.extend(group + [group[0] if group else filler] * (width - len(group)))
        padded = torch.tensor(padding, dtype=torch.long, device=self.device) if padding else None
        return BatchedAdapters(torch.tensor(tokens, dtype=torch.long, device=self.device), padded, present[0],
                               present[-1] + 1, width)

    def end_step(self) -> None:
        self.step.clear()


def _layout(parts: tuple[str, ...], shapes: BaseShapes) -> _FusedLayout:
    ranges, start = {}, 0
    for module in parts:
        out_features = shapes.features[module][0]
        ranges[module] = (start, start + out_features)
        start += out_features
    return _FusedLayout(ranges, parts)
