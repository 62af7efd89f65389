"""The scheduler's limits and the engine's defaults, each written once.

`EngineConfig` declares its flags with these defaults; the start-up plan (tito_engine.startup_plan)
hands the scheduler one `SchedulerLimits` built from the config and the device, so a setting
travels as one object from the command line to the step loop (in this process or, pickled, to the
engine core process).
"""

from __future__ import annotations

from dataclasses import dataclass

#: Choices (sequences) advanced together in one step: a request with n=4 holds 4.
DEFAULT_MAX_RUNNING_SEQUENCES = 64
#: Requests admitted but not yet running; beyond it Generate answers RESOURCE_EXHAUSTED.
DEFAULT_MAX_WAITING_REQUESTS = 1024
#: Prompt tokens computed per step, shared by all prefilling requests (chunked prefill), on CUDA.
DEFAULT_MAX_PREFILL_TOKENS = 2048
#: The same on CPU, where a step's time grows with its tokens from a few dozen on: a 2,048-token
#: step holds every running decode for as long as 2,048 tokens take, so one burst of prompts stalls
#: all the streams beside it; 512-token steps interleave decodes four times as often for the same
#: prefill throughput (the per-step overhead is small beside 512 tokens of work).
DEFAULT_MAX_PREFILL_TOKENS_CPU = 512
#: Tokens per KV cache block of the native engine.
DEFAULT_BLOCK_SIZE = 16
#: (The KV cache's size when no flag gives one: tito_engine.kv_sizing.)


@dataclass(frozen=True)
class SchedulerLimits:
    """What the scheduler is allowed per step, and whether prompt blocks are shared."""

    max_running_sequences: int = DEFAULT_MAX_RUNNING_SEQUENCES
    max_prefill_tokens: int = DEFAULT_MAX_PREFILL_TOKENS
    prefix_caching: bool = True
