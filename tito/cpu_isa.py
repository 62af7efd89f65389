"""Which class of x86-64 CPU this is, in the words figures and test runs are labelled with, and
whether torch computes a half dtype natively on it.

tito runs on three classes that behave differently: AVX2 only (most laptops and many cloud VMs:
no AVX-512 kernels, no native bfloat16), AVX-512 (the C attention kernels' prefill path), and
AVX-512 with BF16 or AMX (oneDNN computes bfloat16 natively, so `--dtype auto` keeps a bf16
checkpoint in bf16). A figure or a test run means little without the class it was taken on.

What the code uses can be less than what the silicon has: oneDNN's `ONEDNN_MAX_CPU_ISA` and
ATen's `ATEN_CPU_CAPABILITY` cap the kernels torch picks, and `$CFLAGS` (`-mno-avx512f`) caps the
engine's C kernels. With all three an AVX-512 machine runs as an AVX2 one, which is how the suite
is checked for AVX2 machines on an AVX-512 one; `describe()` says both.
"""

from __future__ import annotations

import platform
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

#: The classes, lowest first.
AVX2, AVX512, AVX512_BF16, AMX = "AVX2", "AVX-512", "AVX-512 with BF16", "AMX"


def _cpuinfo_field(names: tuple[str, ...], cpuinfo: Path) -> str:
    try:
        text = cpuinfo.read_text()
    except OSError:
        return ""
    for line in text.splitlines():
        if line.startswith(names):
            return line.partition(":")[2].strip()
    return ""


def cpu_flags(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The feature flags the kernel reports for the first CPU; empty off Linux."""
    return frozenset(_cpuinfo_field(("flags", "Features"), cpuinfo).split())


def hardware_class(flags: frozenset[str]) -> str:
    """The class the CPU's flags put it in; a CPU without AVX2 is named by its architecture."""
    if "amx_tile" in flags and "amx_bf16" in flags:
        return AMX
    if "avx512_bf16" in flags:
        return AVX512_BF16
    if "avx512f" in flags:
        return AVX512
    if "avx2" in flags:
        return AVX2
    return platform.machine() or "unknown"


def cpu_supports(dtype: "torch.dtype") -> bool:
    """Whether this CPU computes `dtype` natively (oneDNN's bf16 / fp16 kernels: AVX512-BF16 or
    AMX for bfloat16, AVX512-FP16 or AMX-FP16 for float16, as capped by ONEDNN_MAX_CPU_ISA);
    float32 always."""
    import torch  # lazily: the common runtime installs without torch (derender has none)

    if dtype == torch.float32:
        return True
    if not torch.backends.mkldnn.is_available():
        return False
    probe = {torch.bfloat16: "_is_mkldnn_bf16_supported", torch.float16: "_is_mkldnn_fp16_supported"}[dtype]
    check = getattr(torch.ops.mkldnn, probe, None)
    try:
        return bool(check()) if check is not None else False
    except RuntimeError:
        return False


def describe() -> str:
    """One line for a test run's header or a benchmark's figures: the hardware class and model,
    then what torch's kernels run at (ATen's capability, oneDNN's bfloat16), which caps lower."""
    import torch

    model = _cpuinfo_field(("model name",), Path("/proc/cpuinfo")) or platform.machine()
    bf16 = "native bf16" if cpu_supports(torch.bfloat16) else "no native bf16"
    return (f"{hardware_class(cpu_flags())} ({model}); torch kernels: "
            f"{torch.backends.cpu.get_cpu_capability()}, {bf16}")
