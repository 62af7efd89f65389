"""How the engine's process runs on CPU: torch's intra-op threads and the C allocator's settings.

Both are process-wide, so they are set once, where the model is loaded (ModelRunner).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import platform

import torch

log = logging.getLogger(__name__)

#: glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Freed memory at the top of the heap kept for the next step instead of returned to the system.
TRIM_THRESHOLD_BYTES = 64 << 20
#: Allocations below this come from the heap (32 MiB: glibc's largest allowed value).
MMAP_THRESHOLD_BYTES = 32 << 20


def default_cpu_threads() -> int:
    """One core less than the machine has: the gRPC threads need one, and intra-op threads that
    wait for a busy core spin (measured on 2 cores with the tiny model: a step took ~10x longer
    with 2 torch threads than with 1 while the event loop was busy)."""
    return max(1, (os.cpu_count() or 2) - 1)


def set_cpu_threads(threads: int | None) -> None:
    threads = threads or default_cpu_threads()
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)
        log.info("torch intra-op threads: %d", threads)


def keep_freed_memory() -> bool:
    """Make glibc keep the memory a step frees for the next step (True when it took the settings).

    Every step allocates and frees the same few megabytes of activations (the gathered K/V of a
    decode batch, logits). With glibc's defaults, a large enough free at the top of the heap is
    handed back to the system (trimmed) and the next step faults every page in again: measured on
    the tiny model at 32 decode rows, a forward took 3.0 ms against 1.0 ms with these settings,
    while 24 rows stayed under the limit and took 0.8 ms either way. Fixing the mmap threshold too
    keeps glibc from moving it (which would bring the trimming back)."""
    if platform.system() != "Linux" or platform.libc_ver()[0] != "glibc":
        return False  # other allocators have their own policies; nothing to set
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    return bool(mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES)) and bool(
        mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))


@functools.lru_cache(maxsize=None)
def core_cpu_plan(core_cpus: str, cpu_affinity: str, cpu_threads: int | None
                  ) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """(the engine core's CPUs, the serving process's CPUs) for `--core-cpus`, within
    `--cpu-affinity` (default: the CPUs this process may use); None where nothing is pinned.
    Worked out once per process (cached): the server pins itself by it before it starts the core,
    which must then get the CPUs of the same plan, not a plan of what the server has left.

    auto: the core takes the last of them, as many as its torch threads (`--cpu-threads`, default
    all but one), and the server the rest; nothing is pinned when that leaves the server none.
    A list: the core runs there, the server on the others (or, when none are left, where it is)."""
    from tito.cpu_affinity import allowed_cpus, parse_cpu_list, split_for_core

    if core_cpus == "none" or not hasattr(os, "sched_setaffinity"):  # no affinity on this OS: nothing to pin
        return None, None
    base = parse_cpu_list(cpu_affinity) if cpu_affinity else allowed_cpus()
    if core_cpus == "auto":
        split = split_for_core(cpu_threads or max(1, len(base) - 1), base)
        return split if split is not None else (None, None)
    core = parse_cpu_list(core_cpus, "--core-cpus")
    return core, (base - core) or None
