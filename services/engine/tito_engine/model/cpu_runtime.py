"""How the engine's processes run on CPU: torch's intra-op threads, the CPUs of the core and the
server (`plan_cpus`, chosen from the model's work), and the C allocator's settings.

Threads and the allocator are process-wide, so they are set once, where the model is loaded
(ModelRunner); the placement is worked out once in the server, before the core process starts,
and handed to the core (tito_engine.startup_plan).

A lone prefill (the step's only row: nothing else is running, so the server has no tokens to
stream) may borrow the server's CPUs for its linears (`lend_cpus_to_lone_prefill`, linear.wide_linears):
on 2 cores with a model small enough that the core gets one CPU, a 138-token prefill of
tiny-qwen2-h256 took 17.3 -> 13.4 ms back to back and 20.3 -> 14.9 ms after idle pauses (medians
of 30 interleaved), and the first token of a chat through the gateway came ~3 ms sooner.
"""

from __future__ import annotations

import ctypes
import json
import logging
import os
import platform
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import torch

log = logging.getLogger(__name__)

#: glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3
#: Freed memory at the top of the heap kept for the next step instead of returned to the system.
TRIM_THRESHOLD_BYTES = 64 << 20
#: Allocations below this come from the heap (32 MiB: glibc's largest allowed value).
MMAP_THRESHOLD_BYTES = 32 << 20


def set_cpu_threads(threads: int) -> None:
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


#: CPU time the serving side spends per streamed token: the engine server's stream message,
#: derender and a client or router beside it (measured on 2 cores: ~330 us per token over the
#: three services, ~0.1 ms of it in the engine server).
SERVER_CPU_PER_TOKEN_S = 300e-6
#: Multiply-adds per second one core does in a step's matmuls, the order of magnitude only (fp32
#: AVX-512 here measured 40-60 G; bf16 with AMX more, but then memory traffic bounds a decode).
CPU_MACS_PER_S = 50e9
#: The core takes every CPU when a token's forward costs this many times the server's per-token
#: work: a second thread then speeds the step almost 2x (measured on 2 cores, Qwen2.5-0.5B's shape:
#: a 32-row decode step 671 -> 332 ms in float32, 455 -> 238 ms in bfloat16) while the server,
#: sharing a CPU, needs a few percent of it. Below it (a tiny model: ~4 M multiply-adds a token
#: against ~0.3 ms of serving work) the server gets a CPU of its own, since intra-op threads that
#: wait for a busy CPU spin (a step took ~10x longer with 2 torch threads while the event loop ran).
FORWARD_DOMINATES = 8


