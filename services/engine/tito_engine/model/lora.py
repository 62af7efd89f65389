"""Many LoRA adapters in one batched forward: the resident adapters' weights stacked in slots, and
the linears that add each token's adapter.

Slot 0 is the base model; slots 1..max_loras hold resident adapters. For each layer and each of
the forward's fused linears (qkv, o, gate_up, down: families.py fuses q/k/v and gate/up), the
slots' A matrices are stacked, transposed, into one `[slots, in, W]` tensor, W = parts x max_rank
(each part's rank columns side by side, since the parts share their input). B is stored without
the zeros a fused B would hold (q's outputs read q's rank columns only): the fused output is cut
into chunks of C columns, C the greatest common divisor of the parts' widths (q/k/v under
grouped-query attention: the k width; gate/up: the intermediate size), each chunk lying in one
part, and B as `[slots, chunks, max_rank, C]`, pre-multiplied by the adapter's scaling: each
chunk is one small product of its part's rank columns. The fused B, block-diagonal, would have
read and multiplied two thirds zeros for q/k/v and half for gate/up. An adapter of a smaller
rank, or one that leaves a module out, leaves zeros there, which add nothing.

A step's rows may use different adapters and the base model at once. Before the forward, the
runner groups the step's packed tokens by their row's slot (`LoraSlots.begin_step`); each
`LoraLinear` runs its base linear once over every token, exactly as without adapters, then adds
`(x A^T) B` to each adapter's tokens with that slot's matrices, never a forward per adapter. A
row with many tokens in the step (a prefill chunk: RUN_MIN_TOKENS) adds over its own run of
packed tokens in place: a product for A and one accumulating product per chunk of B, with no
gather or scatter. The other adapter tokens (decode rows, one token each) are grouped across rows:
when the adapters' groups are close in size, padded to one width, the add is one gather, two
batched matmuls over the slots' stacks and one scatter-add (`BatchedAdapters`); otherwise one
small matmul pair per adapter present in the step (a segmented matmul). Base-model tokens are
never written (the add goes to the adapter tokens' rows only), so their results are the same bits
as in an engine without adapters, and a step with no adapter rows skips the add entirely (one
attribute read per linear). On CPU in float32 the grouped tokens' add runs in a C kernel instead
(lora_kernel.py: each token where it lies, no gather, padding or scatter; every adapter token of
the step, prefill rows included, is then listed for it).

One masked product against every slot at once (four tensor operations per linear whatever the
number of adapters) was measured against this and lost: on CPU a small matmul's time grows with
its columns from a few dozen on, and max_loras x the rank of columns cost more than the
operations it saved (bench/lora.py's model on 2 shared AMD EPYC cores, 32 decode rows over 4
adapters: 44 ms a step against 30, the base model alone 21).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tito_engine.model.lora_files import BaseShapes, LoraAdapter, read_adapter
from tito_engine.model.lora_kernel import LoraKernel, load_lora_kernel
from tito_engine.scheduling.plan import RowInput

log = logging.getLogger(__name__)

#: How much padding the batched add may do: its groups' tokens at most this many times the step's
#: grouped adapter tokens (decode rows evenly spread over the adapters pad little; groups of very
#: different sizes would pad a lot and take the per-adapter products instead).
PADDING_LIMIT = 1.5

#: A row with at least this many tokens in the step (a prefill chunk) adds its adapter over its own
#: run of packed tokens, in place (one product for A, one per chunk of B accumulated into the
#: output), with no gather or scatter; shorter rows (decode) are grouped across rows instead.
RUN_MIN_TOKENS = 16

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
    """The adapters of the step being run (`LoraSlots.begin_step`): `runs`, the rows whose tokens
    add in place (RUN_MIN_TOKENS); the other adapter tokens either `listed` for the C kernel
    (lora_kernel: positions sorted by slot, and their slots), or as `segments`, per adapter
    present its slot and its tokens' packed positions, or, when several adapters' groups are close
    enough in size, as `batched` (two batched matmuls for all of them).
    `active` is False when every row uses the base model. `scatter_index` keeps, for the
    step, where each chunk of each token's delta goes (one per positions tensor and chunk count)."""

    __slots__ = ("active", "runs", "listed", "segments", "batched", "_scatter")

    def __init__(self):
        self.clear()

    def clear(self) -> None:
        self.active = False
        self.runs: list[tuple[int, int, int]] = []  # (slot, first, end) of rows that add in place
        self.listed: tuple[torch.Tensor, torch.Tensor] | None = None  # the kernel's (positions, slots)
        self.segments: list[tuple[int, torch.Tensor]] = []
        self.batched: BatchedAdapters | None = None
        self._scatter: dict[tuple[int, int], torch.Tensor] = {}

    def scatter_index(self, positions: torch.Tensor, groups: int, chunks: int) -> torch.Tensor:
        """Rows of `y.view(tokens * chunks, C)` that a delta laid out `[groups, chunks, width, C]`
        adds to, for `positions` `[groups * width]` (packed token positions, group-major): entry
        (g, c, i) goes to chunk c of token positions[g * width + i]. Made once per step and shape."""
        key = (id(positions), chunks)
        index = self._scatter.get(key)
        if index is None:
            if chunks == 1:
                index = positions
            else:
                spread = positions.view(groups, 1, -1) * chunks
                index = (spread + torch.arange(chunks, device=positions.device).view(1, chunks, 1)).reshape(-1)
            self._scatter[key] = index
        return index


