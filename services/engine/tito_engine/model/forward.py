"""One batched forward per scheduler step over the paged KV cache, for every supported family.

The step's tokens are packed into one `[T, hidden]` matrix (decode rows contribute one token,
prefill chunks several), so every linear layer runs once per step whatever the mix. Attention
reads each row's K/V through its block table (attention.py: all one-token rows share one padded
`scaled_dot_product_attention` call, or two; each prefill chunk gets its own).

The per-architecture layer math lives in `families.py` (Llama, Mistral, Qwen2, Qwen3, Qwen2-VL,
Qwen2.5-VL, Gemma3); this module is the shared plumbing: packing, positions and slots, rotary
tables (one per rope kind: Gemma3's sliding layers use the local base frequency), K/V writes.
Attention masks come in two kinds, built once per step: full causal, and sliding window (a query
at p attends to keys in (p - window, p]; blocks outside the window stay allocated, the mask hides
them).

Multimodal prefill (`MultiModalPrefill`): encoder rows replace placeholder embeddings; Qwen2-VL
and Qwen2.5-VL take explicit 3-D rotary positions (decode positions `cache_len + rope_delta`);
Gemma3 attends bidirectionally inside each image's run of soft tokens (`bidirectional_spans`). A
span's bidirectional attention is exact only when one prefill chunk holds the whole span: a
scheduler must cut chunks with `scheduling.spans.chunk_boundaries_ok` / `fit_chunk_end`. If a chunk does split a
span, a query attends to later positions of its span only within its own chunk (the later ones do
not exist yet), which differs from HF's full-prompt forward.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch

from tito_engine.model.attention import PagedAttention
from tito_engine.model.families import default_bidirectional_spans, family_for, linears_of, spans_of_runs, text_model_of
from tito_engine.model.kv_cache import PagedKVCache
from tito_engine.model.cpu_attention import AttentionKernel
from tito_engine.model.linear import pack_linears
from tito_engine.model.quantization import Int4Checkpoint, quantize_linears
from tito_engine.scheduling.plan import RowInput

__all__ = ["BatchedDecoder", "MultiModalPrefill", "text_model_of"]

log = logging.getLogger(__name__)


@dataclass
class MultiModalPrefill:
    """What a multimodal prompt adds to a plain token prefill (computed before scheduling).

    `embed_positions[i]` is the prompt position whose input embedding is replaced by
    `embeds[i]` (encoder output rows, in prompt order). `mrope_positions` ([3, prompt_len]) are
    the 3-D rotary positions of the prompt (HF's get_rope_index); any position past the prompt
    (generated tokens) uses `position + rope_delta` in all three sections.

    `deepstack` (Qwen3-VL): per level l, rows added to the output of decoder layer l at the same
    positions, as HF's `_deepstack_process` adds them.

    `bidirectional_spans`: half-open (start, end) prompt ranges whose tokens attend to each other
    in both directions at prefill (Gemma3 image soft tokens). None means "the model's default",
    which the decoder fills in on first use (Gemma3: each run of consecutive embed positions,
    exactly HF's token_type_ids blocks; Qwen2-VL: none); `for_model` or
    `BatchedDecoder.prepare_prefill` resolve it up front so a scheduler can see it.
    """

    embeds: torch.Tensor | None = None  # [N, hidden]
    embed_positions: torch.Tensor | None = None  # [N] long, ascending
    # Qwen3-VL DeepStack: [L, N, hidden], level l added to the hidden states after decoder layer l
    # at embed_positions (None: no DeepStack).
    deepstack: torch.Tensor | None = None
    mrope_positions: torch.Tensor | None = None  # [3, prompt_len] long
    rope_delta: int = 0
    bidirectional_spans: list[tuple[int, int]] | None = None

    def chunk_spans(self) -> list[tuple[int, int]]:
        """The spans a scheduler must not split. Unresolved (None): every run of embed positions,
        which is never wrong (for models without bidirectional spans it only constrains chunking)."""
        if self.bidirectional_spans is not None:
            return list(self.bidirectional_spans)
        return spans_of_runs(self.embed_positions)

    @classmethod
    def from_dense(cls, dense: torch.Tensor, mask: torch.Tensor, **kwargs) -> "MultiModalPrefill":
        """From a dense `[prompt_len, hidden]` tensor and a bool mask of the positions it overrides."""
        positions = torch.nonzero(mask, as_tuple=False).flatten()
        return cls(embeds=dense[positions], embed_positions=positions, **kwargs)

    @classmethod
    def for_model(cls, config: Any, **fields: Any) -> "MultiModalPrefill":
        """Like the constructor (e.g. `**vision.prefill_media(...)`), with `bidirectional_spans`
        resolved from the model config (Gemma3: runs of embed positions; others: none)."""
        prefill = cls(**fields)
        if prefill.bidirectional_spans is None:
            prefill.bidirectional_spans = default_bidirectional_spans(config, prefill.embed_positions)
        return prefill


@dataclass
class _PackedRows:
    """Where a step's rows sit once their tokens are packed into one [T] sequence."""

    flat_ids: list[int] = field(default_factory=list)
    offsets: list[int] = field(default_factory=list)  # each row's first packed token
    decode_rows: list[int] = field(default_factory=list)  # row indices with one token
    prefill_rows: list[int] = field(default_factory=list)
    decode_slots: list[int] = field(default_factory=list)  # paged-cache slot of each decode token
    logit_index: list[int] = field(default_factory=list)  # packed tokens whose logits are returned
    any_mm: bool = False
    longest: int = 0  # the longest context in this step (does the sliding window cut anything?)
    window: int | None = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


class BatchedDecoder:
    """The batched forward over a paged cache for one loaded model (any family in families.py)."""

    def __init__(self, model: Any, cache: PagedKVCache, max_positions: int, packed_linears: bool = False,
                 release_plain_weights: bool = False, attention_kernel: AttentionKernel | None = None,
                 quantization: "str | Int4Checkpoint" = "none"):
        """`packed_linears`: on CPU, run the linears on oneDNN-packed copies of their weights
        (linear.py: faster from a few rows a step on). `release_plain_weights`: free the plain
        weights the packed ones replace for every call (the HF model's text linears then hold no
        data: only this decoder may run it). `attention_kernel`: attends the decode rows and the
        prefill chunks it takes on CPU (cpu_attention.py). `quantization`: the scheme the
        projections and output layer run in, or an int4 checkpoint's own weights
        (model/quantization.scheme_for; none: the checkpoint's float weights)."""
        self.family = family = family_for(model)
        self.quantized = quantize_linears(family, quantization, model)
        self.packed_linear_bytes, self.released_weight_bytes = (
            pack_linears(linears_of(family), release_plain_weights) if packed_linears else (0, 0))
        self.cache = cache
        self.device = cache.device
        self.dtype = model.dtype
        self.layers = family.layers
        self.num_heads = family.num_heads
        self.num_kv_heads = family.num_kv_heads
        self.head_dim = family.head_dim
        self.scaling = family.scaling
        self.block_size = cache.block_size
        self.sliding_window = family.sliding_window
        # cos/sin for every position and rope kind, computed as HF does (float32 freqs, then cast).
        positions = torch.arange(max_positions + 1, device=self.device, dtype=torch.float32)
        self.rope_tables: list[tuple[torch.Tensor, torch.Tensor]] = []
        for inv_freq, attention_scaling in family.ropes:
            freqs = positions[:, None] * inv_freq.to(device=self.device, dtype=torch.float32)[None, :]
            cos_half, sin_half = freqs.cos() * attention_scaling, freqs.sin() * attention_scaling
            self.rope_tables.append((torch.cat((cos_half, cos_half), dim=-1).to(self.dtype),
                                     torch.cat((sin_half, sin_half), dim=-1).to(self.dtype)))
        self.cos_table, self.sin_table = self.rope_tables[0]
        self.mrope_section = family.mrope_section
        if self.mrope_section is not None:
            # Which of the (t, h, w) position rows feeds each rotary dim (both halves), as HF's
            # recomposition_frequencies picks them.
            if getattr(family, "mrope_interleaved", False):
                # Qwen3-VL: dim d reads h where d % 3 == 1 and d < 3 * section[1], w where d % 3 == 2
                # and d < 3 * section[2], t elsewhere (HF's recomposition_frequencies).
                sections = torch.zeros(self.head_dim // 2, dtype=torch.long)
                for axis in (1, 2):
                    sections[axis:self.mrope_section[axis] * 3:3] = axis
            else:
                sections = torch.cat([torch.full((size,), i % 3, dtype=torch.long)
                                      for i, size in enumerate(self.mrope_section)])
            self.mrope_dim_source = torch.cat((sections, sections)).to(self.device)
        self._arange = torch.arange(max_positions + 1, device=self.device)
        self.attention = PagedAttention(cache, family, self._range, self.prepare_prefill, attention_kernel)

    def _range(self, count: int) -> torch.Tensor:
        """arange(count) on the device, from the cached one when it is long enough."""
        if count <= self._arange.shape[0]:
            return self._arange[:count]
        return torch.arange(count, device=self.device)

    def prepare_prefill(self, prefill: MultiModalPrefill) -> MultiModalPrefill:
        """Resolve `bidirectional_spans` to this model's default when unset; returns `prefill`."""
        if prefill.bidirectional_spans is None:
            prefill.bidirectional_spans = self.family.default_bidirectional_spans(prefill.embed_positions)
        return prefill

    # ------------------------------------------------------------------ rotary

    def _rotary(self, table: tuple[torch.Tensor, torch.Tensor], positions: torch.Tensor,
                mrope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, 1, head_dim] for 1-D positions [T], or for 3-D positions [3, T] when given."""
        cos_table, sin_table = table
        if mrope is None:
            return cos_table[positions][:, None, :], sin_table[positions][:, None, :]
        # [3, T, hd] then, per dim, the row its mrope section reads.
        index = self.mrope_dim_source[None, None, :].expand(1, mrope.shape[1], -1)
        cos = cos_table[mrope].gather(0, index).squeeze(0)
        sin = sin_table[mrope].gather(0, index).squeeze(0)
        return cos[:, None, :], sin[:, None, :]

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def forward(self, rows: list[RowInput]) -> torch.Tensor:
        """Run one step; return logits [R, vocab] (float32) for the rows with needs_logits, in order."""
        packed = self._pack(rows)
        input_ids = torch.tensor(packed.flat_ids, dtype=torch.long, device=self.device)
        positions, slot_mapping = self._positions_and_slots(rows, packed)
        hidden = self.family.embed(input_ids)
        mrope = None
        deepstack: list[tuple[torch.Tensor, torch.Tensor]] = []  # (packed targets, rows [L, n, hidden])
        if packed.any_mm:
            hidden, mrope = self._apply_multimodal(rows, packed.offsets, hidden, positions, deepstack)
        if deepstack:
            deepstack_targets = torch.cat([targets for targets, _ in deepstack])
            deepstack_rows = torch.cat([levels for _, levels in deepstack], dim=1).to(self.device, hidden.dtype)
        ropes = [self._rotary(table, positions, mrope) for table in self.rope_tables]
        attention = self.attention.plan(rows, packed.offsets, packed.decode_rows, packed.prefill_rows, packed.window)
        heads = self.num_heads
        for layer_index, layer in enumerate(self.layers):
            residual = hidden
            qk, v = layer.project(hidden)
            cos, sin = ropes[layer.rope]
            qk = qk * cos + _rotate_half(qk) * sin  # rotary on q and k together
            q, k = qk[:, :heads], qk[:, heads:]
            key_cache, value_cache = self.cache.keys[layer_index], self.cache.values[layer_index]
            key_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, k)
            value_cache.view(-1, self.num_kv_heads, self.head_dim).index_copy_(0, slot_mapping, v)
            attn = self.attention.attend(attention, layer_index, layer.kind, q, k, v)
            hidden = layer.finish(residual, attn)
            if deepstack and layer_index < deepstack_rows.shape[0]:
                hidden = hidden.index_add(0, deepstack_targets, deepstack_rows[layer_index])
        if len(packed.logit_index) != len(packed.flat_ids):
            hidden = hidden.index_select(0, torch.tensor(packed.logit_index, dtype=torch.long, device=self.device))
        return self.family.logits(hidden).float()

    def _pack(self, rows: list[RowInput]) -> "_PackedRows":
        """The step's tokens packed row after row, and where each kind of row sits."""
        packed = _PackedRows()
        block_size = self.block_size
        for index, row in enumerate(rows):
            packed.offsets.append(len(packed.flat_ids))
            packed.flat_ids.extend(row.token_ids)
            packed.longest = max(packed.longest, row.start + len(row.token_ids))
            if len(row.token_ids) == 1:
                packed.decode_rows.append(index)
                start = row.start
                packed.decode_slots.append(row.block_table[start // block_size] * block_size + start % block_size)
            else:
                packed.prefill_rows.append(index)
            if row.needs_logits:
                packed.logit_index.append(len(packed.flat_ids) - 1)
            packed.any_mm = packed.any_mm or row.mm is not None
        if self.sliding_window is not None and packed.longest > self.sliding_window:
            packed.window = self.sliding_window
        return packed

    def _positions_and_slots(self, rows: list[RowInput], packed: "_PackedRows") -> tuple[torch.Tensor, torch.Tensor]:
        """Each packed token's position and the paged-cache slot its K/V goes to."""
        device, block_size = self.device, self.block_size
        if not packed.prefill_rows:
            return (torch.tensor([row.start for row in rows], dtype=torch.long, device=device),
                    torch.tensor(packed.decode_slots, dtype=torch.long, device=device))
        # Vectorised over the packed tokens: each token's row, its position, its slot.
        counts = [len(row.token_ids) for row in rows]
        widest = max(-(-(row.start + count) // block_size) for row, count in zip(rows, counts))
        tables = []
        for row in rows:
            table = row.block_table[:widest]
            tables.append(table + [0] * (widest - len(table)))
        table_tensor = torch.tensor(tables, dtype=torch.long, device=device)
        row_of = torch.repeat_interleave(self._range(len(rows)), torch.tensor(counts, dtype=torch.long, device=device))
        shift = torch.tensor([row.start - offset for row, offset in zip(rows, packed.offsets)], dtype=torch.long,
                             device=device)
        # A step may pack more tokens than one sequence's context (many prompts at once).
        positions = self._range(len(packed.flat_ids)) + shift[row_of]
        return positions, table_tensor[row_of, positions // block_size] * block_size + positions % block_size

    # ------------------------------------------------------------------ multimodal

    def _apply_multimodal(self, rows: list[RowInput], offsets: list[int], hidden: torch.Tensor,
                          positions: torch.Tensor, deepstack: list | None = None
                          ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Swap in encoder rows for placeholder embeddings; build 3-D positions where a row has them;
        append each row's DeepStack (packed targets, levels) for this step's tokens to `deepstack`."""
        need_mrope = self.mrope_section is not None and any(
            row.mm is not None and (row.mm.mrope_positions is not None or row.mm.rope_delta) for row in rows)
        mrope_parts = []
        for row, offset in zip(rows, offsets):
            count = len(row.token_ids)
            end = row.start + count
            mm = row.mm
            if mm is not None and mm.embeds is not None and mm.embed_positions is not None:
                positions_mm = mm.embed_positions.to(device=self.device)
                chosen = (positions_mm >= row.start) & (positions_mm < end)
                if bool(chosen.any()):
                    target = positions_mm[chosen] - row.start + offset
                    hidden = hidden.index_copy(0, target, mm.embeds.to(self.device, hidden.dtype)[chosen])
                    if mm.deepstack is not None and deepstack is not None:
                        deepstack.append((target, mm.deepstack.to(self.device)[:, chosen]))
            if need_mrope:
                pos = self._range(end)[row.start:]
                if mm is None:
                    mrope_parts.append(pos[None, :].expand(3, -1))
                    continue
                part = (pos + mm.rope_delta)[None, :].expand(3, -1).clone()
                if mm.mrope_positions is not None:
                    prompt_len = mm.mrope_positions.shape[1]
                    inside = min(end, prompt_len) - row.start
                    if inside > 0:
                        part[:, :inside] = mm.mrope_positions[:, row.start:row.start + inside].to(self.device)
                mrope_parts.append(part)
        mrope = torch.cat(mrope_parts, dim=1) if need_mrope else None
        if mrope is None and any(row.mm is not None and row.mm.rope_delta for row in rows):
            raise ValueError("rope_delta needs a model with multimodal rotary (mrope_section)")
        return hidden, mrope
