"""int4 checkpoints in GPTQ's, AWQ's and compressed-tensors' layouts: what config.json's
`quantization_config` says, the packed tensors read from the checkpoint, and the model built
around them.

Per quantized linear `NAME` of in_features K, out_features N, group size G (as vLLM 0.32 loads them:
its modules `auto_gptq`, `auto_awq` and `compressed_tensors.schemes.compressed_tensors_wNa16` under
`vllm.model_executor.layers.quantization`):

GPTQ (AutoGPTQ / GPTQModel, `checkpoint_format` "gptq"):
  - `NAME.qweight` int32 [K / 8, N]: weight (k, n) in bits 4 * (k % 8) of row k // 8, unsigned 0..15;
  - `NAME.qzeros` int32 [K / G, N / 8]: the zero point of (group, n) minus one in bits 4 * (n % 8);
  - `NAME.scales` float16 [K / G, N]; `NAME.g_idx` int32 [K]: each input channel's group.
AWQ (AutoAWQ, `version` "gemm"):
  - `NAME.qweight` int32 [K, N / 8]: packed along the outputs, output 8c + i of column c in bits
    4 * p where p is i's place in AWQ's order (0, 2, 4, 6, 1, 3, 5, 7);
  - `NAME.qzeros` int32 [K / G, N / 8]: zero points (as they are), packed like qweight;
  - `NAME.scales` float16 [K / G, N].
compressed-tensors `pack-quantized` (llm-compressor's W4A16):
  - `NAME.weight_packed` int32 [N, K / 8]: weight (n, k) in bits 4 * (k % 8) of column k // 8,
    stored as the signed value + 8;
  - `NAME.weight_scale` [N, K / G] in the model's dtype; `NAME.weight_shape` int64 (N, K).
All: w[n, k] = (q - zero[g(k), n]) * scales[g(k), n]; `NAME.bias` in float when there is one.

Covered: 4 bits; GPTQ symmetric (every zero point 8) without activation order (desc_act false or a
trivial g_idx); AWQ gemm with zero points; compressed-tensors pack-quantized with one config group
of symmetric int weights, group or channel strategy, no activation order and no activation
quantization; groups of G or one group per channel; the output layer in float; linears a
checkpoint leaves in float stay float. Everything else (other widths, asymmetric GPTQ or
compressed-tensors, desc_act / actorder, gptq_v2, `dynamic` rules, a quantized lm_head, AWQ gemv or
without zero points, other compressed-tensors formats (W8A8, FP8, NVFP4, ...), and other
`quant_method`s) is refused at start-up in one line (`checkpoint_quantization`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tito.config import ConfigError

#: Tensors of a quantized linear, by suffix (AWQ has no g_idx).
INT4_TENSORS = ("qweight", "qzeros", "scales", "g_idx", "weight_packed", "weight_scale", "weight_shape")
#: The tensor that marks a linear as quantized, by method.
PACKED_TENSOR = {"gptq": "qweight", "awq": "qweight", "compressed-tensors": "weight_packed"}
BITS = 4
#: GPTQ's symmetric zero point for 4 bits (stored as 7 in the "gptq" format, which stores zero - 1).
SYMMETRIC_ZERO = 8
#: AWQ's place of output i (of 8) inside an int32: nibble p holds output AWQ_ORDER[p].
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
COVERED = ("GPTQ 4-bit symmetric without desc_act (checkpoint_format gptq), AWQ 4-bit gemm with zero points and "
           "compressed-tensors pack-quantized 4-bit symmetric, lm_head in float")


@dataclass(frozen=True)
class Int4Checkpoint:
    """A checkpoint's int4 settings (config.json `quantization_config`)."""

    method: str  # gptq, awq or compressed-tensors
    group_size: int  # -1: one group per output channel
    #: Unpacked int4 weights by module name, filled by `load_int4_model`.
    tensors: dict[str, "Int4Weights"] = field(default_factory=dict, compare=False)


@dataclass(frozen=True)
class Int4Weights:
    """One linear's int4 weights unpacked: q uint8 [N, K] (0..15), scales float32 [N, groups], zero
    points uint8 [N, groups], `group_size` input channels per scale."""

    q: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor
    group_size: int

    def centred(self) -> torch.Tensor:
        """q - zero as int8 [N, K] (-15..15)."""
        zeros = self.zeros.repeat_interleave(self.group_size, dim=1)
        return (self.q.to(torch.int16) - zeros.to(torch.int16)).to(torch.int8)

    def dequantize(self) -> torch.Tensor:
        """The float32 weight [N, K] these stand for."""
        return self.centred().float() * self.scales.repeat_interleave(self.group_size, dim=1)