def forward_macs_per_token(model_dir: Path) -> int:
    """Multiply-adds of one token's forward through the linears and the output layer, from the
    model's config.json (text part); 0 when it cannot be read. The same count for every family
    (q/k/v, o, gate/up/down per layer; head dims as configured)."""
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError):
        return 0
    text = config.get("text_config") or config
    try:
        hidden, layers = int(text["hidden_size"]), int(text["num_hidden_layers"])
        heads = int(text["num_attention_heads"])
        kv_heads = int(text.get("num_key_value_heads") or heads)
        head_dim = int(text.get("head_dim") or hidden // heads)
        intermediate = int(text["intermediate_size"])
        vocab = int(text.get("vocab_size") or config.get("vocab_size") or 0)
    except (KeyError, TypeError, ValueError):
        return 0
    per_layer = hidden * (heads + 2 * kv_heads) * head_dim + heads * head_dim * hidden + 3 * hidden * intermediate
    return layers * per_layer + hidden * vocab


def forward_dominates(macs_per_token: int) -> bool:
    """Whether a token's forward costs FORWARD_DOMINATES times the server's work on it or more."""
    return macs_per_token / CPU_MACS_PER_S >= FORWARD_DOMINATES * SERVER_CPU_PER_TOKEN_S


@dataclass(frozen=True)
class CpuPlan:
    """How the engine uses the CPUs: torch intra-op threads of the process that runs the model,
    the CPUs of the engine core process and of the serving process (None: not pinned), and why."""

    threads: int
    core_cpus: frozenset[int] | None
    server_cpus: frozenset[int] | None
    reason: str
    #: The CPUs a lone prefill's linears borrow (the server's; None: it runs on the core's alone).
    lone_prefill_cpus: frozenset[int] | None = None

    def describe(self) -> str:
        from tito.cpu_affinity import format_cpu_list

        where = (f"core on CPUs {format_cpu_list(self.core_cpus)}" if self.core_cpus is not None
                 else "core not pinned")
        if self.server_cpus is not None:
            where += f", server on CPUs {format_cpu_list(self.server_cpus)}"
        if self.lone_prefill_cpus is not None:
            where += f", a lone prefill's linears also on CPUs {format_cpu_list(self.lone_prefill_cpus)}"
        return f"{self.threads} torch thread(s), {where} ({self.reason})"


def plan_cpus(core_cpus: str, cpu_affinity: str, cpu_threads: int | None, macs_per_token: int,
              pin: bool = True, lone_prefill: bool = True) -> CpuPlan:
    """The CpuPlan for `--core-cpus`, `--cpu-threads`, within `--cpu-affinity` (default: the CPUs
    this process may use), for a model whose token costs `macs_per_token`; `pin=False` (the core
    on a thread of the server, or no affinity call on this OS): threads only. The engine works it
    out once, at start-up (tito_engine.startup_plan), before the server pins itself by it: asked
    again afterwards, `allowed_cpus()` would answer with what the server has left.

    Threads (unless --cpu-threads): every CPU when the forward dominates (`forward_dominates`),
    else all but one, left to the server (and, with a list, the CPUs of the list).
    auto: the core takes the last `threads` CPUs and the server the rest; when that leaves the
    server none, nothing is pinned (the core then shares every CPU with the server, whose work is
    small beside the forward's). A list: the core runs there, the server on the others (or, when
    none are left, where it is). none: nothing is pinned.

    `lone_prefill` (--cpu-lone-prefill-borrow): when the core and the server are pinned apart, a
    lone prefill's linears borrow the server's CPUs too."""
    from tito.cpu_affinity import allowed_cpus, parse_cpu_list, split_for_core

    pin = pin and hasattr(os, "sched_setaffinity")
    base = parse_cpu_list(cpu_affinity) if cpu_affinity else allowed_cpus()
    listed = parse_cpu_list(core_cpus, "--core-cpus") if pin and core_cpus not in ("auto", "none") else None
    room = len(listed) if listed is not None else len(base)
    if cpu_threads:
        threads, reason = cpu_threads, "--cpu-threads"
    elif forward_dominates(macs_per_token):
        threads = room
        reason = (f"a token's forward is ~{macs_per_token / 1e6:.0f} M multiply-adds, over {FORWARD_DOMINATES}x the "
                  f"server's per-token work: every CPU computes")
    else:
        threads = max(1, room - 1) if listed is None else room
        reason = (f"a token's forward is ~{macs_per_token / 1e6:.1f} M multiply-adds, near the server's per-token "
                  f"work: a CPU stays the server's" if listed is None else "--core-cpus")
    if not pin or core_cpus == "none":
        return CpuPlan(threads, None, None, reason)
    if listed is not None:
        core, server = listed, (base - listed) or None
    else:
        split = split_for_core(threads, base)
        if split is None:
            return CpuPlan(threads, None, None, reason)
        core, server = split
    return CpuPlan(threads, core, server, reason, server if lone_prefill else None)


#: The environment variables that set how OpenMP threads wait between parallel regions (the
#: standard one, and libgomp's own spin count): an operator's setting of either is kept.
OMP_WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def core_omp_environment(plan: CpuPlan, environ: Mapping[str, str]) -> dict[str, str]:
    """The environment the engine core process starts with on top of `environ`, for `plan`:
    OMP_WAIT_POLICY=PASSIVE when the core runs several torch threads on CPUs it shares (not
    pinned, or pinned over the server's), unless the operator set how OpenMP waits; else nothing.

    OpenMP's threads spin for a while after each parallel region (libgomp's default), which costs
    nothing on CPUs of their own but, on CPUs other work needs (the engine's server, anything else
    on the machine), makes the scheduler treat them as busy: a spinning thread holds a CPU while
    its partner waits in the run queue, and the step's regions each wait for the later of the two.
    Measured on 2 cores that other work kept busy (load average 5-10), a c=1 decode step of
    Qwen2.5-0.5B's shape on two threads: float32 868-1490 -> 229-296 ms, int8 492-1366 -> 153-168
    ms (libgomp's GOMP_SPINCOUNT=0, what PASSIVE sets). A thread that sleeps instead costs a wake-up
    per region: at a quiet moment the same step took 104-128 against 94-114 ms (float32), 37-47
    against 32-41 ms (int8), within that machine's noise. OpenMP reads the variable once, when torch
    loads it, hence the child's environment, set before it starts."""
    if plan.threads < 2 or any(name in environ for name in OMP_WAIT_VARIABLES):
        return {}
    if plan.core_cpus is not None and plan.server_cpus is not None and not plan.core_cpus & plan.server_cpus:
        return {}  # CPUs of its own: spinning between regions is the faster wait
    return {"OMP_WAIT_POLICY": "PASSIVE"}


def lend_cpus_to_lone_prefill(cpus: frozenset[int]) -> int:
    """Start torch's intra-op threads for a lone prefill's linears, the extra ones pinned to `cpus`
    (this process keeps its own); the thread count to give `linear.wide_linears`, 0 where it cannot
    be done (no per-thread affinity, or no new thread appeared: an OpenMP runtime that starts none).

    OpenMP starts its threads at the first parallel region that wants them, and a thread inherits
    its parent's CPUs (the core's, with nothing left to gain), so they are started here, once, and
    moved. They sleep between prefills; after one they spin for a moment (GOMP_SPINCOUNT) on
    the lent CPUs, while the server (woken by the first token) preempts them."""
    from tito.cpu_affinity import move_threads, thread_ids

    if not cpus or not hasattr(os, "sched_setaffinity"):
        return 0
    usual = torch.get_num_threads()
    wide = usual + len(cpus)
    before = thread_ids()
    torch.set_num_threads(wide)
    try:
        torch.ones(wide << 16).add_(1)  # far above torch's grain (32,768 elements): every thread takes a part
    finally:
        torch.set_num_threads(usual)
    if not move_threads(thread_ids() - before, cpus):
        log.info("no intra-op threads could be started for a lone prefill: it runs on the core's %d", usual)
        return 0
    return wide
