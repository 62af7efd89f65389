"""Weight-only int8: each output channel's weights as int8 with one float32 scale (symmetric:
scale = max |w| / 127, q = round(w / scale)), activations and outputs in the compute dtype.

Computed at load from any float checkpoint (`quantize_per_channel`). A call is
`(x . q^T) * scale + bias`, the scale applied to the sum (the same as dequantizing the weight
first, up to rounding), through the fastest path the device has:

* CPU, bfloat16 / float16: torch's `_weight_int8pack_mm` (oneDNN-free, vectorized for half
  activations on AVX2 and AVX-512);
* CPU, float32: tito's C kernel (int8_kernel.py), else torch's `_weight_int8pack_mm` (correct, but
  not vectorized for float32 activations: ~20x slower than the kernel);
* CUDA: the weight widened to the compute dtype per call and a plain matmul (cuBLAS); correct
  everywhere, it saves memory but not time.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from tito_engine.model.quantization.int8_kernel import Int8Kernel, load_int8_kernel

#: The largest int8 magnitude used: symmetric, so -128 is never produced.
QMAX = 127


def quantize_per_channel(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(q int8 [out, in], scale float32 [out]) with weight ~= q * scale[:, None]; an all-zero row
    gets scale 1 (its q is zero either way)."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1) / QMAX
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.round(w / scale[:, None]).clamp_(-QMAX, QMAX).to(torch.int8)
    return q, scale


def dequantize_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The float32 weight an int8 one stands for (tests compare against a forward on it)."""
    return q.float() * scale[:, None]


class Int8Linear:
    """y = (x q^T) * scale + b for x [rows, in] in the compute dtype (see the module docstring)."""

    __slots__ = ("qweight", "scale", "bias", "shape", "_kernel", "_half_scale")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, kernel: Int8Kernel | None = None):
        self.qweight, self.scale = quantize_per_channel(weight)
        self.qweight, self.scale = self.qweight.to(weight.device), self.scale.to(weight.device)
        self.bias = None if bias is None else bias.detach()
        self.shape = tuple(weight.shape)
        on_cpu_f32 = weight.device.type == "cpu" and weight.dtype == torch.float32
        self._kernel = kernel if on_cpu_f32 and kernel is not None and kernel.takes(self.shape[1]) else None
        # torch's int8 matmul takes its scales in the activations' dtype.
        self._half_scale = self.scale.to(weight.dtype) if weight.dtype != torch.float32 else self.scale

    @property
    def weight_bytes(self) -> int:
        """Bytes a call reads of this weight: the int8 values and their scales."""
        return self.qweight.numel() + self.scale.numel() * self.scale.element_size()

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._kernel is not None:
            return self._kernel.linear(x, self.qweight, self.scale, self.bias)
        if x.device.type == "cuda":
            return F.linear(x, self.qweight.to(x.dtype)) * self._half_scale + (0 if self.bias is None else self.bias)
        y = torch.ops.aten._weight_int8pack_mm(x.contiguous(), self.qweight, self._half_scale)
        return y if self.bias is None else y + self.bias


def int8_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> Int8Linear:
    """An Int8Linear of a float weight, with the C kernel where it serves (CPU, float32)."""
    needs_kernel = weight.device.type == "cpu" and weight.dtype == torch.float32
    return Int8Linear(weight, bias, load_int8_kernel() if needs_kernel else None)
