"""Per-architecture layer math for the batched forward (`forward.BatchedDecoder`).

The decoder owns everything shared: packing a step's tokens, positions and cache slots, the
rotary application, K/V writes into the paged cache, attention masks (causal, sliding window,
bidirectional spans) and the attention calls. A family owns only what differs between
architectures, read once from the loaded Hugging Face module:

* `embed(ids)`: token embeddings (Gemma3 scales them by sqrt(hidden) in the embedding dtype);
* per layer, `project(hidden) -> (qk, v)`: input norm, the fused q/k/v projection and any
  per-head q/k norms, before rotary; and `finish(residual, attn) -> hidden`: output
  projection, norms, residuals and the MLP;
* each layer's attention kind (`FULL` or `SLIDING`, from the config's `layer_types`) and which
  rotary table it reads (Gemma3: local base frequency on sliding layers, global on full ones);
* `logits(hidden)`: final norm, lm_head, final soft-capping where HF applies it;
* the query scaling, and the default bidirectional spans of a multimodal prefill.

Families (`FAMILIES`, keyed by the text config's model_type): `QwenFamily` (the Llama-style
pre-norm decoder: Qwen2, Qwen2-VL's and Qwen2.5-VL's text models with their M-RoPE sections,
Llama 2 / 3.x with any rotary scaling HF folds into `inv_freq`, Mistral), `Qwen3Family` (the same
plus per-head q/k RMSNorm: Qwen3, and Qwen3-VL's text model with its interleaved M-RoPE sections)
and `Gemma3Family` (Gemma3 text, alone or inside
Gemma3ForConditionalGeneration). Each follows HF's op order (norm statistics in float32, casts
where HF casts) so logits match HF's forward.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F

from tito_engine.model.linear import Linear

log = logging.getLogger(__name__)

FULL, SLIDING = 0, 1  # attention kinds: index into the per-kind masks the decoder builds


def text_model_of(model: Any) -> Any:
    """The decoder stack of a causal LM: `model.model`, or `model.model.language_model` for a VLM."""
    inner = model.model
    return getattr(inner, "language_model", inner)


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


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Qwen2RMSNorm: statistics in float32, weight applied in the input dtype."""
    dtype = x.dtype
    x32 = x.to(torch.float32)
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def gemma_rms_norm(x: torch.Tensor, scale32: torch.Tensor, eps: float) -> torch.Tensor:
    """HF's Gemma3RMSNorm with `scale32 = 1 + weight` in float32: everything in float32, one cast
    at the end (unlike Qwen, the weight multiplies before the cast)."""
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return (x32 * scale32).to(x.dtype)


def _act(mlp: Any):
    """The MLP activation as a plain function where possible (a module call per layer costs more)."""
    act = mlp.act_fn
    name = type(act).__name__
    if isinstance(act, torch.nn.SiLU) or name == "SiLUActivation":
        return F.silu
    if name == "GELUTanh" and callable(getattr(act, "act", None)):
        return act.act  # functools.partial(F.gelu, approximate="tanh")
    return act


def _bind_linears(layer_weights: Any, attn: Any, mlp: Any) -> None:
    """The projections every family shares: fused q/k/v and gate/up (sharing the HF modules'
    storage), the output and down projections, and the MLP activation."""
    projections = [attn.q_proj, attn.k_proj, attn.v_proj]
    layer_weights.qkv = Linear(_fuse(projections, "weight"), _fuse(projections, "bias"), sources=projections)
    layer_weights.o = Linear(attn.o_proj.weight, attn.o_proj.bias, sources=[attn.o_proj])
    gate_up = [mlp.gate_proj, mlp.up_proj]
    layer_weights.intermediate = mlp.gate_proj.weight.shape[0]
    layer_weights.gate_up = Linear(_fuse(gate_up, "weight"), _fuse(gate_up, "bias"), sources=gate_up)
    layer_weights.down = Linear(mlp.down_proj.weight, mlp.down_proj.bias, sources=[mlp.down_proj])
    layer_weights.act = _act(mlp)


def output_layer(model: Any, embedding: torch.Tensor) -> tuple[Linear, bool]:
    """The LM head as a Linear, and whether it is tied to the embedding (then its weight is the
    embedding's and cannot be freed: linear.release_plain leaves it alone)."""
    head = model.lm_head
    tied = head.weight.data_ptr() == embedding.data_ptr()
    return Linear(head.weight, getattr(head, "bias", None), sources=() if tied else (head,)), tied


