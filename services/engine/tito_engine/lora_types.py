"""LoRA adapters as both backends and the servicer describe them, and the rule for their names.
Torch-free and grpc-free (the servicer converts these to tito.v1.LoraAdapterInfo)."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tito.errors import FailedPrecondition, InvalidArgument

#: What an adapter's name may be: it travels as OpenAI's `model`, in KV events and in logs.
_NAME = re.compile(r"^[A-Za-z0-9._\-/:]{1,128}$")

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


def check_lora_name(name: str, field: str = "lora_name") -> None:
    """Refuse a name that could not have been loaded (INVALID_ARGUMENT naming `field`)."""
    if not _NAME.match(name):
        raise InvalidArgument(f"{field} {name[:140]!r} is not an adapter name: 1 to 128 letters, digits or ._-/:",
                              reason="INVALID_REQUEST", field=field)


def lora_disabled(field: str = "lora_name") -> FailedPrecondition:
    """The refusal of an engine that serves no adapters."""
    return FailedPrecondition("this engine serves no LoRA adapters (start it with --lora-dir, and --max-loras > 0)",
                              reason=LORA_DISABLED, field=field)
