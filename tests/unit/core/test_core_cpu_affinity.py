"""CPU lists, and how the engine splits the CPUs between its core process and its server."""

from __future__ import annotations

import pytest

from tito.config import ConfigError
from tito.cpu_affinity import format_cpu_list, parse_cpu_list, split_for_core
from tito_engine.config import EngineConfig
from tito_engine.model.cpu_runtime import core_cpu_plan


def test_cpu_lists_read_and_write_as_the_kernel_writes_them():
    assert parse_cpu_list("0-3,6") == {0, 1, 2, 3, 6}
    assert parse_cpu_list(" 2 ") == {2}
    assert format_cpu_list({0, 1, 2, 3, 6, 8, 9}) == "0-3,6,8-9"
    assert format_cpu_list(parse_cpu_list("5,1-2")) == "1-2,5"
    for bad in ("", "a", "3-1", "-1", "1,,2"):
        with pytest.raises(ConfigError, match="e.g. 0-3,6"):
            parse_cpu_list(bad)


def test_the_core_takes_the_last_cpus_and_leaves_the_server_the_rest():
    assert split_for_core(1, frozenset({0, 1})) == ({1}, {0})
    assert split_for_core(3, frozenset(range(8))) == ({5, 6, 7}, {0, 1, 2, 3, 4})
    assert split_for_core(2, frozenset({4, 9})) is None  # nothing left for the server: no pinning
    assert core_cpu_plan("auto", "2-5", None) == ({3, 4, 5}, {2})  # threads default: all but one
    assert core_cpu_plan("auto", "2-5", 2) == ({4, 5}, {2, 3})
    assert core_cpu_plan("auto", "3", None) == (None, None)  # one CPU: nothing to split
    assert core_cpu_plan("none", "", None) == (None, None)
    assert core_cpu_plan("1", "0-1", None) == ({1}, {0})
    assert core_cpu_plan("0-1", "0-1", None) == ({0, 1}, None)  # the server stays where it is


def test_engine_cpu_settings_are_checked_at_start_up():
    with pytest.raises(ConfigError, match="--core-cpus 'x'"):
        EngineConfig(core_cpus="x").validate()
    with pytest.raises(ConfigError, match="--cpu-affinity 99999: this process may only use CPUs"):
        EngineConfig(cpu_affinity="99999").validate()
    with pytest.raises(ConfigError, match="--core-cpus applies to the native backend only"):
        EngineConfig(backend="vllm", core_cpus="0").validate()
    assert EngineConfig(backend="vllm").core_cpu_plan() == (None, None)
    assert EngineConfig(engine_process=False).core_cpu_plan() == (None, None)


def test_nothing_is_pinned_where_the_os_has_no_cpu_affinity(monkeypatch):
    monkeypatch.delattr("os.sched_setaffinity")
    core_cpu_plan.cache_clear()  # worked out once per process: forget this test's answer afterwards too
    try:
        assert core_cpu_plan("auto", "", None) == (None, None)
    finally:
        core_cpu_plan.cache_clear()


def test_packed_linears_are_a_native_setting_passed_to_the_core():
    from tito_engine.core.engine_core import CoreProcessSpec

    assert EngineConfig().packs_linears and not EngineConfig(cpu_packed_linears=False).packs_linears
    spec = CoreProcessSpec.from_config(EngineConfig(cpu_packed_linears=False), "dir", None)
    assert spec.packed_linears is False
    with pytest.raises(ConfigError, match="--cpu-packed-linears / --no-cpu-packed-linears apply to the native"):
        EngineConfig(backend="vllm", cpu_packed_linears=False).validate()
