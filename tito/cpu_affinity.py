"""Which CPUs a tito process runs on (Linux).

The engine's step loop is one busy thread (plus torch's intra-op threads); every other process on
the machine wakes up for a moment per streamed token (the engine's server, derender, the router).
Left to the kernel, those wake-ups land on the step loop's CPU and preempt it: measured on 2 cores
at concurrency 32, the engine core then computed only ~80% of the time and the whole pipeline
reached 0.70-0.77x the engine alone; with the core on a CPU of its own and everything else on the
other, 0.89x, and the engine alone went from ~3,200 to ~3,500 tok/s.

So the engine core takes the last CPUs the process may use (as many as its torch threads) and the
engine's server the others (`--core-cpus`, engine README); render, derender and a co-located router
keep off the core's CPUs with `--cpu-affinity` (or `taskset`).
"""

from __future__ import annotations

import logging
import os

from tito.errors import ConfigError

log = logging.getLogger(__name__)


def parse_cpu_list(text: str, flag: str = "--cpu-affinity") -> frozenset[int]:
    """"0-3,6" -> {0, 1, 2, 3, 6}; a ConfigError that shows the form otherwise."""
    cpus: set[int] = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            start, end = int(first), int(last or first)
            if start < 0 or end < start:
                raise ValueError(part)
            cpus.update(range(start, end + 1))
    except ValueError:
        raise ConfigError(f"{flag} {text!r}: expected CPU numbers and ranges, e.g. 0-3,6") from None
    return frozenset(cpus)


def format_cpu_list(cpus: frozenset[int] | set[int]) -> str:
    """{0, 1, 2, 3, 6} -> "0-3,6"."""
    ranges: list[str] = []
    for cpu in sorted(cpus):
        if ranges and int(ranges[-1].rpartition("-")[2]) == cpu - 1:
            ranges[-1] = f"{ranges[-1].partition('-')[0]}-{cpu}"
        else:
            ranges.append(str(cpu))
    return ",".join(ranges)


def allowed_cpus() -> frozenset[int]:
    """The CPUs this process may run on (every CPU where the OS has no affinity call)."""
    if hasattr(os, "sched_getaffinity"):
        return frozenset(os.sched_getaffinity(0))
    return frozenset(range(os.cpu_count() or 1))


def check_cpus(cpus: frozenset[int], flag: str) -> None:
    """A ConfigError when `cpus` is empty or names CPUs this process may not use."""
    if not hasattr(os, "sched_setaffinity"):
        raise ConfigError(f"{flag}: this operating system has no CPU affinity; leave the flag out")
    outside = cpus - allowed_cpus()
    if not cpus or outside:
        raise ConfigError(f"{flag} {format_cpu_list(cpus)}: this process may only use CPUs "
                          f"{format_cpu_list(allowed_cpus())}")


def thread_ids() -> set[int]:
    """This process's threads ({0}, the calling thread, where they cannot be listed)."""
    try:
        return {int(task) for task in os.listdir("/proc/self/task")}
    except OSError:
        return {0}


def move_threads(threads, cpus: frozenset[int]) -> int:
    """Move `threads` (ids) to `cpus`; how many moved (a thread that ended meanwhile is skipped)."""
    moved = 0
    for thread in threads:
        try:
            os.sched_setaffinity(thread, cpus)
            moved += 1
        except OSError:  # a thread that ended meanwhile
            pass
    return moved


def run_on(cpus: frozenset[int]) -> None:
    """Move every thread of this process to `cpus` (threads started later inherit it from the
    thread that starts them)."""
    move_threads(thread_ids(), cpus)


def split_for_core(threads: int, cpus: frozenset[int] | None = None) -> tuple[frozenset[int], frozenset[int]] | None:
    """(the core's CPUs, the others') when the engine core takes the last `threads` of `cpus` (default:
    this process's); None when that would leave the others nothing."""
    ordered = sorted(allowed_cpus() if cpus is None else cpus)
    if len(ordered) <= threads:
        return None
    return frozenset(ordered[-threads:]), frozenset(ordered[:-threads])