@dataclass(frozen=True)
class _FusedLayout:
    """How one fused linear's adapters are laid out: each PEFT module's output columns, the parts
    in row order, and B's chunks of `chunk` columns (`chunk_parts`[c]: the part chunk c lies in)."""

    out_ranges: dict[str, tuple[int, int]]
    parts: tuple[str, ...]
    chunk: int
    chunk_parts: torch.Tensor
    chunk_part_list: tuple[int, ...]


class LoraLinear:
    """A fused linear plus the adapters of the step's tokens (see the module docstring).
    `a`: `[slots, in, W]` (A transposed); `b`: `[slots, chunks, rank, C]` (B transposed, scaled, in
    chunks)."""

    __slots__ = ("base", "a", "b", "layout", "step", "kernel")

    def __init__(self, base: Any, a: torch.Tensor, b: torch.Tensor, layout: _FusedLayout, step: LoraStep,
                 kernel: LoraKernel | None):
        self.base, self.a, self.b, self.layout, self.step, self.kernel = base, a, b, layout, step, kernel

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        step = self.step
        if not step.active:
            return y
        for slot, first, end in step.runs:
            self._add_run(y[first:end], x[first:end], slot)
        if step.listed is not None:
            self.kernel.add(y, x, self.a, self.b, self.layout.chunk_parts, *step.listed)
            return y
        plan = step.batched
        if plan is not None:
            xs = x.index_select(0, plan.tokens)
            if plan.padding is not None:
                xs.index_fill_(0, plan.padding, 0)
            self._add(y, xs.view(plan.hi - plan.lo, plan.width, -1), plan.lo, plan.hi, plan.tokens)
            return y
        for slot, positions in step.segments:
            self._add(y, x.index_select(0, positions).unsqueeze(0), slot, slot + 1, positions)
        return y

    def _add_run(self, y: torch.Tensor, x: torch.Tensor, slot: int) -> None:
        """y += (x A^T) B for one slot over a run of tokens, accumulated in place chunk by chunk."""
        xa = torch.mm(x, self.a[slot])
        b = self.b[slot]
        rank, chunk = b.shape[1], b.shape[2]
        for index, part in enumerate(self.layout.chunk_part_list):
            y[:, index * chunk:(index + 1) * chunk].addmm_(xa[:, part * rank:(part + 1) * rank], b[index])

    def _add(self, y: torch.Tensor, xs: torch.Tensor, lo: int, hi: int, positions: torch.Tensor) -> None:
        """y[positions] += (xs A^T) B for slots lo..hi-1, xs `[hi - lo, width, in]` (group g's tokens
        at positions[g * width:(g + 1) * width]): a batched matmul for A, one for B's chunks (each
        chunk reads its part's rank columns), and one scatter-add of every chunk."""
        groups, width = xs.shape[0], xs.shape[1]
        b = self.b[lo:hi]
        chunks, rank, chunk = b.shape[1], b.shape[2], b.shape[3]
        xa = torch.bmm(xs, self.a[lo:hi])  # [groups, width, parts * rank]
        if chunks == 1:
            xb = xa
        else:
            parts = xa.view(groups, width, -1, rank).index_select(2, self.layout.chunk_parts)
            xb = parts.transpose(1, 2).reshape(groups * chunks, width, rank)
        delta = torch.bmm(xb, b.reshape(groups * chunks, rank, chunk))
        index = self.step.scatter_index(positions, groups, chunks)
        y.view(-1, chunk).index_add_(0, index, delta.view(-1, chunk))


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
        self._layouts = {name: _layout(parts, self.shapes, self.device) for name, parts in FUSED_TARGETS.items()}
        self.kernel = self._kernel()
        # Per layer, per fused linear: (A^T [slots, in, W], B^T in chunks [slots, chunks, rank, C]).
        self._stacks: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
        slots = max_loras + 1
        for layer in family.layers:
            stacks = {}
            for name, layout in self._layouts.items():
                base = getattr(layer, name)
                out_features, in_features = base.shape
                a = torch.zeros(slots, in_features, len(layout.parts) * max_rank, dtype=self.dtype, device=self.device)
                b = torch.zeros(slots, out_features // layout.chunk, max_rank, layout.chunk, dtype=self.dtype,
                                device=self.device)
                stacks[name] = (a, b)
                setattr(layer, name, LoraLinear(base, a, b, layout, self.step, self.kernel))
            self._stacks.append(stacks)

    def _kernel(self) -> LoraKernel | None:
        """The C kernel for the grouped tokens' add, where it runs: float32 on CPU, every fused
        linear's W and C a multiple of its vector width, and it could be built."""
        if self.device.type != "cpu" or self.dtype != torch.float32:
            return None
        kernel = load_lora_kernel()
        if kernel is None:
            return None
        if all(kernel.takes(len(layout.parts) * self.max_rank, layout.chunk) for layout in self._layouts.values()):
            return kernel
        log.info("the LoRA add runs on torch's batched matmuls: the C kernel takes ranks and widths in multiples "
                 "of %d floats", kernel.lanes)
        return None

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
            stack_a[slot, :, column:column + rank] = a.T.to(self.device)
            scaled = (b.float() * adapter.scaling).T.to(self.device, self.dtype)  # [rank, out]
            chunk = layout.chunk
            stack_b[slot, start // chunk:end // chunk, :rank] = scaled.view(rank, -1, chunk).transpose(0, 1)

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
        tokens in order) and build what LoraLinear needs for this step: with the C kernel, every
        adapter token listed by slot; else long rows add over their own runs and the other adapter
        tokens are grouped by slot."""
        step = self.step
        step.clear()
        index: list[int] = []
        slots: list[int] = []
        offset = 0
        for row in rows:
            count = len(row.token_ids)
            if row.lora_slot and count >= RUN_MIN_TOKENS and self.kernel is None:
                step.runs.append((row.lora_slot, offset, offset + count))
            elif row.lora_slot:
                index.extend(range(offset, offset + count))
                slots.extend([row.lora_slot] * count)
            offset += count
        step.active = bool(step.runs or index)
        if not index:
            return
        if self.kernel is not None:
            order = sorted(range(len(index)), key=slots.__getitem__)
            step.listed = (torch.tensor([index[place] for place in order], dtype=torch.long),
                           torch.tensor([slots[place] for place in order], dtype=torch.long))
            return
        present = sorted(set(slots))
        if len(index) == offset and len(present) == 1:  # one adapter, every token: one run
            step.runs.append((present[0], 0, offset))
            return
        if len(present) > 1:
            step.batched = self._batched(index, slots, present)
            if step.batched is not None:
                return
        for slot in present:
            positions = [position for position, token_slot in zip(index, slots) if token_slot == slot]
            step.segments.append((slot, torch.tensor(positions, dtype=torch.long, device=self.device)))

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


def _layout(parts: tuple[str, ...], shapes: BaseShapes, device: torch.device) -> _FusedLayout:
    ranges, start = {}, 0
    for module in parts:
        out_features = shapes.features[module][0]
        ranges[module] = (start, start + out_features)
        start += out_features
    chunk = math.gcd(*(end - begin for begin, end in ranges.values()))
    chunk_parts = [index for index, module in enumerate(parts)
                   for _ in range((ranges[module][1] - ranges[module][0]) // chunk)]
    return _FusedLayout(ranges, parts, chunk, torch.tensor(chunk_parts, dtype=torch.long, device=device),
                        tuple(chunk_parts))
