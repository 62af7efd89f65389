"""The linear layers of the forward, through oneDNN's prepacked weights on CPU where that is faster.

`torch.nn.functional.linear` on CPU runs MKL's sgemm on the weight as stored. oneDNN with the weight
reordered once into its blocked layout (`torch.ops.mkldnn._reorder_linear_weight`, what PyTorch's
own CPU compiler uses for linears; vLLM's CPU backend packs its weights for oneDNN the same way)
is measured here at 2.3x faster for a step's 32 rows ([32, 256] x [256, 2048]: 369 -> 163 us) and for
prefills (300 rows: 3.2 -> 1.4 ms), but costs about 10 us more per call: a one-row decode over a
small matrix is faster unpacked. So each `Linear` keeps both and picks per call by the work
(`PACKED_MIN_MACS`).

The packed copy is extra memory (the linear weights held twice): `--no-cpu-packed-linears` keeps
one copy and the unpacked path. Results agree with F.linear to float32 rounding (the sums are
accumulated in another order), as two BLAS libraries do; greedy decoding matches HF wherever the
top two logits are not within that rounding.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: Multiply-adds (rows x out x in) from which a call takes the packed weight: below it oneDNN's fixed
#: cost per call (~10 us) outweighs its faster arithmetic (measured: [1, 256] x [256, 2048] is
#: 34 us unpacked against 39 us packed; [2, 256] x [256, 2048] 59 against 38 us).
PACKED_MIN_MACS = 1 << 20


class Linear:
    """y = x W^T + b for x of shape [rows, in]."""

    __slots__ = ("weight", "bias", "_packed", "_packed_min_rows")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self._packed: torch.Tensor | None = None
        self._packed_min_rows = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and x.shape[0] >= self._packed_min_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def pack(self) -> int:
        """Keep a copy of the weight in oneDNN's layout; its size in bytes."""
        out_features, in_features = self.weight.shape
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        self._packed_min_rows = max(1, -(-PACKED_MIN_MACS // (out_features * in_features)))
        return self.weight.numel() * self.weight.element_size()


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this torch build and the weight's device and dtype allow packed linears."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


def pack_linears(linears: Iterable[Linear]) -> int:
    """Pack every linear (see the module docstring); the bytes the packed copies take, 0 when this
    build or device has no packed path. A packed path that disagrees with F.linear on a probe is
    not used (logged): the unpacked one is always correct."""
    linears = list(linears)
    if not linears or not can_pack(linears[0].weight):
        return 0
    probe = linears[0]
    with torch.inference_mode():
        x = torch.randn(16, probe.weight.shape[1], generator=torch.Generator().manual_seed(0)).to(probe.weight.dtype)
        expected = F.linear(x, probe.weight, probe.bias)
        try:
            probe.pack()
            got = probe(x)
        except RuntimeError as exc:  # a build whose oneDNN refuses this CPU or dtype
            log.warning("packed linears are unavailable (%s); using unpacked weights", exc)
            probe._packed = None
            return 0
        if not torch.allclose(got, expected, rtol=1e-3, atol=1e-4):
            log.warning("packed linears disagree with F.linear on a probe; using unpacked weights")
            probe._packed = None
            return 0
    return sum(linear.pack() for linear in linears)
