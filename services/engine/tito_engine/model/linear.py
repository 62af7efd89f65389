"""The linear layers of the forward, through oneDNN's prepacked weights on CPU where that is faster.

`torch.nn.functional.linear` on CPU runs MKL's sgemm on a float32 weight as stored (a bfloat16
one goes to oneDNN unpacked). oneDNN with the weight reordered once into its blocked layout
(`torch.ops.mkldnn._reorder_linear_weight`, what PyTorch's own CPU compiler uses for linears;
vLLM's CPU backend packs its weights for oneDNN the same way) is measured here at 2.3x faster for
a step's 32 rows ([32, 256] x [256, 2048]: 369 -> 163 us) and for prefills (300 rows: 3.2 -> 1.4
ms), but costs about 10 us more per call: a one-row decode over a small matrix is faster unpacked.
In bfloat16 (AMX / AVX512-BF16 kernels) the packed layout is as fast or faster at every row count
measured (a 151,936 x 896 output layer: 46 against 65 ms at 1 row, even at 32).

So a small float32 weight keeps both and each call picks by the work (`PACKED_MIN_MACS`); a weight
large enough that even one row takes the packed path, and every bfloat16 weight (F.linear goes
through oneDNN there too, at the same cost per call), keeps only the packed copy (`release_plain`: the
plain one, and the Hugging Face module's view of it, are freed), so a real-size model is held
once. An output layer tied to the embedding cannot give its plain copy up (the embedding reads
rows of it): it is packed in float32 only, where the packed path is much faster (32 rows of
Qwen2.5-0.5B's head: 159 against 271 ms), and left unpacked in half precision, where oneDNN runs
it unpacked about as fast.

`--no-cpu-packed-linears` keeps the plain weights and the unpacked path. Results agree with
F.linear to the dtype's rounding (the sums are accumulated in another order), as two BLAS
libraries do; greedy decoding matches HF wherever the top two logits are not within that rounding.

`wide_linears(threads)`: while it is open, a call over `WIDE_MIN_ROWS` rows or more runs on
`threads` torch threads instead of the process's usual count. The runner opens it for a lone
prefill, when the CPUs the engine's server runs on sit idle (cpu_runtime.lend_cpus_to_lone_prefill):
only the linears, since the step's elementwise ops (norms, activations, RoPE) got slower spread over
two CPUs (measured on 2 cores, 138 rows: mul 16 -> 47 us a call) while the linears got 1.6x faster.
The split is along rows and columns, never the sum, so the results are the same bits either way.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterable, Iterator

import torch
import torch.nn.functional as F

log = logging.getLogger(__name__)

#: Multiply-adds (rows x out x in) from which a call takes the packed weight: below it oneDNN's fixed
#: cost per call (~10 us) outweighs its faster arithmetic (measured: [1, 256] x [256, 2048] is
#: 34 us unpacked against 39 us packed; [2, 256] x [256, 2048] 59 against 38 us).
PACKED_MIN_MACS = 1 << 20
#: Rows from which a call inside `wide_linears` takes the wider thread count: a prompt shorter than
#: this costs little either way, and a decode row never reaches it.
WIDE_MIN_ROWS = 64


class _WideThreads:
    """The thread count of `wide_linears` (0: none open) and the count to go back to."""

    threads = 0
    usual = 1


_wide = _WideThreads()


@contextlib.contextmanager
def wide_linears(threads: int) -> Iterator[None]:
    """Linears of `WIDE_MIN_ROWS` rows or more run on `threads` torch threads until the block ends
    (one block at a time: the engine core runs one step at a time)."""
    _wide.threads, _wide.usual = threads, torch.get_num_threads()
    try:
        yield
    finally:
        _wide.threads = 0


class Linear:
    """y = x W^T + b for x of shape [rows, in]. `sources`: the modules whose `weight` is (a view
    of) this weight, freed with it by `release_plain`."""

    __slots__ = ("weight", "bias", "sources", "_packed", "_packed_min_rows", "shape")

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, sources: tuple = ()):
        self.weight, self.bias, self.sources = weight, bias, tuple(sources)
        self.shape = tuple(weight.shape)
        self._packed: torch.Tensor | None = None
        self._packed_min_rows = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if _wide.threads and x.shape[0] >= WIDE_MIN_ROWS:
            return self._wide_call(x)
        return self._call(x)

    def _call(self, x: torch.Tensor) -> torch.Tensor:
        if self._packed is not None and x.shape[0] >= self._packed_min_rows:
            return torch.ops.mkldnn._linear_pointwise(x, self._packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)

    def _wide_call(self, x: torch.Tensor) -> torch.Tensor:
        torch.set_num_threads(_wide.threads)  # ~0.1 us: it sets the count the next parallel region takes
        try:
            return self._call(x)
        finally:
            torch.set_num_threads(_wide.usual)

    @property
    def weight_bytes(self) -> int:
        """Bytes a call reads of this weight (either copy: the same values in another layout)."""
        dtype = self.weight.dtype if self.weight is not None else self._packed.dtype
        return self.shape[0] * self.shape[1] * dtype.itemsize

    def pack(self) -> int:
        """Keep a copy of the weight in oneDNN's layout; its size in bytes."""
        out_features, in_features = self.shape
        self._packed = torch.ops.mkldnn._reorder_linear_weight(self.weight.detach())
        # Half precision: F.linear runs oneDNN too (its call costs the same), packed is never slower.
        self._packed_min_rows = 1
        if self.weight.dtype == torch.float32:
            self._packed_min_rows = max(1, -(-PACKED_MIN_MACS // (out_features * in_features)))
        return self.weight.numel() * self.weight.element_size()

    def release_plain(self) -> int:
        """Free the plain weight when every call takes the packed one (and the modules in `sources`
        share it): the bytes freed, 0 when both copies stay."""
        if self._packed is None or self._packed_min_rows > 1 or not self.sources:
            return 0
        freed = self.weight.numel() * self.weight.element_size()
        for module in self.sources:
            module.weight = torch.nn.Parameter(torch.empty(0, dtype=self.weight.dtype), requires_grad=False)
        self.weight = None
        return freed


def can_pack(weight: torch.Tensor) -> bool:
    """Whether this torch build and the weight's device and dtype allow packed linears."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


#: How far a packed probe may be from F.linear (relative to the output's norm): float32 rounding,
#: or bfloat16's 8-bit mantissa.
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _agrees(got: torch.Tensor, expected: torch.Tensor) -> bool:
    error = (got.float() - expected.float()).norm() / expected.float().norm().clamp_min(1e-30)
    return bool(error <= _PROBE_TOLERANCE[expected.dtype])


def pack_linears(linears: Iterable[Linear], release_plain: bool = False) -> tuple[int, int]:
    """Pack every linear (see the module docstring): (bytes the packed copies take, bytes of plain
    weights freed by `release_plain`), (0, 0) when this build or device has no packed path. A
    packed path that disagrees with F.linear on a probe is not used (logged): the unpacked one is
    always correct."""
    linears = [linear for linear in linears if isinstance(linear, Linear)]  # quantized ones have their own kernels
    if not linears or not can_pack(linears[0].weight):
        return 0, 0
    probe = linears[0]
    with torch.inference_mode():
        x = torch.randn(16, probe.shape[1], generator=torch.Generator().manual_seed(0)).to(probe.weight.dtype)
        expected = F.linear(x, probe.weight, probe.bias)
        try:
            probe.pack()
            got = probe(x)
        except RuntimeError as exc:  # a build whose oneDNN refuses this CPU or dtype
            log.warning("packed linears are unavailable (%s); using unpacked weights", exc)
            probe._packed = None
            return 0, 0
        if not _agrees(got, expected):
            log.warning("packed linears disagree with F.linear on a probe; using unpacked weights")
            probe._packed = None
            return 0, 0
    packed = sum(linear.pack() for linear in linears)
    freed = sum(linear.release_plain() for linear in linears) if release_plain else 0
    return packed, freed
