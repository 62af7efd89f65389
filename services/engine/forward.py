"""One batched forward per scheduler step for Qwen2-family decoders over the paged KV cache.

The step's tokens are packed into one `[T, hidden]` matrix (decode rows contribute one token,
prefill chunks several), so every linear layer runs once per step whatever the mix. Attention
reads each row's K/V through its block table: all one-token rows share one padded
`scaled_dot_product_attention` call, each prefill chunk gets its own (few per step).

It reuses the loaded Hugging Face module's weights (embed_tokens, the decoder layers' norms,
projections and MLPs, the final norm, lm_head) and follows HF's op order (RMSNorm in float32,
rotary as HF computes it) so greedy tokens equal `generate`'s. The rotary table is precomputed
from the model's own `inv_freq`; Qwen2-VL's multimodal rotary (mrope_section) takes explicit
3-D position ids per prefill token, and its decode positions are `cache_len + rope_delta`.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from .kv_cache import PagedKVCache

log = logging.getLogger(__name__)


@dataclass
class MultiModalPrefill:
    """What a multimodal prompt adds to a plain token prefill (computed before scheduling).

    `embed_positions[i]` is the prompt position whose input embedding is replaced by
    `embeds[i]` (encoder output rows, in prompt order). `mrope_positions` ([3, prompt_len]) are
    the 3-D rotary positions of the prompt (HF's get_rope_index); any position past the prompt
    (generated tokens) uses `position + rope_delta` in all three sections.
    """

    embeds: torch.Tensor | None = None  # [N, hidden]
    embed_positions: torch.Tensor | None = None  # [N] long, ascending
    mrope_positions: torch.Tensor | None = None  # [3, prompt_len] long
    rope_delta: int = 0

    @classmethod
    def from_dense(cls, dense: torch.Tensor, mask: torch.Tensor, **kwargs) -> "MultiModalPrefill":
        """From a dense `[prompt_len, hidden]` tensor and a bool mask of the positions it overrides."""
        positions = torch.nonzero(mask, as_tuple=False).flatten()
        return cls(embeds=dense[positions], embed_positions=positions, **kwargs)


@dataclass
class RowInput:
    """One sequence's work in a step: compute K/V for `token_ids` at positions start.."""

    token_ids: list[int]
    start: int  # tokens of this sequence already in the KV cache
    block_table: list[int]  # covers at least start + len(token_ids) tokens
    needs_logits: bool  # sample after this row (its chunk reaches the end of the known tokens)
    mm: MultiModalPrefill | None = None


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _fuse(linears: list[Any], name: str) -> torch.Tensor | None:
    """Concatenate the linears' `name` tensors into one and make each module's a view of it.

    One matmul instead of several per layer (bitwise the same result here), and no extra memory:
    the HF modules keep working on views of the fused storage.
    """
    parts = [getattr(linear, name) for linear in linears]
    if any(part is None for part in parts):
        if any(part is not None for part in parts):
            raise ValueError(f"cannot fuse linears where only some have a {name}")
        return None
    fused = torch.cat([part.detach() for part in parts])
    offset = 0
    for linear, part in zip(linears, parts):
        size = part.shape[0]
        getattr(linear, name).data = fused[offset:offset + size]
        offset += size
    return fused


class _DecoderWeights:
    """The HF modules' tensors, looked up once (attribute walks per step add up); q/k/v and
    gate/up fused into one projection each."""

    def __init__(self, layer: Any):
        attn, mlp = layer.self_attn, layer.mlp
        self.ln1_w, self.ln1_eps = layer.input_layernorm.weight, layer.input_layernorm.variance_epsilon
        self.ln2_w, self.ln2_eps = layer.post_attention_layernorm.weight, layer.post_attention_layernorm.variance_epsilon
        projections = [attn.q_proj, attn.k_proj, attn.v_proj]
        self.qkv_w, self.qkv_b = _fuse(projections, "weight"), _fuse(projections, "bias")
        self.o_w, self.o_b = attn.o_proj.weight, attn.o_proj.bias
        self.gate_up_w = _fuse([mlp.gate_proj, mlp.up_proj], "weight")
        self.intermediate = mlp.gate_proj.weight.shape[0]
        self.down_w = mlp.down_proj.weight
        # The activation as a plain function when it is SiLU (a module call per layer costs more).
        silu = isinstance(mlp.act_fn, torch.nn.SiLU) or type(mlp.act_fn).__name__ == "SiLUActivation"
        self.act = F.silu if silu else mlp.act_fn


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Exactly HF's Qwen2RMSNorm: statistics in float32, weight applied in the input dtype.
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def text_model_of(model: Any) -> Any:
    """The decoder stack of a causal LM: Qwen2 `model.model`, Qwen2-VL `model.model.language_model`."""
    inner = model.model
    return getattr(inner, "language_model", inner)


class BatchedDecoder:
    """The batched forward over a paged cache for one loaded Qwen2-family model."""

    def __init__(self, model: Any, cache: PagedKVCache, max_positions: int):
        text = text_model_of(model)
        config = text.config
        self.cache = cache
        self.device = cache.device
        self.dtype = model.dtype
        self.embed = text.embed_tokens.weight
        self.layers = [_DecoderWeights(layer) for layer in text.layers]
        self.norm_w, self.norm_eps = text.norm.weight, text.norm.variance_epsilon
        self.lm_head_w = model.lm_head.weight
        self.lm_head_b = getattr(model.lm_head, "bias", None)
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.block_size = cache.block_size
        self.sliding_window = getattr(config, "sliding_window", None) if getattr(config, "use_sliding_window", False) else None
        if self.sliding_window:
            log.warning("this model uses sliding-window attention; the engine attends over the full context")
        rotary = text.rotary_emb
        if getattr(rotary, "rope_type", "default") == "dynamic":
            log.warning("dynamic rotary scaling is not supported; using the base frequencies")
        # cos/sin for every position, computed as HF does (float32 freqs, then cast to the model dtype).
        inv_freq = rotary.inv_freq.to(device=self.device, dtype=torch.float32)
        positions = torch.arange(max_positions + 1, device=self.device, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]
        scaling = float(getattr(rotary, "attention_scaling", 1.0))
        self.cos_half = (freqs.cos() * scaling)  # [P, hd/2] float32
        self.sin_half = (freqs.sin() * scaling)
        self.cos_table = torch.cat((self.cos_half, self.cos_half), dim=-1).to(self.dtype)
        self.sin_table = torch.cat((self.sin_half, self.sin_half), dim=-1).to(self.dtype)
        self.mrope_section = getattr(rotary, "mrope_section", None)
        if self.mrope_section is not None:
            # Which of the (t, h, w) position rows feeds each rotary dim (both halves), as HF's
            # recomposition_frequencies picks them.
            sections = torch.cat([torch.full((size,), i % 3, dtype=torch.long)
                                  for i, size in enumerate(self.mrope_section)])
            self.mrope_dim_source = torch.cat((sections, sections)).to(self.device)
        self._arange = torch.arange(max_positions + 1, device=self.device)

    def _range(self, count: int) -> torch.Tensor:
        """arange(count) on the device, from the cached one when it is long enough."""
        if count <= self._arange.shape[0]:
            return self._arange[:count]
        return torch.arange(count, device=self.device)

    # ------------------------------------------------------------------ rotary

    def _rotary(self, positions: torch.Tensor, mrope: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [T, head_dim] for 1-D positions [T], or for 3-D positions [3, T] when given."""
        if mrope is None:
            return self.cos_table[positions], self.sin_table[positions]
        # [3, T, hd] then, per dim, the row its mrope section reads.
        index = self.mrope_dim_source[None, None, :].expand(1, mrope.shape[1], -1)
        cos = self.cos_table[mrope].gather(0, index).squeeze(0)
        sin = self.sin_table[mrope].gather(0, index).squeeze(0)
        return cos, sin

    # ------------------------------------------------------------------ the step

    @torch.inference_mode()
    def forward(self, rows: list[RowInput]) -> torch.Tensor:
        """Run one step; return logits [R, vocab] (float32) for the rows with needs_logits, in order."""
        device, block_size = self.device, self.block_size
        flat_ids: list[int] = []
        decode_rows: list[int] = []  # row indices with one token
        prefill_rows: list[int] = []
        offsets: list[int] = []
        logit_index: list[int] = []
        decode_slots: list[int] = []
        any_mm = False
        for index, row in enumerate(rows):
            offset = len(flat_ids)
            offsets.append(offset)
            flat_ids.extend(row.token_ids)
            if len(row.token_ids) == 1:
                decode_rows.append(index)
                start = row.start
                decode_slots.append(row.block_table[start // block_size] * block_size + start % block_size)
            else:
                prefill_rows.append(index)
            if row.needs_logits:
                logit_index.append(len(flat_ids) - 1)
            if row.mm is not None:
                any_mm = True
        num_tokens = len(flat_ids)
        input_ids = torch.tensor(flat_ids, dtype=torch.long, device=device)

        # Positions and cache slots of every packed token.
        if not prefill_rows:
            positions = torch.tensor([row.start for row in rows], dtype=torch.long, device=device)
            slot_mapping = torch.tensor(decode_slots, dtype=torch.long, device=device)
        else:
            # Vectorised over the packed tokens: each token's row, its position, its slot.
            counts = [len(row.token_ids) for row in rows]
            widest = max(-(-(row.start + count) // block_size) for row, count in zip(rows, counts))
            tables = []
            for row in rows:
                table = row.block_table[:widest]
                tables.append(table + [0] * (widest - len(table)))
            table_tensor = torch.tensor(tables, dtype=torch.long, device=device)
            row_of = torch.repeat_interleave(self._range(len(rows)),
                                             torch.tensor(counts, dtype=torch.long, device=device))
            shift = torch.tensor([row.start - offset for row, offset in zip(rows, offsets)], dtype=torch.long,
                                 device=device)
            # A step may pack more tokens than one sequence's context (many prompts at once).
            positions = self._range(num_tokens) + shift[row_of]
            slot_mapping = table_tensor[row_of, positions // block_size] * block_size + positions % block_size

        hidden = F.embedding(input_ids, self.embed)
        mrope = None
        if any_mm:
            hidden, mrope = self._apply_multimodal(rows, offsets, hidden, positions)
        cos, sin = self._rotary(positions, mrope)
        cos, sin = cos[:, None, :], sin[:, None, :]

        decode_groups = self._decode_groups(rows, decode_rows, offsets, whole_batch=not prefill_rows)
        prefill_specs = []
        for i in prefill_rows:
            row = rows[i]
            count = len(row.token_ids)
            if row.start == 0:
                # A prompt's first chunk attends only to itself: this step's K/V, plain causal.
                prefill_specs.append((offsets[i], count, None, None))
                continue
            kv_len = row.start + count
            num_blocks = -(-kv_len // block_size)
            blocks = torch.tensor(row.block_table[:num_blocks], dtype=torch.long, device=device)
            pos = self._range(num_blocks * block_size)
            query_pos = pos[row.start:kv_len]
            mask = torch.zeros((1, 1, count, num_blocks * block_size), dtype=self.dtype, device=device)
            mask.masked_fill_(pos[None, None, None, :] > query_pos[None, None, :, None], float("-inf"))
            prefill_specs.append((offsets[i], count, blocks, mask))  # causal from the chunk's offset

        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        for layer, weights in enumerate(self.layers):
            residual = hidden
            x = _rms_norm(hidden, weights.ln1_w, weights.ln1_eps)
            qkv = F.linear(x, weights.qkv_w, weights.qkv_b).view(num_tokens, heads + 2 * kv_heads, head_dim)
            qk = qkv[:, :heads + kv_heads]
            qk = qk * cos + _rotate_half(qk) * sin  # rotary on q and k together
            q, k = qk[:, :heads], qk[:, heads:]
            v = qkv[:, heads + kv_heads:]
            key_cache, value_cache = self.cache.keys[layer], self.cache.values[layer]
            key_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, k)
            value_cache.view(-1, kv_heads, head_dim).index_copy_(0, slot_mapping, v)

            if len(decode_groups) == 1 and decode_groups[0][0] is None:  # every row decodes, one group
                _, blocks, count, mask = decode_groups[0]
                attn = self._attend_decode(q, key_cache, value_cache, blocks, count, mask)
            else:
                attn = torch.empty((num_tokens, heads * head_dim), dtype=q.dtype, device=device)
                for index, blocks, count, mask in decode_groups:
                    out = self._attend_decode(q.index_select(0, index), key_cache, value_cache, blocks, count, mask)
                    attn.index_copy_(0, index, out)
                for offset, count, blocks, mask in prefill_specs:
                    q_rows = q[offset:offset + count].transpose(0, 1)[None]  # [1, heads, count, hd]
                    if blocks is None:
                        out = F.scaled_dot_product_attention(
                            q_rows, k[offset:offset + count].transpose(0, 1)[None],
                            v[offset:offset + count].transpose(0, 1)[None], is_causal=True, scale=self.scaling,
                            enable_gqa=kv_heads != heads).transpose(1, 2)
                    else:
                        out = self._attend(q_rows, key_cache, value_cache, blocks, 1, mask)
                    attn[offset:offset + count] = out[0].reshape(count, heads * head_dim)

            hidden = residual + F.linear(attn, weights.o_w, weights.o_b)
            residual = hidden
            x = _rms_norm(hidden, weights.ln2_w, weights.ln2_eps)
            gate_up = F.linear(x, weights.gate_up_w)
            inter = weights.intermediate
            x = F.linear(weights.act(gate_up[:, :inter]) * gate_up[:, inter:], weights.down_w)
            hidden = residual + x

        if len(logit_index) != num_tokens:
            hidden = hidden.index_select(0, torch.tensor(logit_index, dtype=torch.long, device=device))
        hidden = _rms_norm(hidden, self.norm_w, self.norm_eps)
        return F.linear(hidden, self.lm_head_w, self.lm_head_b).float()

    def _decode_groups(self, rows: list[RowInput], decode_rows: list[int], offsets: list[int],
                       whole_batch: bool) -> list[tuple[torch.Tensor | None, torch.Tensor, int, torch.Tensor]]:
        """The one-token rows as one or two attention groups: (token index or None, block ids,
        rows, mask over the gathered slots). Rows are padded to their group's longest context, so
        when lengths differ a lot, short and long rows attend separately (less gathered padding)."""
        if not decode_rows:
            return []
        block_size, device = self.block_size, self.device
        lengths = [rows[i].start + 1 for i in decode_rows]
        count = len(decode_rows)
        groups = [list(range(count))]
        if count >= 8:
            order = sorted(range(count), key=lengths.__getitem__)
            blocks_sorted = [-(-lengths[j] // block_size) for j in order]
            whole = count * blocks_sorted[-1]
            best, split = whole, 0
            for cut in range(1, count):
                cost = cut * blocks_sorted[cut - 1] + (count - cut) * blocks_sorted[-1]
                if cost < best:
                    best, split = cost, cut
            if split and best < 0.75 * whole:  # worth a second attention call
                groups = [order[:split], order[split:]]
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
            index = None
            if not (whole_batch and len(groups) == 1):
                index = torch.tensor([offsets[decode_rows[j]] for j in members], dtype=torch.long, device=device)
            result.append((index, blocks, len(members), mask))
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

    def _apply_multimodal(self, rows: list[RowInput], offsets: list[int], hidden: torch.Tensor,
                          positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Swap in encoder rows for placeholder embeddings; build 3-D positions where a row has them."""
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
