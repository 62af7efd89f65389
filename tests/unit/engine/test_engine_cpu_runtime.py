"""The engine process's CPU settings: glibc keeps the memory a step frees for the next step."""

from __future__ import annotations

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