def _refuse(model_dir: Path, what: str) -> ConfigError:
    return ConfigError(f"{model_dir}: {what}; the native engine loads {COVERED} (or run it with --backend vllm)")


def _gptq(model_dir: Path, settings: dict) -> Int4Checkpoint:
    found = {"bits": settings.get("bits"), "sym": settings.get("sym", True),
             "checkpoint_format": settings.get("checkpoint_format", "gptq"), "lm_head": settings.get("lm_head", False)}
    if found != {"bits": BITS, "sym": True, "checkpoint_format": "gptq", "lm_head": False}:
        raise _refuse(model_dir, f"GPTQ with {found}")
    group_size = int(settings.get("group_size", -1))
    if settings.get("desc_act") and group_size != -1:
        raise _refuse(model_dir, "GPTQ with desc_act (activation order) is not loaded")
    if settings.get("dynamic"):
        raise _refuse(model_dir, "GPTQ with per-module `dynamic` rules is not loaded")
    return Int4Checkpoint("gptq", group_size)


def _awq(model_dir: Path, settings: dict) -> Int4Checkpoint:
    found = {"bits": settings.get("bits", settings.get("w_bit")), "zero_point": settings.get("zero_point"),
             "version": str(settings.get("version", "gemm")).lower(), "lm_head": settings.get("lm_head", False)}
    if found != {"bits": BITS, "zero_point": True, "version": "gemm", "lm_head": False}:
        raise _refuse(model_dir, f"AWQ with {found}")
    group_size = int(settings.get("group_size", settings.get("q_group_size", -1)))
    if group_size < 1:
        raise _refuse(model_dir, f"AWQ with group_size {group_size}")
    return Int4Checkpoint("awq", group_size)


def _compressed_tensors(model_dir: Path, settings: dict) -> Int4Checkpoint:
    groups = settings.get("config_groups") or {}
    if settings.get("format") != "pack-quantized" or len(groups) != 1:
        raise _refuse(model_dir, f"compressed-tensors format {settings.get('format')!r} with {len(groups)} config "
                                 f"groups")
    scheme = next(iter(groups.values()))
    weights = scheme.get("weights") or {}
    found = {"num_bits": weights.get("num_bits"), "type": weights.get("type"),
             "symmetric": weights.get("symmetric"), "actorder": weights.get("actorder") or None,
             "dynamic": weights.get("dynamic", False), "input_activations": scheme.get("input_activations")}
    expected = {"num_bits": BITS, "type": "int", "symmetric": True, "actorder": None, "dynamic": False,
                "input_activations": None}
    strategy = weights.get("strategy")
    if found != expected or strategy not in ("group", "channel"):
        raise _refuse(model_dir, f"compressed-tensors weights {found}, strategy {strategy!r}")
    return Int4Checkpoint("compressed-tensors", int(weights.get("group_size") or -1) if strategy == "group" else -1)


def checkpoint_quantization(model_dir: Path) -> Int4Checkpoint | None:
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
    if method == "gptq":
        return _gptq(model_dir, settings)
    if method == "awq":
        return _awq(model_dir, settings)
    if method == "compressed-tensors":
        return _compressed_tensors(model_dir, settings)
    raise _refuse(model_dir, f"quant_method {method or '(none)'!r} is not loaded")


_SHIFTS = torch.arange(0, 32, BITS, dtype=torch.int32)


def _unpack_rows(packed: torch.Tensor) -> torch.Tensor:
    """int32 [R, C] holding 8 nibbles each along rows -> uint8 [R * 8, C] (nibble j of row r is row 8r + j)."""
    nibbles = (packed[:, None, :] >> _SHIFTS[None, :, None]) & 0xF
    return nibbles.reshape(-1, packed.shape[1]).to(torch.uint8)


def _unpack_columns(packed: torch.Tensor, order: tuple[int, ...] = tuple(range(8))) -> torch.Tensor:
    """int32 [R, C] holding 8 nibbles each along columns -> uint8 [R, C * 8]: nibble p of column c is
    column 8c + order[p]."""
    nibbles = (packed[:, :, None] >> _SHIFTS[None, None, :]) & 0xF  # [R, C, p]
    placed = torch.empty_like(nibbles)
    placed[:, :, list(order)] = nibbles
    return placed.reshape(packed.shape[0], -1).to(torch.uint8)


