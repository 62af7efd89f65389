"""The CPU class a run is labelled with, from the flags each class's CPUs report."""

from __future__ import annotations

import pytest

from tito import cpu_isa

AVX2_FLAGS = "fpu sse sse2 ssse3 sse4_1 sse4_2 avx f16c fma avx2 bmi1 bmi2"
AVX512_FLAGS = AVX2_FLAGS + " avx512f avx512dq avx512cd avx512bw avx512vl avx512_vnni"


@pytest.mark.parametrize(("flags", "expected"), [
    (AVX2_FLAGS, cpu_isa.AVX2),
    (AVX512_FLAGS, cpu_isa.AVX512),
    (AVX512_FLAGS + " avx512_bf16", cpu_isa.AVX512_BF16),
    (AVX512_FLAGS + " avx512_bf16 amx_bf16 amx_tile amx_int8", cpu_isa.AMX),
])
def test_each_class_is_named_from_its_flags(tmp_path, flags, expected):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: {flags}\n\nprocessor\t: 1\n")
    assert cpu_isa.hardware_class(cpu_isa.cpu_flags(cpuinfo)) == expected


def test_a_machine_without_cpuinfo_is_named_by_its_architecture(tmp_path, monkeypatch):
    monkeypatch.setattr(cpu_isa.platform, "machine", lambda: "arm64")
    assert cpu_isa.cpu_flags(tmp_path / "missing") == frozenset()
    assert cpu_isa.hardware_class(frozenset()) == "arm64"


def test_the_description_says_what_torch_computes_natively(monkeypatch):
    monkeypatch.setattr(cpu_isa, "cpu_supports", lambda dtype: False)
    assert cpu_isa.describe().endswith("no native bf16")
    monkeypatch.setattr(cpu_isa, "cpu_supports", lambda dtype: True)
    assert cpu_isa.describe().endswith(", native bf16")
