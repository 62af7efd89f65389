"""The rule for LoRA adapter names, which render, the engine and the gateway all check: a name
travels as OpenAI's `model`, in GenerateRequest.lora_name, in KV events and in logs."""

from __future__ import annotations

import re

from tito.errors import InvalidArgument

_NAME = re.compile(r"^[A-Za-z0-9._\-/:]{1,128}$")


def is_lora_name(name: str) -> bool:
    return bool(_NAME.match(name))


def check_lora_name(name: str, field: str = "lora_name") -> None:
    """Refuse a name no adapter can have (INVALID_ARGUMENT naming `field`)."""
    if not is_lora_name(name):
        raise InvalidArgument(f"{field} {name[:140]!r} is not an adapter name: 1 to 128 letters, digits or ._-/:",
                              reason="INVALID_REQUEST", field=field)
