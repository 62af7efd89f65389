"""int4 linears (group-wise, symmetric: GPTQ's 4-bit layout, gptq.py), activations in the compute dtype.

* CPU, bfloat16 / float16: torch's `_weight_int4pack_mm_for_cpu` on the weight repacked once into
  its layout (half a byte per weight, group scales beside it);
* CPU float32 and CUDA: the weight kept as one byte per value and dequantized to the compute dtype
  per call, then a plain matmul: correct everywhere, memory-bound on the dequantized copy (torch's
  int4 CPU kernel is not vectorized for float32 activations: ~40 ms for a [1, 896] x [4864, 896] call
  measured here). Compute in bfloat16 (`--dtype bfloat16`) for int4's speed on CPU.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tito_engine.model.quantization.gptq import SYMMETRIC_ZERO, Int4Weights


def _packs_for_cpu(dtype: torch.dtype, device: torch.device, weights: Int4Weights) -> bool:
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16)
            and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and weights.q.shape[1] % 2 == 0)


class Int4Linear:
    """y = x W^T + b with W = (q - 8) * group scales (see the module docstring)."""

    __slots__ = ("weights", "bias", "shape", "dtype", "_packed", "_scales_and_zeros")

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        self.shape = tuple(weights.q.shape)
        self.bias = None if bias is None else bias.detach().to(device, dtype)
        self.dtype = dtype
        self._packed = None
        if _packs_for_cpu(dtype, device, weights):
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weights.q.int(), 1)
            scales = weights.scales.t().contiguous()  # [groups, N]
            # torch's kernel computes (q - 8) * scale + zero: the symmetric zero point is its own.
            self._scales_and_zeros = torch.stack([scales, torch.zeros_like(scales)], dim=-1).to(dtype)
            self.weights = Int4Weights(torch.empty(0, dtype=torch.uint8), weights.scales, weights.group_size)
        else:
            self.weights = Int4Weights(weights.q.to(device), weights.scales.to(device), weights.group_size)

    @property
    def weight_bytes(self) -> int:
        """Bytes a call reads of this weight: the int4 values (half a byte each when packed) and scales."""
        values = self.shape[0] * self.shape[1]
        return (values // 2 if self._packed is not None else values) + self.weights.scales.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self._packed, self.weights.group_size,
                                                            self._scales_and_zeros)
        else:
            scales = self.weights.scales.to(x.dtype).repeat_interleave(self.weights.group_size, dim=1)
            y = F.linear(x, (self.weights.q.to(x.dtype) - SYMMETRIC_ZERO) * scales)
        return y if self.bias is None else y + self.bias
