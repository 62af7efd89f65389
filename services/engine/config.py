"""Engine configuration: the model, where it runs, and the scheduler's limits."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tito.config import ConfigError, ServerConfig
from tito.model_paths import DEFAULT_MODEL

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass
class EngineConfig(ServerConfig):
    """What the engine serves and how much work it takes on at once."""

    model: str = DEFAULT_MODEL
    device: str = "auto"
    # Most choices (sequences) advanced together in one scheduler step.
    max_running_requests: int = 64
    # Most requests admitted but not yet running; beyond it Generate answers RESOURCE_EXHAUSTED.
    max_waiting_requests: int = 1024
    # Overrides the model's max_position_embeddings as the per-request context limit.
    max_model_len: int | None = None
    # Largest `n` (choices per request) accepted.
    max_choices_per_request: int = 16

    def validate(self) -> None:
        super().validate()
        if not self.model:
            raise ConfigError("model must name a local model directory or a tiny model (e.g. tiny-qwen2)")
        if not _DEVICE.match(self.device):
            raise ConfigError(f"device={self.device!r} must be auto, cpu, cuda or cuda:N (e.g. cuda:0)")
        if not 1 <= self.max_running_requests <= 65536:
            raise ConfigError(f"max_running_requests={self.max_running_requests} must be between 1 and 65536 "
                              f"(default 64)")
        if not 0 <= self.max_waiting_requests <= 1_000_000:
            raise ConfigError(f"max_waiting_requests={self.max_waiting_requests} must be between 0 and 1000000 "
                              f"(default 1024)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 2 (or unset to use the "
                              f"model's max_position_embeddings)")
        if not 1 <= self.max_choices_per_request <= self.max_running_requests:
            raise ConfigError(f"max_choices_per_request={self.max_choices_per_request} must be between 1 "
                              f"and max_running_requests ({self.max_running_requests})")