def linears_of(family: Any) -> Iterator[Linear]:
    """Every linear of a family's forward worth packing: each layer's four, then the LM head unless it
    is tied to the embedding in half precision (linear.py: one copy does as well there)."""
    for layer in family.layers:
        yield from (layer.qkv, layer.o, layer.gate_up, layer.down)
    if not family.lm_head_tied or family.embed_w.dtype == torch.float32:
        yield family.lm_head


def _layer_kinds(config: Any) -> tuple[list[int], int | None]:
    """Each layer's attention kind from `layer_types`, and the window when any layer slides.

    A config with a `sliding_window` but no `layer_types` (Mistral) slides on every layer, as HF's
    Mistral builds one sliding-window mask for all of them; a null window means full attention."""
    types = getattr(config, "layer_types", None)
    if not types:
        kind = "sliding_attention" if getattr(config, "sliding_window", None) else "full_attention"
        types = [kind] * config.num_hidden_layers
    types = list(types)
    unknown = sorted(set(types) - {"full_attention", "sliding_attention"})
    if unknown:
        raise ValueError(f"unsupported attention layer types {unknown}")
    window = getattr(config, "sliding_window", None)
    if "sliding_attention" not in types or not window:
        return [FULL] * len(types), None
    return [SLIDING if t == "sliding_attention" else FULL for t in types], int(window)


def _check_rope_type(rope_type: str) -> None:
    if rope_type == "dynamic":
        log.warning("dynamic rotary scaling is not supported; using the base frequencies")


def spans_of_runs(positions: torch.Tensor | None) -> list[tuple[int, int]]:
    """Maximal runs of consecutive positions as half-open (start, end) pairs."""
    if positions is None or positions.numel() == 0:
        return []
    values = positions.tolist()
    spans, begin = [], values[0]
    for previous, current in zip(values, values[1:]):
        if current != previous + 1:
            spans.append((begin, previous + 1))
            begin = current
    spans.append((begin, values[-1] + 1))
    return spans


# ---------------------------------------------------------------------------- Llama-style decoders


class _PreNormLayer:
    """The Llama-style decoder layer: RMSNorm, attention, residual; RMSNorm, SwiGLU MLP, residual.

    Covers Llama / Mistral (no biases unless `attention_bias` / `mlp_bias`), Qwen2 and Qwen2-VL /
    Qwen2.5-VL (biased q/k/v) and Qwen3 (an RMSNorm over each q and k head before rotary, as
    `q_norm` / `k_norm`). All norms are Qwen2RMSNorm's math (`rms_norm`).
    """

    def __init__(self, layer: Any, kind: int, heads: int, kv_heads: int, head_dim: int, qk_norm: bool):
        attn, mlp = layer.self_attn, layer.mlp
        if hasattr(layer, "pre_feedforward_layernorm") or hasattr(attn, "q_norm") != qk_norm:
            raise ValueError(f"{type(layer).__name__} has norms this family does not apply")
        self.kind, self.rope = kind, 0
        self.shape = (heads + 2 * kv_heads, head_dim)
        self.split = heads + kv_heads
        self.ln1_w = layer.input_layernorm.weight
        self.ln1_eps = layer.input_layernorm.variance_epsilon
        self.ln2_w = layer.post_attention_layernorm.weight
        self.ln2_eps = layer.post_attention_layernorm.variance_epsilon
        self.qk_norm_w = None
        if qk_norm:
            self.qk_eps = attn.q_norm.variance_epsilon
            if attn.k_norm.variance_epsilon != self.qk_eps:
                raise ValueError("q_norm and k_norm with different eps are not supported")
            # q_norm and k_norm stacked per head: one norm call over [T, heads + kv_heads, head_dim].
            self.qk_norm_w = torch.cat([attn.q_norm.weight.detach().expand(heads, head_dim),
                                        attn.k_norm.weight.detach().expand(kv_heads, head_dim)])
        _bind_linears(self, attn, mlp)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = rms_norm(hidden, self.ln1_w, self.ln1_eps)
        qkv = self.qkv(x).view(hidden.shape[0], *self.shape)
        qk, v = qkv[:, :self.split], qkv[:, self.split:]
        if self.qk_norm_w is not None:
            qk = rms_norm(qk, self.qk_norm_w, self.qk_eps)
        return qk, v

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        hidden = residual + self.o(attn)
        x = rms_norm(hidden, self.ln2_w, self.ln2_eps)
        gate_up = self.gate_up(x)
        inter = self.intermediate
        return hidden + self.down(self.act(gate_up[:, :inter]) * gate_up[:, inter:])


