"""LoRA adapters as both backends and the servicer describe them (the rule for their names is
tito.lora_names', shared with render). Torch-free and grpc-free (the servicer converts these to
tito.v1.LoraAdapterInfo)."""

from __future__ import annotations

from dataclasses import dataclass

from tito.errors import FailedPrecondition
from tito.lora_names import check_lora_name

__all__ = ["LORA_DISABLED", "LoraAdapterInfo", "check_lora_name", "lora_disabled"]

LORA_DISABLED = "LORA_DISABLED"


@dataclass(frozen=True)
class LoraAdapterInfo:
    """One adapter an engine holds (ListLoraAdapters, GetModelInfo, GetLoad)."""

    name: str
    path: str  # relative to --lora-dir
    rank: int
    target_modules: tuple[str, ...]
    active_requests: int = 0  # running or waiting requests that use it
    resident: bool = False  # in one of the model's adapter slots now


def lora_disabled(field: str = "lora_name") -> FailedPrecondition:
    """The refusal of an engine that serves no adapters."""
    return FailedPrecondition("this engine serves no LoRA adapters (start it with --lora-dir, and --max-loras > 0)",
                              reason=LORA_DISABLED, field=field)