def _groups(name: str, in_features: int, out_features: int, scales: torch.Tensor, group_size: int) -> int:
    group = in_features if group_size == -1 else group_size
    if in_features % group or scales.shape != (in_features // group, out_features):
        raise ConfigError(f"{name}: scales {tuple(scales.shape)} do not fit {in_features} inputs in groups of {group}")
    return group


def unpack_gptq(name: str, tensors: dict[str, torch.Tensor], group_size: int) -> Int4Weights:
    """One linear's GPTQ tensors as Int4Weights; a layout outside COVERED raises ConfigError."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    q = _unpack_rows(qweight).t().contiguous()  # [N, K]
    out_features, in_features = q.shape
    group = _groups(name, in_features, out_features, scales, group_size)
    zeros = _unpack_columns(qzeros)[:, :out_features].int() + 1  # the "gptq" format stores zero - 1
    if not bool((zeros == SYMMETRIC_ZERO).all()):
        raise ConfigError(f"{name}: asymmetric GPTQ zero points are not loaded ({COVERED})")
    g_idx = tensors.get("g_idx")
    if g_idx is not None and not torch.equal(g_idx.long(), torch.arange(in_features) // group):
        raise ConfigError(f"{name}: a g_idx with activation order is not loaded ({COVERED})")
    return Int4Weights(q, scales.float().t().contiguous(), zeros.to(torch.uint8).t().contiguous(), group)


def unpack_awq(name: str, tensors: dict[str, torch.Tensor], group_size: int) -> Int4Weights:
    """One linear's AWQ tensors as Int4Weights."""
    qweight, qzeros, scales = tensors["qweight"], tensors["qzeros"], tensors["scales"]
    q = _unpack_columns(qweight, AWQ_ORDER).t().contiguous()  # [N, K]
    out_features, in_features = q.shape
    group = _groups(name, in_features, out_features, scales, group_size)
    zeros = _unpack_columns(qzeros, AWQ_ORDER)[:, :out_features]
    return Int4Weights(q, scales.float().t().contiguous(), zeros.t().contiguous(), group)


def unpack_compressed_tensors(name: str, tensors: dict[str, torch.Tensor], group_size: int) -> Int4Weights:
    """One linear's compressed-tensors pack-quantized tensors as Int4Weights (zero point 8: the
    signed values were stored + 8)."""
    packed, scales = tensors["weight_packed"], tensors["weight_scale"]
    out_features, in_features = (int(size) for size in tensors["weight_shape"])
    q = _unpack_columns(packed)[:, :in_features].contiguous()  # [N, K]
    if q.shape != (out_features, in_features):
        raise ConfigError(f"{name}: weight_packed {tuple(packed.shape)} does not hold weight_shape "
                          f"{(out_features, in_features)}")
    group = _groups(name, in_features, out_features, scales.t(), group_size)
    return Int4Weights(q, scales.float().contiguous(), torch.full_like(scales, SYMMETRIC_ZERO, dtype=torch.uint8),
                       group)


_UNPACK = {"gptq": unpack_gptq, "awq": unpack_awq, "compressed-tensors": unpack_compressed_tensors}


def _read_safetensors(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for path in sorted(Path(model_dir).glob("*.safetensors")):
        state.update(load_file(str(path)))
    return state


def load_int4_model(model_dir: Path, dtype: torch.dtype, checkpoint: Int4Checkpoint, loader: Any) -> Any:
    """The Hugging Face model of an int4 checkpoint with its float tensors loaded and
    `checkpoint.tensors` filled with each quantized linear's Int4Weights (keyed by module name).
    The quantized modules keep an initialised float weight until the decoder swaps them
    (quantize_linears)."""
    from transformers import AutoConfig

    hf_config = AutoConfig.from_pretrained(model_dir)
    for holder in (hf_config, getattr(hf_config, "text_config", None)):
        if holder is not None and getattr(holder, "quantization_config", None) is not None:
            del holder.quantization_config  # transformers would look for the quantization's library to run it
    model = loader.from_config(hf_config, dtype=dtype)
    state = _read_safetensors(model_dir)
    marker = "." + PACKED_TENSOR[checkpoint.method]
    quantized = {key.removesuffix(marker) for key in state if key.endswith(marker)}
    unpack = _UNPACK[checkpoint.method]
    for name in sorted(quantized):
        parts = {suffix: state.pop(f"{name}.{suffix}") for suffix in INT4_TENSORS if f"{name}.{suffix}" in state}
        checkpoint.tensors[name] = unpack(name, parts, checkpoint.group_size)
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