class QwenFamily:
    """Llama-style decoders: Qwen2, Qwen2-VL / Qwen2.5-VL's text model (the same layers, plus
    M-RoPE sections on the rotary), Llama (any rotary scaling HF folds into `inv_freq`, e.g.
    Llama 3.1's "llama3"), Mistral and, with `qk_norm`, Qwen3. `name` is the text config's
    model_type (qwen2_vl / qwen2_5_vl for the VLMs)."""

    qk_norm = False

    def __init__(self, model: Any):
        text = text_model_of(model)
        config = text.config
        self.name = getattr(model.config, "model_type", "") or getattr(config, "model_type", "")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        kinds, self.sliding_window = _layer_kinds(config)
        self.layers = [_PreNormLayer(layer, kind, self.num_heads, self.num_kv_heads, self.head_dim, self.qk_norm)
                       for layer, kind in zip(text.layers, kinds)]
        self.embed_w = text.embed_tokens.weight
        self.norm_w, self.norm_eps = text.norm.weight, text.norm.variance_epsilon
        self.lm_head, self.lm_head_tied = output_layer(model, self.embed_w)
        rotary = text.rotary_emb
        _check_rope_type(getattr(rotary, "rope_type", "default"))
        self.ropes = [(rotary.inv_freq, float(getattr(rotary, "attention_scaling", 1.0)))]
        self.mrope_section = getattr(rotary, "mrope_section", None)
        # Qwen3-VL interleaves the (t, h, w) sections across the rotary dims (t, h, w, t, h, w, ...).
        rope_parameters = getattr(config, "rope_parameters", None) or {}
        self.mrope_interleaved = self.mrope_section is not None and bool(
            rope_parameters.get("mrope_interleaved") or type(rotary).__name__.startswith("Qwen3VL"))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_w)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = rms_norm(hidden, self.norm_w, self.norm_eps)
        return self.lm_head(hidden)

    def default_bidirectional_spans(self, embed_positions: torch.Tensor | None) -> list[tuple[int, int]]:
        return []  # Qwen2-VL / Qwen2.5-VL attend causally over image tokens too


class Qwen3Family(QwenFamily):
    """Qwen3: Qwen2's layers without q/k/v bias, with q_norm / k_norm per head before rotary and
    head_dim from the config (it need not be hidden_size / heads)."""

    qk_norm = True


# ---------------------------------------------------------------------------- Gemma3


