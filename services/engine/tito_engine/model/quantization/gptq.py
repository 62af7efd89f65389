"""int4 checkpoints in GPTQ's layout: what config.json's `quantization_config` says, the packed
tensors read from the checkpoint, and the model built around them.

The layout (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq"; what vLLM 0.32's
`quantization/auto_gptq.py` loads), per quantized linear `NAME` of in_features K, out_features N,
group size G:
  - `NAME.qweight` int32 [K / 8, N]: weight (k, n) in bits 4 * (k % 8) of row k // 8, unsigned 0..15;
  - `NAME.qzeros` int32 [K / G, N / 8]: the zero point of (group, n) minus one in bits 4 * (n % 8);
  - `NAME.scales` float16 [K / G, N];
  - `NAME.g_idx` int32 [K]: the group of each input channel (k // G without activation order);
  - `NAME.bias` when the layer has one, in float.
w[n, k] = (q[k, n] - zero[g(k), n]) * scales[g(k), n].

Covered, as vLLM 0.32 covers it: 4 bits, symmetric (every zero point 8), groups of G input
channels or one group per channel (group_size -1), no activation order (desc_act false, or a
trivial g_idx), the output layer in float. Everything else (other bit widths, asymmetric zero
points, desc_act, gptq_v2, per-module `dynamic` rules, a quantized lm_head, AWQ, compressed-tensors
and other `quant_method`s) is refused at start-up in one line (`checkpoint_quantization`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tito.config import ConfigError

#: Tensors of a GPTQ-quantized linear, by suffix.
GPTQ_TENSORS = ("qweight", "qzeros", "scales", "g_idx")
BITS = 4
PACK = 32 // BITS
#: GPTQ's symmetric zero point for 4 bits (stored as 7 in the "gptq" format, which stores zero - 1).
SYMMETRIC_ZERO = 8
COVERED = "GPTQ 4-bit symmetric without desc_act (checkpoint_format gptq, lm_head in float)"


@dataclass(frozen=True)
class GptqConfig:
    """A checkpoint's GPTQ settings (config.json `quantization_config`)."""

    group_size: int  # -1: one group per output channel
    #: Unpacked int4 weights by module name, filled by `load_gptq_model`.
    tensors: dict[str, "Int4Weights"] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Int4Weights:
    """One linear's int4 weights unpacked: q uint8 [N, K] (0..15), scales float32 [N, groups],
    zero point SYMMETRIC_ZERO, `group_size` input channels per scale."""

    q: torch.Tensor
    scales: torch.Tensor
    group_size: int

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these stand for."""
        scales = self.scales.repeat_interleave(self.group_size, dim=1)
        return (self.q.float() - SYMMETRIC_ZERO) * scales


def _refuse(model_dir: Path, what: str) -> ConfigError:
    return ConfigError(f"{model_dir}: {what}; the native engine loads {COVERED} (or run it with --backend vllm)")


def checkpoint_quantization(model_dir: Path) -> GptqConfig | None:
    """The checkpoint's quantization (None: a float checkpoint); a layout the native engine does not
    load raises ConfigError in one line naming what it found."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    settings = config.get("quantization_config") or (config.get("text_config") or {}).get("quantization_config")
    if not settings:
        return None
    method = str(settings.get("quant_method", "")).lower()
    if method != "gptq":
        raise _refuse(model_dir, f"quant_method {method or '(none)'!r} is not loaded")
    found = {"bits": settings.get("bits"), "sym": settings.get("sym", True),
             "checkpoint_format": settings.get("checkpoint_format", "gptq"), "lm_head": settings.get("lm_head", False)}
    if found != {"bits": BITS, "sym": True, "checkpoint_format": "gptq", "lm_head": False}:
        raise _refuse(model_dir, f"GPTQ with {found}")
    group_size = int(settings.get("group_size", -1))
    if settings.get("desc_act") and group_size != -1:
        raise _refuse(model_dir, "GPTQ with desc_act (activation order) is not loaded")
    if settings.get("dynamic"):
        raise _refuse(model_dir, "GPTQ with per-module `dynamic` rules is not loaded")
    return GptqConfig(group_size)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] holding 8 nibbles each along rows -> uint8 [R * 8, C] (nibble j of row r is row 8r + j)."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32)
    nibbles = (packed[:, None, :] >> shifts[None, :, None]) & 0xF
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def _unpack_columns(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] holding 8 nibbles each along columns -> uint8 [R, C * 8]."""
    shifts = torch.arange(0, 32, BITS, dtype=torch.int32)
    return ((packed[:, :, None] >> shifts[None, None, :]) & 0xF).reshape(packed.shape[0], -1).to(torch.uint8)


def unpack_gptq(name: str, tensors: dict[str, torch.Tensor], group_size: int) -> Int4Weights:
    """One linear's GPTQ tensors as Int4Weights; a layout outside COVERED raises ConfigError."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    q = _unpack_rows(qweight).t().contiguous()  # [N, K]
    out_features, in_features = q.shape
    group = in_features if group_size == -1 else group_size
    if in_features % group or scales.shape != (in_features // group, out_features):
        raise ConfigError(f"{name}: scales {tuple(scales.shape)} do not fit {in_features} inputs in groups of {group}")
    zeros = _unpack_columns(qzeros)[:, :out_features].int() + 1  # the "gptq" format stores zero - 1
    if not bool((zeros == SYMMETRIC_ZERO).all()):
        raise ConfigError(f"{name}: asymmetric zero points are not loaded ({COVERED})")
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_features) // group):
        raise ConfigError(f"{name}: a g_idx with activation order is not loaded ({COVERED})")
    return Int4Weights(q, scales.float().t().contiguous(), group)


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def load_gptq_model(model_dir: Path, dtype: torch.dtype, config: GptqConfig, loader: Any) -> Any:
    """The Hugging Face model of a GPTQ checkpoint with its float tensors loaded and `config.tensors`
    filled with each quantized linear's Int4Weights (keyed by module name). The quantized
    modules keep an initialised float weight until the decoder swaps them (quantize_linears)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    for holder in (hf_config, getattr(hf_config, "text_config", None)):
        if holder is not None and getattr(holder, "quantization_config", None) is not None:
            del holder.quantization_config  # transformers would look for a GPTQ library to run it
    model = loader.from_config(hf_config, dtype=dtype)
    state = _read_safetensors(model_dir)
    quantized = {key.rsplit(".", 1)[0] for key in state if key.endswith(".qweight")}
    for name in sorted(quantized):
        parts = {suffix: state.pop(f"{name}.{suffix}") for suffix in GPTQ_TENSORS if f"{name}.{suffix}" in state}
        config.tensors[name] = unpack_gptq(name, parts, config.group_size)
    missing, unexpected = model.load_state_dict({key: value.to(dtype) for key, value in state.items()}, strict=False)
    if unexpected:
        raise ConfigError(f"{model_dir}: tensors the model has no place for: {sorted(unexpected)[:4]}")
    tied = bool(getattr(hf_config, "tie_word_embeddings", False) or hf_config.get_text_config().tie_word_embeddings)
    left = [key for key in missing if key.rsplit(".", 1)[0] not in quantized and not (tied and key == "lm_head.weight")]
    if left:
        raise ConfigError(f"{model_dir}: the checkpoint lacks {sorted(left)[:4]}")
    if tied:
        model.tie_weights()
    return model
