"""What the engine works out once at start-up from its config and this machine, then passes down.

The config (config.py) is what the operator set; the plan is what it comes to here: the model's
directory (a built-in tiny model is built on first use), whether the native engine computes on
CPU, the CPU plan (torch threads, the core's and the server's CPUs, from the model's work per
token: model/cpu_runtime.plan_cpus) and the scheduler's limits (the prefill budget by device).
`server.serve` makes it before it pins its own process, and the engine core receives its share in
the CoreProcessSpec (pickled into the child process): the core must run on the CPUs the server
left it, never on a plan of what the server has left.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from tito_models.paths import resolve_model

from tito_engine.config import EngineConfig
from tito_engine.core.engine_core import CoreProcessSpec
from tito_engine.limits import (DEFAULT_BLOCK_SIZE, DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_MAX_PREFILL_TOKENS_CPU,
                                SchedulerLimits)
from tito_engine.model.cpu_runtime import CpuPlan, forward_macs_per_token, plan_cpus
from tito_engine.model.quantization import scheme_for
from tito_engine.model.runner import KVCacheSpec, choose_device


@dataclass(frozen=True)
class StartupPlan:
    """The engine's start-up decisions, made once (`plan_startup`)."""

    model_dir: Path
    #: Threads and CPUs of the native engine on CPU; None for the vllm backend and on CUDA.
    cpus: CpuPlan | None
    limits: SchedulerLimits

    def core_spec(self, config: EngineConfig) -> CoreProcessSpec:
        """What the native engine's core needs to load its runner, in this process or a child."""
        kv_cache = KVCacheSpec(block_size=config.block_size or DEFAULT_BLOCK_SIZE, num_blocks=config.kv_blocks,
                               cache_bytes=config.kv_cache_bytes, memory_fraction=config.kv_memory_fraction,
                               max_sequences=config.max_running_sequences)
        return CoreProcessSpec(model_dir=str(self.model_dir), model_id=config.model, device=config.device,
                               max_model_len=config.max_model_len, kv_cache=kv_cache, cpu_plan=self.cpus,
                               limits=self.limits, log_level=config.log_level,
                               encoder_cache_bytes=config.encoder_cache_bytes,
                               exclude_padding_ids=config.excludes_padding_ids, packed_linears=config.packs_linears,
                               decode_kernel=config.cpu_decode_kernel, dtype=config.dtype,
                               quantization=config.quantization,
                               encoder_store_dir=config.encoder_store_dir,
                               encoder_store_bytes=config.encoder_store_bytes, lora_dir=config.lora_dir,
                               lora_modules=config.lora_module_pairs(), max_loras=config.max_loras,
                               max_lora_rank=config.max_lora_rank)


def plan_startup(config: EngineConfig) -> StartupPlan:
    """The StartupPlan of a validated config on this machine."""
    model_dir = resolve_model(config.model)
    if config.backend == "native":  # a quantized layout it cannot load, or --quantization on one: refused now
        scheme_for(model_dir, config.quantization)
    on_cpu = config.backend == "native" and choose_device(config.device).type == "cpu"
    return StartupPlan(model_dir=model_dir, cpus=_cpu_plan(config, model_dir) if on_cpu else None,
                       limits=scheduler_limits(config, on_cpu))


def scheduler_limits(config: EngineConfig, on_cpu: bool) -> SchedulerLimits:
    """The scheduler's share of the config, as one object (tito_engine.limits); the prefill budget
    is the flag's, else the device's default (CPU steps are kept shorter so that decodes are not
    held up)."""
    budget = config.max_prefill_tokens_per_step
    if budget is None:
        budget = DEFAULT_MAX_PREFILL_TOKENS_CPU if on_cpu else DEFAULT_MAX_PREFILL_TOKENS
    return SchedulerLimits(max_running_sequences=config.max_running_sequences, max_prefill_tokens=budget,
                           prefix_caching=config.prefix_caching)


def _cpu_plan(config: EngineConfig, model_dir: Path) -> CpuPlan:
    """The native engine's CPU plan; only a core in a child process is pinned."""
    return plan_cpus(config.core_cpus, config.cpu_affinity, config.cpu_threads, forward_macs_per_token(model_dir),
                     pin=config.engine_process, lone_prefill=config.cpu_lone_prefill_borrow is not False)
