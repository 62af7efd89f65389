"""The engine process's CPU settings: glibc keeps the memory a step frees for the next step, a
lone prefill's linears borrow the server's CPUs, and a core whose threads share CPUs starts with
OpenMP's passive wait."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap

import pytest

# In a fresh process: the allocator's state in this test process depends on every earlier test.
FREE_THEN_KEEPCOST = textwrap.dedent("""
    import ctypes, sys
    from tito_engine.model.cpu_runtime import keep_freed_memory

    class MallInfo2(ctypes.Structure):
        _fields_ = [(name, ctypes.c_size_t) for name in (
            "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
            "keepcost")]

    libc = ctypes.CDLL(None)
    libc.mallinfo2.restype = MallInfo2
    libc.malloc.restype = ctypes.c_void_p
    libc.free.argtypes = [ctypes.c_void_p]
    if sys.argv[1] == "engine":
        assert keep_freed_memory()
    block = libc.malloc(8 << 20)  # a step's activations, say
    ctypes.memset(block, 1, 8 << 20)
    libc.free(block)
    print(libc.mallinfo2().keepcost)  # freed memory at the top of the heap, still the process's
""")


def keepcost_after_a_free(mode: str) -> int:
    done = subprocess.run([sys.executable, "-c", FREE_THEN_KEEPCOST, mode], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    return int(done.stdout.split()[-1])


@pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc", reason="glibc's allocator")
def test_memory_a_step_frees_stays_for_the_next_step():
    """glibc's defaults hand a freed 8 MiB block straight back to the system (the next step faults
    it in again: measured ~700 page faults and a 3x slower forward at 32 decode rows on the d64
    tiny model); with the engine's settings it stays in the heap."""
    assert keepcost_after_a_free("engine") >= 8 << 20
    assert keepcost_after_a_free("glibc-defaults") < 1 << 20


# In a fresh process: it starts torch's threads and moves one, which must not outlive the test.
LEND_A_CPU = textwrap.dedent("""
    import os, sys, torch
    from tito_engine.model.cpu_runtime import lend_cpus_to_lone_prefill

    own, lent = int(sys.argv[1]), int(sys.argv[2])
    os.sched_setaffinity(0, {own})  # the core's CPU: torch's threads would inherit it
    torch.set_num_threads(1)
    before = set(os.listdir("/proc/self/task"))
    threads = lend_cpus_to_lone_prefill(frozenset({lent}))
    started = set(os.listdir("/proc/self/task")) - before
    print(threads, torch.get_num_threads(), sorted(os.sched_getaffinity(0)),
          [sorted(os.sched_getaffinity(int(t))) for t in started])
""")


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2
                    or not os.path.isdir("/proc/self/task"), reason="needs per-thread CPU affinity and two CPUs")
def test_a_lone_prefill_gets_a_thread_on_the_lent_cpu_and_the_core_keeps_its_own():
    own, lent = sorted(os.sched_getaffinity(0))[:2]
    done = subprocess.run([sys.executable, "-c", LEND_A_CPU, str(own), str(lent)], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    threads, usual, main, started = done.stdout.split(maxsplit=3)
    assert (int(threads), int(usual), main) == (2, 1, f"[{own}]")
    assert f"[{lent}]" in started  # the OpenMP thread it started runs on the lent CPU


def test_nothing_is_lent_without_cpus_or_per_thread_affinity(monkeypatch):
    from tito_engine.model.cpu_runtime import lend_cpus_to_lone_prefill

    assert lend_cpus_to_lone_prefill(frozenset()) == 0
    monkeypatch.delattr("os.sched_setaffinity", raising=False)
    assert lend_cpus_to_lone_prefill(frozenset({0})) == 0


def _plan(threads: int, core: set[int] | None, server: set[int] | None):
    from tito_engine.model.cpu_runtime import CpuPlan

    return CpuPlan(threads, None if core is None else frozenset(core), None if server is None else frozenset(server),
                   "test")


@pytest.mark.parametrize("core, server", [(None, None), ({0, 1}, {1})], ids=["not pinned", "pinned over the server"])
def test_a_core_of_several_threads_on_shared_cpus_starts_with_a_passive_openmp_wait(core, server):
    from tito_engine.model.cpu_runtime import core_omp_environment

    assert core_omp_environment(_plan(2, core, server), {}) == {"OMP_WAIT_POLICY": "PASSIVE"}


@pytest.mark.parametrize("plan, environ", [
    ((1, None, None), {}),  # one thread: no parallel region to wait between
    ((2, {0, 1}, {2}), {}),  # CPUs of its own: spinning is the faster wait
    ((2, None, None), {"OMP_WAIT_POLICY": "ACTIVE"}),  # the operator's choice stands
    ((2, None, None), {"GOMP_SPINCOUNT": "100000"}),
], ids=["one thread", "cpus of its own", "OMP_WAIT_POLICY set", "GOMP_SPINCOUNT set"])
def test_the_openmp_wait_is_left_alone_otherwise(plan, environ):
    from tito_engine.model.cpu_runtime import core_omp_environment

    assert core_omp_environment(_plan(*plan), environ) == {}


def test_the_core_process_inherits_the_wait_its_plan_asks_for(monkeypatch):
    from tito_engine.core.engine_core import CoreProcessSpec, _set_core_environment
    from tito_engine.limits import SchedulerLimits

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    monkeypatch.delenv("GOMP_SPINCOUNT", raising=False)
    spec = CoreProcessSpec(model_dir="m", model_id="m", device="cpu", max_model_len=None, kv_cache=None,
                           limits=SchedulerLimits(), cpu_plan=_plan(2, None, None))
    _set_core_environment(spec)  # what a spawned child starts with: this process's environment
    assert os.environ.get("OMP_WAIT_POLICY") == "PASSIVE"
