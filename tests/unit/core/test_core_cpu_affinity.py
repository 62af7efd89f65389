"""CPU lists, and how the engine splits the CPUs between its core process and its server."""

from __future__ import annotations

import pytest

from tito.config import ConfigError
from tito.cpu_affinity import format_cpu_list, parse_cpu_list, split_for_core
from tito_engine.config import EngineConfig
from tito_engine.model.cpu_runtime import forward_dominates, forward_macs_per_token, plan_cpus
from tito_engine.startup_plan import plan_startup

TINY = 4_200_000  # multiply-adds per token of tiny-qwen2-h256
REAL = 494_000_000  # Qwen2.5-0.5B's shape


def placement(*args):
    plan = plan_cpus(*args)
    return plan.threads, plan.core_cpus, plan.server_cpus


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
    # A tiny model: the server's per-token work is near the forward's; it keeps a CPU.
    assert placement("auto", "2-5", None, TINY) == (3, {3, 4, 5}, {2})
    assert placement("auto", "2-5", 2, TINY) == (2, {4, 5}, {2, 3})  # --cpu-threads decides
    assert placement("auto", "3", None, TINY) == (1, None, None)  # one CPU: nothing to split
    assert placement("none", "", 1, TINY) == (1, None, None)
    assert placement("1", "0-1", None, TINY) == (1, {1}, {0})
    assert placement("0-1", "0-1", None, TINY) == (2, {0, 1}, None)  # the server stays where it is
    # A real-size model: the forward dominates, the core computes on every CPU, nothing is pinned.
    assert placement("auto", "0-1", None, REAL) == (2, None, None)
    assert placement("auto", "2-9", None, REAL) == (8, None, None)
    assert placement("auto", "0-1", 1, REAL) == (1, {1}, {0})  # still overridable
    assert placement("2-5", "0-7", None, REAL) == (4, {2, 3, 4, 5}, {0, 1, 6, 7})
    assert placement("auto", "0-1", None, REAL, False) == (2, None, None)  # a core on a thread: no pinning
    assert "every CPU computes" in plan_cpus("auto", "0-1", None, REAL).reason


def test_a_lone_prefill_borrows_the_servers_cpus_when_the_two_are_pinned_apart():
    assert plan_cpus("auto", "0-1", None, TINY).lone_prefill_cpus == {0}
    assert plan_cpus("auto", "2-5", 2, TINY).lone_prefill_cpus == {2, 3}
    assert plan_cpus("1", "0-1", None, TINY).lone_prefill_cpus == {0}  # --core-cpus: the others
    assert plan_cpus("auto", "0-1", None, TINY, True, False).lone_prefill_cpus is None  # the flag off
    # Nothing pinned (one CPU, every CPU computing, --core-cpus none, a core on a thread): nothing to borrow.
    assert plan_cpus("auto", "3", None, TINY).lone_prefill_cpus is None
    assert plan_cpus("auto", "0-1", None, REAL).lone_prefill_cpus is None
    assert plan_cpus("none", "0-1", 1, TINY).lone_prefill_cpus is None
    assert plan_cpus("auto", "0-1", None, TINY, False).lone_prefill_cpus is None
    assert plan_cpus("0-1", "0-1", None, TINY).lone_prefill_cpus is None  # the server has no CPUs of its own
    assert "a lone prefill's linears also on CPUs 0" in plan_cpus("auto", "0-1", None, TINY).describe()


def test_the_work_of_a_token_comes_from_the_config(tiny_text_model, tmp_path):
    # tiny-qwen2: 2 layers of hidden 64 (4 / 2 heads of 16, intermediate 128), 1013 output rows.
    per_layer = 64 * (4 + 2 * 2) * 16 + 64 * 64 + 3 * 64 * 128
    assert forward_macs_per_token(tiny_text_model) == 2 * per_layer + 64 * 1013
    assert forward_macs_per_token(tmp_path) == 0  # no config: unknown, the tiny-model plan
    assert not forward_dominates(TINY) and forward_dominates(REAL) and not forward_dominates(0)


def test_engine_cpu_settings_are_checked_at_start_up():
    with pytest.raises(ConfigError, match="--core-cpus 'x'"):
        EngineConfig(core_cpus="x").validate()
    with pytest.raises(ConfigError, match="--cpu-affinity 99999: this process may only use CPUs"):
        EngineConfig(cpu_affinity="99999").validate()
    with pytest.raises(ConfigError, match="--core-cpus applies to the native backend only"):
        EngineConfig(backend="vllm", core_cpus="0").validate()
    assert plan_startup(EngineConfig(backend="vllm")).cpus is None
    on_a_thread = plan_startup(EngineConfig(engine_process=False, device="cpu")).cpus
    assert (on_a_thread.core_cpus, on_a_thread.server_cpus) == (None, None)
    assert plan_startup(EngineConfig(engine_process=False, device="cpu", cpu_threads=3)).cpus.threads == 3


def test_nothing_is_pinned_where_the_os_has_no_cpu_affinity(monkeypatch):
    monkeypatch.delattr("os.sched_setaffinity")
    assert placement("auto", "", 1, TINY) == (1, None, None)


def test_the_lone_prefill_borrow_is_a_native_setting_passed_to_the_core(tiny_text_model):
    def spec(**flags):
        config = EngineConfig(device="cpu", cpu_affinity="0-1", model=str(tiny_text_model), **flags)
        return plan_startup(config).core_spec(config)

    assert (spec().cpus, spec().cpu_plan.lone_prefill_cpus) == ({1}, {0})
    assert (spec(cpu_lone_prefill_borrow=False).cpus, spec(cpu_lone_prefill_borrow=False).cpu_plan.lone_prefill_cpus
            ) == ({1}, None)
    with pytest.raises(ConfigError, match="--cpu-lone-prefill-borrow / --no-cpu-lone-prefill-borrow apply to the"):
        EngineConfig(backend="vllm", cpu_lone_prefill_borrow=True).validate()


def test_packed_linears_are_a_native_setting_passed_to_the_core():
    assert EngineConfig().packs_linears and not EngineConfig(cpu_packed_linears=False).packs_linears
    config = EngineConfig(cpu_packed_linears=False)
    spec = plan_startup(config).core_spec(config)
    assert spec.packed_linears is False
    with pytest.raises(ConfigError, match="--cpu-packed-linears / --no-cpu-packed-linears apply to the native"):
        EngineConfig(backend="vllm", cpu_packed_linears=False).validate()
