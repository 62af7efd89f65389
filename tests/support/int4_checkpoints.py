"""Write a float checkpoint again in an int4 layout, as the quantization tools save it (the layouts
vLLM's `auto_gptq`, `auto_awq` and `compressed_tensors` quantization modules load), bit by bit:

GPTQ (AutoGPTQ / GPTQModel): per quantized linear `qweight` int32 [K / 8, N] packed along the
inputs, `qzeros` int32 [groups, N / 8] packed along the outputs holding zero - 1, `scales` float16
[groups, N], `g_idx` int32 [K]; symmetric (scale = 2 max|w| / 15 per group, zero point 8).
AWQ (AutoAWQ gemm): `qweight` int32 [K, N / 8] and `qzeros` int32 [groups, N / 8] packed along the
outputs in AWQ's order (nibble p of column c holds output 8c + (0, 2, 4, 6, 1, 3, 5, 7)[p]),
`scales` float16 [groups, N]; asymmetric (min-max per group, zero points 0..15).
compressed-tensors pack-quantized (llm-compressor W4A16): `weight_packed` int32 [N, K / 8] packed
along the inputs, the signed values + 8; `weight_scale` [N, groups]; `weight_shape` int64 (N, K);
symmetric as GPTQ.
Both with `quantization_config` in config.json.

The quantization is plain round-to-nearest, without the tools' error feedback: the loader is what
is tested, and it reads any values. The integer values, scales and zero points are returned too,
so a test's reference never goes through the packing it checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)


def quantize_gptq(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int [N, K] in 0..15, scales float16 [N, groups], zeros int [N, groups] all 8)."""
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // group, group)
    scales = (grouped.abs().amax(-1) * 2 / 15).clamp_min(1e-6).half()
    q = torch.clamp(torch.round(grouped / scales.float()[..., None]) + 8, 0, 15).reshape(out_features, in_features)
    return q.int(), scales, torch.full(scales.shape, 8, dtype=torch.int32)


def quantize_awq(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q int [N, K] in 0..15, scales float16 [N, groups], zeros int [N, groups] in 0..15)."""
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // group, group)
    low, high = grouped.amin(-1).clamp(max=0), grouped.amax(-1).clamp(min=0)
    scales = ((high - low) / 15).clamp_min(1e-6).half()
    zeros = torch.clamp(torch.round(-low / scales.float()), 0, 15)
    q = torch.clamp(torch.round(grouped / scales.float()[..., None]) + zeros[..., None], 0, 15)
    return q.reshape(out_features, in_features).int(), scales, zeros.int()


def _pack_along_columns(values: torch.Tensor, order: tuple[int, ...]) -> torch.Tensor:
    """int [R, C * 8] -> int32 [R, C]: nibble p of column c holds column 8c + order[p]."""
    packed = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int32)
    for place, column in enumerate(order):
        packed |= values[:, column::8].int() << (4 * place)
    return packed


def pack_gptq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    out_features, in_features = q.shape
    qt = q.t().contiguous()  # [K, N]
    qweight = torch.zeros(in_features // 8, out_features, dtype=torch.int32)
    for j in range(8):
        qweight |= qt[j::8] << (4 * j)
    qzeros = _pack_along_columns(zeros.t() - 1, tuple(range(8)))  # the "gptq" format stores zero - 1
    g_idx = torch.tensor([k // group for k in range(in_features)], dtype=torch.int32)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous(), "g_idx": g_idx}


def pack_awq(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    return {"qweight": _pack_along_columns(q.t().contiguous(), AWQ_ORDER),
            "qzeros": _pack_along_columns(zeros.t().contiguous(), AWQ_ORDER), "scales": scales.t().contiguous()}


def pack_compressed_tensors(q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                            group: int) -> dict[str, torch.Tensor]:
    return {"weight_packed": _pack_along_columns(q, tuple(range(8))), "weight_scale": scales.contiguous(),
            "weight_shape": torch.tensor(q.shape, dtype=torch.int64)}


def _compressed_tensors_config(group: int) -> dict:
    weights = {"num_bits": 4, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
               "dynamic": False, "actorder": None, "observer": "minmax"}
    return {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
            "config_groups": {"group_0": {"targets": ["Linear"], "weights": weights, "input_activations": None,
                                          "output_activations": None}},
            "ignore": ["lm_head"]}


FORMATS = {
    "gptq": (quantize_gptq, pack_gptq, lambda group: {"quant_method": "gptq", "bits": 4, "group_size": group,
                                                      "desc_act": False, "sym": True, "checkpoint_format": "gptq"}),
    "awq": (quantize_awq, pack_awq, lambda group: {"quant_method": "awq", "bits": 4, "group_size": group,
                                                   "zero_point": True, "version": "gemm"}),
    "compressed-tensors": (quantize_gptq, pack_compressed_tensors, _compressed_tensors_config),
}


def write_int4_checkpoint(model_dir: Path, out_dir: Path, method: str, group: int,
                          **config_overrides) -> dict[str, tuple]:
    """`model_dir` written to `out_dir` in `method`'s layout; {module: (q [N, K], scales, zeros [N, groups])}."""
    from safetensors.torch import load_file, save_file

    quantize, pack, settings = FORMATS[method]
    out_dir.mkdir(parents=True, exist_ok=True)
    state = load_file(str(model_dir / "model.safetensors"))
    written, values = {}, {}
    for key, tensor in state.items():
        module, _, suffix = key.rpartition(".")
        if suffix == "weight" and module.rpartition(".")[2] in PROJECTIONS:
            values[module] = quantize(tensor, group)
            written.update({f"{module}.{name}": packed for name, packed in pack(*values[module], group).items()})
        else:
            written[key] = tensor
    save_file(written, str(out_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {**settings(group), **config_overrides}
    (out_dir / "config.json").write_text(json.dumps(config))
    for path in model_dir.iterdir():
        if path.name not in ("config.json", "model.safetensors") and path.is_file():
            shutil.copy(path, out_dir / path.name)
    return values
