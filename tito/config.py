"""Typed configuration shared by the services, validated at start-up.

Services extend `ServerConfig` with their own fields. Nothing here reads the environment at
import time; the CLI builds configs from its arguments and calls `validate()`, whose messages say
what a correct value looks like.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from tito.logs import LOG_LEVELS

DEFAULT_MAX_MESSAGE_BYTES = 64 * 1024 * 1024
_TCP_ADDRESS = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[A-Za-z0-9_.-]+):(\d{1,5})$")


class ConfigError(ValueError):
    """A configuration value is wrong; the message says how to fix it."""


def validate_address(address: str, what: str = "address") -> None:
    """Accept `host:port` (port 0 = any free port), `[v6]:port`, or `unix:/path/to.sock`."""
    if address.startswith("unix:"):
        if len(address.removeprefix("unix://").removeprefix("unix:")) == 0:
            raise ConfigError(f"{what} {address!r}: a unix address needs a path, e.g. unix:/tmp/tito-render.sock")
        return
    match = _TCP_ADDRESS.match(address)
    if not match or int(match.group(2)) > 65535:
        raise ConfigError(
            f"{what} {address!r} is not valid: use host:port (e.g. 127.0.0.1:50051, port 0 for any free "
            f"port) or unix:/path/to.sock")


@dataclass
class ServerConfig:
    """What every tito server needs: where to listen, message limits, shutdown grace, logging."""

    address: str = "127.0.0.1:0"
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    grace_seconds: float = 10.0
    log_level: str = "info"
    reuse_port: bool = False

    def validate(self) -> None:
        validate_address(self.address)
        if not 1024 <= self.max_message_bytes <= 2**31 - 1:
            raise ConfigError(
                f"max_message_bytes={self.max_message_bytes} must be between 1024 and 2147483647 "
                f"(default {DEFAULT_MAX_MESSAGE_BYTES})")
        if self.grace_seconds < 0:
            raise ConfigError(f"grace_seconds={self.grace_seconds} must be >= 0")
        if self.log_level.lower() not in LOG_LEVELS:
            raise ConfigError(f"log_level={self.log_level!r} must be one of {', '.join(LOG_LEVELS)}")
