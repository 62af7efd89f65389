"""Write a float checkpoint again in GPTQ's int4 layout, as AutoGPTQ / GPTQModel save it (the layout
vLLM's `quantization/auto_gptq.py` loads): per quantized linear `qweight` int32 [K / 8, N] packed
along the inputs, `qzeros` int32 [groups, N / 8] packed along the outputs holding zero - 1,
`scales` float16 [groups, N], `g_idx` int32 [K], and `quantization_config` in config.json.

The quantization is GPTQ's symmetric min-max one (scale = 2 * max|w| / 15 per group, zero point
8, q = clamp(round(w / scale) + 8, 0, 15)), without GPTQ's error feedback: the loader is what is
tested, and it reads any values. The integer values and scales are returned too, so a test's
reference never goes through the packing it checks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def quantize_group_sym(weight: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int [N, K] in 0..15, scales float16 [N, K / group])."""
    out_features, in_features = weight.shape
    grouped = weight.float().reshape(out_features, in_features // group, group)
    scales = (grouped.abs().amax(-1) * 2 / 15).clamp_min(1e-6).half()
    q = torch.clamp(torch.round(grouped / scales.float()[..., None]) + 8, 0, 15).reshape(out_features, in_features)
    return q.int(), scales


def pack_gptq(q: torch.Tensor, scales: torch.Tensor, group: int) -> dict[str, torch.Tensor]:
    """GPTQ's tensors of one linear from q [N, K] (0..15) and scales [N, groups], bit by bit."""
    out_features, in_features = q.shape
    qt = q.t().contiguous()  # [K, N]
    qweight = torch.zeros(in_features // 8, out_features, dtype=torch.int32)
    for j in range(8):
        qweight |= qt[j::8] << (4 * j)
    groups = in_features // group
    stored_zero = torch.full((groups, out_features), 7, dtype=torch.int32)  # zero point 8, stored minus one
    qzeros = torch.zeros(groups, out_features // 8, dtype=torch.int32)
    for j in range(8):
        qzeros |= stored_zero[:, j::8] << (4 * j)
    g_idx = torch.tensor([k // group for k in range(in_features)], dtype=torch.int32)
    return {"qweight": qweight, "qzeros": qzeros, "scales": scales.t().contiguous(), "g_idx": g_idx}


def write_gptq_checkpoint(model_dir: Path, out_dir: Path, group: int, **config_overrides) -> dict[str, tuple]:
    """`model_dir` written to `out_dir` in GPTQ's layout; {module name: (q [N, K], scales [N, groups])}."""
    from safetensors.torch import load_file, save_file

    out_dir.mkdir(parents=True, exist_ok=True)
    state = load_file(str(model_dir / "model.safetensors"))
    written, values = {}, {}
    for key, tensor in state.items():
        module, _, suffix = key.rpartition(".")
        if suffix == "weight" and module.rpartition(".")[2] in PROJECTIONS:
            q, scales = quantize_group_sym(tensor, group)
            values[module] = (q, scales)
            written.update({f"{module}.{name}": packed for name, packed in pack_gptq(q, scales, group).items()})
        else:
            written[key] = tensor
    save_file(written, str(out_dir / "model.safetensors"))
    config = json.loads((model_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gptq", "bits": 4, "group_size": group, "desc_act": False,
                                     "sym": True, "checkpoint_format": "gptq", **config_overrides}
    (out_dir / "config.json").write_text(json.dumps(config))
    for path in model_dir.iterdir():
        if path.name not in ("config.json", "model.safetensors") and path.is_file():
            shutil.copy(path, out_dir / path.name)
    return values