class _GemmaLayer:
    """Gemma3 decoder layer: q/k per-head norms, pre and post norms around attention and MLP,
    every norm scaling by (1 + weight) in float32."""

    def __init__(self, layer: Any, kind: int, rope: int, heads: int, kv_heads: int, head_dim: int):
        attn, mlp = layer.self_attn, layer.mlp
        self.kind, self.rope = kind, rope
        self.shape = (heads + 2 * kv_heads, head_dim)
        self.split = heads + kv_heads

        def scale(norm: Any) -> torch.Tensor:
            return 1.0 + norm.weight.detach().float()

        self.eps = layer.input_layernorm.eps
        norms = [layer.input_layernorm, layer.post_attention_layernorm, layer.pre_feedforward_layernorm,
                 layer.post_feedforward_layernorm, attn.q_norm, attn.k_norm]
        if any(norm.eps != self.eps for norm in norms):
            raise ValueError("Gemma3 layers with norms of different eps are not supported")
        self.ln_in = scale(layer.input_layernorm)
        self.ln_post_attn = scale(layer.post_attention_layernorm)
        self.ln_pre_ff = scale(layer.pre_feedforward_layernorm)
        self.ln_post_ff = scale(layer.post_feedforward_layernorm)
        # q_norm and k_norm stacked per head: one norm call over [T, heads + kv_heads, head_dim].
        self.qk_norm = torch.cat([scale(attn.q_norm).expand(heads, head_dim),
                                  scale(attn.k_norm).expand(kv_heads, head_dim)])
        _bind_linears(self, attn, mlp)

    def project(self, hidden: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = gemma_rms_norm(hidden, self.ln_in, self.eps)
        qkv = self.qkv(x).view(hidden.shape[0], *self.shape)
        qk = gemma_rms_norm(qkv[:, :self.split], self.qk_norm, self.eps)
        return qk, qkv[:, self.split:]

    def finish(self, residual: torch.Tensor, attn: torch.Tensor) -> torch.Tensor:
        hidden = residual + gemma_rms_norm(self.o(attn), self.ln_post_attn, self.eps)
        x = gemma_rms_norm(hidden, self.ln_pre_ff, self.eps)
        gate_up = self.gate_up(x)
        inter = self.intermediate
        x = self.down(self.act(gate_up[:, :inter]) * gate_up[:, inter:])
        return hidden + gemma_rms_norm(x, self.ln_post_ff, self.eps)


class Gemma3Family:
    """Gemma3's text model (transformers 5.24 `Gemma3TextModel`), as a causal LM or inside
    `Gemma3ForConditionalGeneration`.

    Matches HF in two details that look like omissions: `attn_logit_softcapping` is not applied
    (Gemma3Attention never passes it to the attention function), and the final logit
    soft-capping is applied only for `Gemma3ForCausalLM` (the conditional-generation head skips it).
    """

    name = "gemma3"

    def __init__(self, model: Any):
        text = text_model_of(model)
        config = text.config
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("Gemma3 with use_bidirectional_attention (an encoder) cannot generate")
        if getattr(config, "attn_logit_softcapping", None) is not None:
            log.warning("attn_logit_softcapping is set; like transformers' Gemma3 the engine does not apply it")
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        self.scaling = float(config.query_pre_attn_scalar) ** -0.5
        kinds, self.sliding_window = _layer_kinds(config)
        types = list(config.layer_types)
        rotary = text.rotary_emb
        rope_types = sorted(set(types))  # one rotary table per layer type (local vs global base)
        self.ropes = []
        for layer_type in rope_types:
            _check_rope_type(getattr(rotary, "rope_type", {}).get(layer_type, "default"))
            self.ropes.append((getattr(rotary, f"{layer_type}_inv_freq"),
                               float(getattr(rotary, f"{layer_type}_attention_scaling", 1.0))))
        self.layers = [_GemmaLayer(layer, kind, rope_types.index(layer_type), self.num_heads, self.num_kv_heads,
                                   self.head_dim)
                       for layer, kind, layer_type in zip(text.layers, kinds, types)]
        self.mrope_section = None
        self.mrope_interleaved = False
        embed = text.embed_tokens
        self.embed_w = embed.weight
        scale = getattr(embed, "embed_scale", None)
        self.embed_scale = (scale if scale is not None else torch.tensor(config.hidden_size ** 0.5)).to(
            self.embed_w.device, self.embed_w.dtype)
        self.norm_scale, self.norm_eps = 1.0 + text.norm.weight.detach().float(), text.norm.eps
        self.lm_head, self.lm_head_tied = output_layer(model, self.embed_w)
        # Only the text-only causal LM soft-caps its logits in transformers 5.24.
        self.final_softcap = (getattr(config, "final_logit_softcapping", None)
                              if type(model).__name__ == "Gemma3ForCausalLM" else None)

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(input_ids, self.embed_w) * self.embed_scale

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        hidden = gemma_rms_norm(hidden, self.norm_scale, self.norm_eps)
        logits = self.lm_head(hidden)
        if self.final_softcap is not None:
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits

    def default_bidirectional_spans(self, embed_positions: torch.Tensor | None) -> list[tuple[int, int]]:
        """HF's rule: each run of consecutive image positions (token_type_ids == 1, which
        `vision.embed_token_type_ids` sets at exactly the embed positions) is one block."""
        return spans_of_runs(embed_positions)


#: Text config model_type -> family. Llama covers Llama 2 / 3.x and Mistral is the same layer math
#: (its sliding window, when set, applies to every layer: see `_layer_kinds`).
FAMILIES: dict[str, type] = {
    "qwen2": QwenFamily, "qwen2_vl": QwenFamily, "qwen2_vl_text": QwenFamily, "qwen2_5_vl": QwenFamily,
    "qwen2_5_vl_text": QwenFamily, "llama": QwenFamily, "mistral": QwenFamily, "qwen3": Qwen3Family,
    "qwen3_vl": Qwen3Family, "qwen3_vl_text": Qwen3Family,
    "gemma3": Gemma3Family, "gemma3_text": Gemma3Family,
}


def family_for(model: Any) -> QwenFamily | Gemma3Family:
    """The layer math for a loaded HF causal LM / VLM, chosen from its text config's model_type."""
    model_type = getattr(text_model_of(model).config, "model_type", "")
    family = FAMILIES.get(model_type)
    if family is None:
        raise ValueError(f"the native engine has no layer math for model_type {model_type!r} (supported: "
                         f"{', '.join(sorted(FAMILIES))}); serve it with --backend vllm")
    return family(model)


def uses_bidirectional_spans(config: Any) -> bool:
    """Whether a model's multimodal prefill attends bidirectionally within image spans (Gemma3)."""
    return getattr(config, "model_type", "") in ("gemma3", "gemma3_text")


def default_bidirectional_spans(config: Any, embed_positions: torch.Tensor | None) -> list[tuple[int, int]]:
    """Family default spans from a config alone (no loaded model): see `Gemma3Family`."""
    return spans_of_runs(embed_positions) if uses_bidirectional_spans(config) else []
