"""How big the KV cache is when no flag says: one rule for both backends and both devices.

    KV bytes = fraction x (memory free after loading the model - reserve),
               at most what the running sequences can hold at once

- *memory free*: on CPU the host's available memory (`MemAvailable`, bounded by the cgroup's
  limit when the process runs under one); on CUDA the device's free memory. It is read after the
  model is loaded (native backend), or estimated as the memory free now less the weights in the
  compute dtype (vllm backend: vLLM loads them in its own engine process).
- *reserve*: `KV_MEMORY_RESERVE_BYTES` (1 GiB) left for activations, the runtime and whatever
  else the machine is doing.
- *fraction*: `--kv-memory-fraction`, default `DEFAULT_KV_MEMORY_FRACTION` (0.5): the other half
  stays free for the rest of the machine.
- *at most*: `max_running_sequences x context length` tokens; more would only lengthen the
  prefix cache's memory, never let one more request run.

`--kv-cache-bytes` or `--kv-blocks` give a fixed size instead and win. The outcome is logged at
start-up as bytes and tokens of context. This module imports no torch: the vllm backend sizes
vLLM's cache with it before vLLM starts.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tito.config import ConfigError

#: The share of (free memory - reserve) the KV cache takes when no flag sizes it.
DEFAULT_KV_MEMORY_FRACTION = 0.5
#: Left free for activations, the runtime and the rest of the machine.
KV_MEMORY_RESERVE_BYTES = 1 << 30

_GIB = float(1 << 30)


def available_host_memory(meminfo: Path = Path("/proc/meminfo"), cgroup: Path = Path("/sys/fs/cgroup")) -> int:
    """Bytes of host memory a new allocation can take: `MemAvailable`, and no more than the
    cgroup (v2) limit leaves when one is set."""
    available = None
    try:
        for line in meminfo.read_text().splitlines():
            if line.startswith("MemAvailable:"):
                available = int(line.split()[1]) * 1024
                break
    except OSError:
        pass
    if available is None:
        raise ConfigError("cannot read the free memory (/proc/meminfo has no MemAvailable); size the KV cache "
                          "with --kv-cache-bytes")
    try:
        limit = (cgroup / "memory.max").read_text().strip()
        if limit != "max":
            used = int((cgroup / "memory.current").read_text().strip())
            available = min(available, max(0, int(limit) - used))
    except (OSError, ValueError):
        pass
    return available


@dataclass(frozen=True)
class KVBudget:
    """The KV cache's size in bytes and how the rule arrived at it (for the start-up log)."""

    bytes: int
    why: str

    def describe(self, bytes_per_token: int) -> str:
        """'1.50 GiB = 65,536 tokens of context (why)'."""
        return f"{self.bytes / _GIB:.2f} GiB = {self.bytes // bytes_per_token:,} tokens of context ({self.why})"


def kv_budget(free_bytes: int, bytes_per_token: int, *, max_sequences: int, context_length: int,
              fraction: float | None = None, reserve_bytes: int = KV_MEMORY_RESERVE_BYTES,
              where: str = "after loading the model") -> KVBudget:
    """The rule above for `free_bytes` free `where`; refuses (ConfigError) when it leaves no room."""
    share = DEFAULT_KV_MEMORY_FRACTION if fraction is None else fraction
    usable = free_bytes - reserve_bytes
    budget = int(max(0, usable) * share)
    why = (f"{share:g} x ({free_bytes / _GIB:.2f} GiB free {where} - {reserve_bytes / _GIB:g} GiB reserve); "
           f"--kv-memory-fraction or --kv-cache-bytes change it")
    cap = bytes_per_token * max_sequences * context_length
    if cap < budget:
        budget = cap
        why = (f"what {max_sequences} running sequences of {context_length} tokens hold at once, less than "
               f"{share:g} x ({free_bytes / _GIB:.2f} GiB free {where} - {reserve_bytes / _GIB:g} GiB reserve)")
    if budget < bytes_per_token:
        raise ConfigError(f"no memory left for the KV cache: {free_bytes / _GIB:.2f} GiB free {where}, "
                          f"{reserve_bytes / _GIB:g} GiB of it kept in reserve; free some memory or size the "
                          f"cache with --kv-cache-bytes")
    return KVBudget(budget, why)
