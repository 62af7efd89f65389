"""int4 linears (group-wise, a zero point per group: GPTQ's, AWQ's and compressed-tensors' layouts,
int4_checkpoint.py), activations in the compute dtype.

* CPU, bfloat16 / float16: torch's `_weight_int4pack_mm_for_cpu` on the weight repacked once into
  its layout (half a byte per weight, group scales beside it);
* CPU, float32: the values held as int8 (q - zero, one byte each) and tito's int8 kernel with a scale
  per group (int8_kernel.py: torch's int4 CPU kernel is not vectorized for float32 activations,
  ~40 ms for a [1, 896] x [4864, 896] call measured here);
* CUDA, or no C compiler: the weight dequantized to the compute dtype per call, then a plain
  matmul: correct everywhere, memory-bound on the dequantized copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tito_engine.model.quantization.int4_checkpoint import SYMMETRIC_ZERO, Int4Weights
from tito_engine.model.quantization.int8_kernel import load_int8_kernel


def _packs_for_cpu(dtype: torch.dtype, device: torch.device, weights: Int4Weights) -> bool:
    """Whether torch's int4 CPU kernel takes this weight (its packing needs N % 16 == 0, K even)."""
    out_features, in_features = weights.q.shape
    return (device.type == "cpu" and dtype in (torch.bfloat16, torch.float16) and out_features % 16 == 0
            and in_features % 2 == 0 and hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"))


class Int4Linear:
    """y = x W^T + b with W = (q - zero) * scale per group (see the module docstring)."""

    __slots__ = ("centred", "scales", "group_size", "bias", "shape", "_packed", "_scales_and_zeros", "_kernel")

    def __init__(self, weights: Int4Weights, bias: torch.Tensor | None, dtype: torch.dtype, device: torch.device):
        self.shape = tuple(weights.q.shape)
        self.bias = None if bias is None else bias.detach().to(device, dtype)
        self.group_size = weights.group_size
        self.scales = weights.scales.to(device).contiguous()  # float32 [N, groups]
        self._packed = self._scales_and_zeros = self._kernel = None
        self.centred = torch.empty(0, dtype=torch.int8)
        if _packs_for_cpu(dtype, device, weights):
            self._packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(weights.q.int(), 1)
            scales = self.scales.t().contiguous()  # [groups, N]
            # torch's kernel computes (q - 8) * scale + offset: (q - zero) * scale needs (8 - zero) * scale.
            offsets = (SYMMETRIC_ZERO - weights.zeros.t().float()) * scales
            self._scales_and_zeros = torch.stack([scales, offsets], dim=-1).to(dtype)
            return
        self.centred = weights.centred().to(device)  # [N, K] in -15..15
        if device.type == "cpu" and dtype == torch.float32:
            kernel = load_int8_kernel()
            self._kernel = kernel if kernel is not None and kernel.takes(self.shape[1], self.group_size) else None

    @property
    def weight_bytes(self) -> int:
        """Bytes a call reads of this weight: the values (half a byte each when packed, else one) and scales."""
        values = self.shape[0] * self.shape[1]
        return (values // 2 if self._packed is not None else values) + self.scales.numel() * 4

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return self._kernel.linear(x, self.centred, self.scales, self.bias)
        if self._packed is not None:
            y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self._packed, self.group_size,
                                                            self._scales_and_zeros)
        else:
            y = F.linear(x, self.centred.to(x.dtype) * self.scales.to(x.dtype).repeat_interleave(self.group_size, 1))
        return y if self.bias is None else y + self.bias
