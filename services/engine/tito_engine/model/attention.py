"""Attention over the paged KV cache for one batched step.

Decode rows (one query each) attend, on CPU in float32, in one call of a C kernel that reads
their blocks in place (cpu_attention.py), and so do prefill chunks without bidirectional spans
where the CPU has AVX-512 (one call each); elsewhere decode rows attend in one padded
`scaled_dot_product_attention` call, or a few when their context lengths differ
(`split_by_context`: rows of similar length share a call, so the K/V a step gathers follows each
row's own context, not the longest row's); each prefill chunk attends on its own, over its own
K/V when it starts the prompt, else over the blocks of its table. Masks are additive floats built
once per step (SDPA on CPU converts a bool one on every
call): full causal, sliding window (a query at p attends to keys in (p - window, p]), and
bidirectional spans inside a prefill chunk (Gemma3 image soft tokens).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import torch
import torch.nn.functional as F

from tito_engine.model.cpu_attention import AttentionKernel, DecodeRows, PrefillChunk
from tito_engine.model.families import SLIDING
from tito_engine.model.kv_cache import PagedKVCache


#: Fixed cost of one more decode attention call per layer (an index_select of K and V and an SDPA),
#: and the rate the gather copies at, to weigh a call against the padding it saves.
GROUP_CALL_SECONDS = 40e-6
GATHER_BYTES_PER_SECOND = 7e9
#: Most decode groups per step (each costs a call per layer).
MAX_DECODE_GROUPS = 4


def split_by_context(blocks: list[int], call_cost: int, max_groups: int = MAX_DECODE_GROUPS) -> list[list[int]]:
    """Partition rows sorted by context (`blocks`: each row's blocks, ascending) into at most
    `max_groups` runs of consecutive rows, each padded to its longest row, so that the blocks
    gathered plus `call_cost` per group is least; greedy: the run with the most padding to save
    is split at its best cut while a cut saves more than a call costs. O(rows) per cut."""
    runs = [(0, len(blocks))]
    while len(runs) < max_groups:
        best = None  # (saving, run index, cut)
        for index, (start, end) in enumerate(runs):
            whole = (end - start) * blocks[end - 1]
            for cut in range(start + 1, end):
                saving = whole - ((cut - start) * blocks[cut - 1] + (end - cut) * blocks[end - 1])
                if saving > call_cost and (best is None or saving > best[0]):
                    best = (saving, index, cut)
        if best is None:
            break
        _, index, cut = best
        start, end = runs[index]
        runs[index:index + 1] = [(start, cut), (cut, end)]
    return [list(range(start, end)) for start, end in runs]


@dataclass
class AttentionPlan:
    """How every layer of one step attends (built once per step)."""

    num_tokens: int
    whole_batch_decodes: bool  # every row decodes one token
    decode_groups: list = field(default_factory=list)  # (packed index or None, blocks, rows, masks by kind)
    prefill_specs: list = field(default_factory=list)  # (offset, count, blocks or None, masks by kind)
    kernel_decodes: DecodeRows | None = None  # the decode rows, when the decode kernel attends them
    kernel_prefills: list = field(default_factory=list)  # PrefillChunk each, for the prefill kernel
    window: int | None = None  # sliding layers' window, when a row of the step is longer


class PagedAttention:
    def __init__(self, cache: PagedKVCache, family: Any, arange: Callable[[int], torch.Tensor],
                 prepare_prefill: Callable[[Any], Any], kernel: AttentionKernel | None = None):
        """`kernel`: attends the decode rows, and the prefill chunks it takes (cpu_attention.py),
        instead of the torch path."""
        self.cache = cache
        self.device = cache.device
        self.block_size = cache.block_size
        self.dtype = cache.keys[0].dtype
        self.num_heads, self.num_kv_heads, self.head_dim = family.num_heads, family.num_kv_heads, family.head_dim
        self.scaling = family.scaling
        self._has_sliding = any(layer.kind == SLIDING for layer in family.layers)
        self._range = arange  # arange(count) on the device, cached by the decoder
        # What one more attention call per layer costs, in gathered block-rows (one block of K and V
        # for one row): ~40 us of call overhead against the gather's ~7 GB/s of one core.
        block_bytes = 2 * cache.block_size * self.num_kv_heads * self.head_dim * cache.keys[0].element_size()
        self._group_cost = max(1, (GROUP_CALL_SECONDS * GATHER_BYTES_PER_SECOND) // block_bytes)
        self._prepare_prefill = prepare_prefill  # resolves a prefill's bidirectional spans
        self._kernel = kernel
        self._kernel_prefills = kernel is not None and kernel.prefills(self.head_dim)

    def plan(self, rows: list, offsets: list[int], decode_rows: list[int], prefill_rows: list[int],
             window: int | None) -> AttentionPlan:
        """How every layer of this step attends: decode rows (one token each) in one kernel call or
        in a few gathered groups, prefill chunks one by one. `offsets[i]`: row i's first packed token."""
        num_tokens = offsets[-1] + len(rows[-1].token_ids) if rows else 0
        plan = AttentionPlan(num_tokens=num_tokens, whole_batch_decodes=not prefill_rows, window=window)
        if self._kernel is not None and decode_rows:
            block_size = self.block_size
            plan.kernel_decodes = DecodeRows(
                [offsets[i] for i in decode_rows],
                [rows[i].block_table[:rows[i].start // block_size + 1] for i in decode_rows],
                [rows[i].start + 1 for i in decode_rows])
        else:
            plan.decode_groups = self._decode_groups(rows, decode_rows, offsets, whole_batch=not prefill_rows,
                                                     window=window)
        for i in prefill_rows:
            row = rows[i]
            end = row.start + len(row.token_ids)
            spans = self._row_spans(row, end)
            if self._kernel_prefills and not spans:
                plan.kernel_prefills.append(PrefillChunk(offsets[i], len(row.token_ids), row.start,
                                                         row.block_table[:-(-end // self.block_size)]))
            else:
                plan.prefill_specs.append(self._prefill_spec(row, offsets[i], window, spans))
        return plan

    def attend(self, plan: AttentionPlan, layer_index: int, kind: int, q: torch.Tensor,
                      k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """One layer's attention output [T, heads * hd] for the step's packed queries."""
        heads, head_dim = self.num_heads, self.head_dim
        key_cache, value_cache = self.cache.keys[layer_index], self.cache.values[layer_index]
        groups = plan.decode_groups
        if plan.whole_batch_decodes and len(groups) == 1 and groups[0][0] is None:  # every row decodes, one group
            _, blocks, count, masks = groups[0]
            return self._attend_decode(q, key_cache, value_cache, blocks, count, masks[kind])
        attn = torch.empty((plan.num_tokens, heads * head_dim), dtype=q.dtype, device=self.device)
        if plan.kernel_decodes is not None:
            self._kernel(q, attn, plan.kernel_decodes, key_cache, value_cache, heads, self.num_kv_heads,
                                head_dim, self.scaling, plan.window if kind == SLIDING else None)
        for index, blocks, count, masks in groups:
            out = self._attend_decode(q.index_select(0, index), key_cache, value_cache, blocks, count, masks[kind])
            attn.index_copy_(0, index, out)
        for chunk in plan.kernel_prefills:
            self._kernel.prefill(q, attn, chunk, key_cache, value_cache, heads, self.num_kv_heads, head_dim,
                                 self.scaling, plan.window if kind == SLIDING else None)
        self._attend_prefills(plan, kind, q, k, v, key_cache, value_cache, attn)
        return attn

    def _attend_prefills(self, plan: AttentionPlan, kind: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                         key_cache: torch.Tensor, value_cache: torch.Tensor, attn: torch.Tensor) -> None:
        """Each prefill chunk on its own, written into `attn` at its tokens."""
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        for offset, count, blocks, masks in plan.prefill_specs:
            q_rows = q[offset:offset + count].transpose(0, 1)[None]  # [1, heads, count, hd]
            mask = masks[kind]
            if blocks is None:  # a prompt's first chunk: this step's K/V only
                out = F.scaled_dot_product_attention(
                    q_rows, k[offset:offset + count].transpose(0, 1)[None],
                    v[offset:offset + count].transpose(0, 1)[None], attn_mask=mask,
                    is_causal=mask is None, scale=self.scaling, enable_gqa=kv_heads != heads).transpose(1, 2)
            else:
                out = self._attend(q_rows, key_cache, value_cache, blocks, 1, mask)
            attn[offset:offset + count] = out[0].reshape(count, heads * head_dim)

    def _row_spans(self, row: Any, end: int) -> list[tuple[int, int]]:
        """The row's bidirectional spans clipped to the part of this chunk where they matter:
        at least two positions inside [row.start, end) (a query and a later key)."""
        if row.mm is None:
            return []
        spans = self._prepare_prefill(row.mm).bidirectional_spans
        clipped = []
        for s, e in spans or ():
            s, e = max(s, row.start), min(e, end)
            if e - s >= 2:
                clipped.append((s, e))
        return clipped

    def _prefill_spec(self, row: Any, offset: int, window: int | None, spans: list[tuple[int, int]]):
        """(offset, count, block ids or None for "this chunk's own K/V", masks by kind); a mask of
        None means plain causal over the chunk's own K/V (SDPA's is_causal). `spans`: the row's
        bidirectional spans in this chunk (`_row_spans`)."""
        device, block_size = self.device, self.block_size
        count = len(row.token_ids)
        end = row.start + count
        slides = window is not None and end > window and self._has_sliding
        if row.start == 0 and not spans and not slides:
            return offset, count, None, (None, None)
        blocks = None
        if row.start == 0:
            key_pos = self._range(count)  # the chunk's own K/V: key index == position
        else:
            num_blocks = -(-end // block_size)
            blocks = torch.tensor(row.block_table[:num_blocks], dtype=torch.long, device=device)
            key_pos = self._range(num_blocks * block_size)
        query_pos = self._range(end)[row.start:]
        allowed = key_pos[None, :] <= query_pos[:, None]
        for s, e in spans:  # both in [row.start, end): bidirectional within the span
            allowed[s - row.start:e - row.start, s:e] = True
        full = self._additive(allowed)
        sliding = full
        if slides:
            sliding = self._additive(allowed & (key_pos[None, :] > query_pos[:, None] - window))
        if row.start == 0 and not spans:
            full = None  # causal on its own K/V
        return offset, count, blocks, (full, sliding)

    def _additive(self, allowed: torch.Tensor) -> torch.Tensor:
        """[Q, K] bool -> [1, 1, Q, K] additive float mask (SDPA on CPU converts a bool one per call)."""
        mask = torch.zeros((1, 1, *allowed.shape), dtype=self.dtype, device=self.device)
        return mask.masked_fill_(~allowed[None, None], float("-inf"))

    def _decode_groups(self, rows: list, decode_rows: list[int], offsets: list[int],
                       whole_batch: bool, window: int | None = None
                       ) -> list[tuple[torch.Tensor | None, torch.Tensor, int, tuple[torch.Tensor, torch.Tensor]]]:
        """The one-token rows as attention groups of similar contexts: (token index or None, block
        ids, rows, masks by kind over the gathered slots). Rows are padded to their group's longest
        context, so rows of very different lengths attend in separate calls (`split_by_context`):
        what a step gathers grows with each row's own context, not with the longest row's."""
        if not decode_rows:
            return []
        block_size, device = self.block_size, self.device
        lengths = [rows[i].start + 1 for i in decode_rows]
        count = len(decode_rows)
        groups = [list(range(count))]
        if count >= 4:
            order = sorted(range(count), key=lengths.__getitem__)
            # Each group in row order: a single group is the whole batch, its output rows in place.
            groups = [sorted(order[j] for j in part)
                      for part in split_by_context([-(-lengths[j] // block_size) for j in order], self._group_cost)]
        slides = window is not None and self._has_sliding
        result = []
        for members in groups:
            max_blocks = -(-max(lengths[j] for j in members) // block_size)
            padded = []
            for j in members:
                table = rows[decode_rows[j]].block_table[:max_blocks]
                padded.extend(table)
                if len(table) < max_blocks:
                    padded.extend([0] * (max_blocks - len(table)))
            blocks = torch.tensor(padded, dtype=torch.long, device=device)
            length_tensor = torch.tensor([lengths[j] for j in members], dtype=torch.long, device=device)
            pos = self._range(max_blocks * block_size)
            # An additive float mask: SDPA on CPU converts a bool one on every call.
            mask = torch.zeros((len(members), 1, 1, max_blocks * block_size), dtype=self.dtype, device=device)
            mask.masked_fill_(pos[None, None, None, :] >= length_tensor[:, None, None, None], float("-inf"))
            masks = (mask, mask)
            if slides:  # the query sits at length - 1: keys at or before length - 1 - window fall out
                outside = pos[None, None, None, :] <= (length_tensor - 1 - window)[:, None, None, None]
                masks = (mask, mask.masked_fill(outside, float("-inf")))
            index = None
            if not (whole_batch and len(groups) == 1):
                index = torch.tensor([offsets[decode_rows[j]] for j in members], dtype=torch.long, device=device)
            result.append((index, blocks, len(members), masks))
        return result

    def _attend_decode(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor,
                       blocks: torch.Tensor, batch: int, mask: torch.Tensor) -> torch.Tensor:
        """One query per row, q [B, heads, hd] -> [B, heads * hd]. The query heads sharing a KV head
        are folded into the query-length axis ([B, kv_heads, group, hd]): exact for one position,
        and SDPA then reads each K/V once instead of repeating it per group (measured ~25% faster)."""
        kv_heads, head_dim = self.num_kv_heads, self.head_dim
        keys = key_cache.index_select(0, blocks).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        values = value_cache.index_select(0, blocks).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        grouped = q.reshape(batch, kv_heads, self.num_heads // kv_heads, head_dim)
        out = F.scaled_dot_product_attention(grouped, keys, values, attn_mask=mask, scale=self.scaling)
        return out.reshape(batch, self.num_heads * head_dim)

    def _attend(self, q: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor, blocks: torch.Tensor,
                batch: int, mask: torch.Tensor) -> torch.Tensor:
        """q [B, heads, Q, hd] against the K/V of `blocks` ([B * blocks per row]) under mask [B, 1, Q, L]."""
        keys = key_cache.index_select(0, blocks).view(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        values = value_cache.index_select(0, blocks).view(batch, -1, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=self.scaling,
                                              enable_gqa=self.num_kv_heads != self.num_heads).transpose(1, 2)
