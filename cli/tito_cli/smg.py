"""SMG in front of `tito serve all` (`--smg-address`): the real SMG gateway (PyPI `smg`) routing
OpenAI traffic to the engine over SMG's `vllm.grpc.engine.VllmEngine`, which every tito engine
serves beside tito.v1. What this module decides: where the `smg` command is, that the addresses
suit it, its command line (the engine as its worker, the parsers tito would use for the model),
and its output, prefixed line by line like the other children's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
import threading
from pathlib import Path
from typing import TextIO

from tito.config import ConfigError
from tito.parsers import REASONING_FORMATS, TOOL_FORMATS
from tito.serving import check_can_listen

#: How to get the `smg` command (the version tito's tests run).
INSTALL_HINT = "pip install smg==1.13.0 (tito's extra: pip install 'tito[smg]')"
#: Hosts that mean "every interface" to a listener; SMG dials the engine on the loopback instead.
_WILDCARD_HOSTS = {"0.0.0.0", "::", "[::]", ""}
#: SMG's names for tito's log levels.
_SMG_LOG_LEVELS = {"debug": "debug", "info": "info", "warning": "warn", "error": "error"}
#: SMG's parser that leaves the text as the engine made it (tito knows of no format to parse).
SMG_NO_PARSER = "passthrough"


def smg_executable() -> str | None:
    """The `smg` command: this Python environment's (even when its bin is not on PATH), else
    PATH's; None when SMG is not installed."""
    beside = Path(sys.executable).parent / "smg"
    return str(beside) if beside.is_file() else shutil.which("smg")


def _host_port(address: str, flag: str) -> tuple[str, int]:
    host, _, port = address.rpartition(":")
    if address.startswith("unix:") or not host or not port.isdigit() or int(port) == 0:
        raise ConfigError(f"{flag} {address!r}: SMG needs HOST:PORT with a fixed port (TCP, not unix:)")
    return host, int(port)


def worker_url(engine_address: str) -> str:
    """The grpc:// URL SMG dials the engine at (a wildcard listener is reached on the loopback)."""
    host, port = _host_port(engine_address, "--engine-address")
    if host in _WILDCARD_HOSTS:
        host = "[::1]" if ":" in host else "127.0.0.1"
    return f"grpc://{host}:{port}"


def check_smg(address: str, engine_address: str) -> str:
    """What `tito serve all --smg-address` checks before starting anything; the `smg` command.
    Raises ConfigError with the fix: SMG not installed, an address SMG cannot use, a taken port."""
    executable = smg_executable()
    if executable is None:
        raise ConfigError(f"--smg-address needs SMG's `smg` command, which is not installed here: {INSTALL_HINT}")
    _host_port(address, "--smg-address")
    worker_url(engine_address)
    check_can_listen(address, flag="--smg-address")
    return executable


def parser_flags(reasoning: str, tool: str) -> list[str]:
    """SMG's parser flags for tito's parser names ("" = none): the same format where SMG has one,
    passthrough where tito parses nothing (SMG would otherwise guess from the model's name), and
    no flag where SMG reads the format its own way (gpt-oss's harmony). Where SMG's legacy parser
    for a reasoning format differs from tito's and tito parses no tool calls, SMG's Symphony table
    for the format instead (alone: SMG takes no other parser name beside it)."""
    symphony = REASONING_FORMATS[reasoning].smg_symphony if reasoning else ""
    if symphony and not tool:
        return ["--parser", "symphony", "--reasoning-parser", symphony]
    flags = []
    for flag, name, table in (("--reasoning-parser", reasoning, REASONING_FORMATS),
                              ("--tool-call-parser", tool, TOOL_FORMATS)):
        smg_name = table[name].smg if name else SMG_NO_PARSER
        if smg_name:
            flags += [flag, smg_name]
    return flags


def smg_command(executable: str, address: str, engine_address: str, log_level: str, grace_seconds: float,
                parsers: list[str], extra: list[str] = ()) -> list[str]:
    """`smg launch --backend vllm` on `address` with the engine at `engine_address` as its one
    worker. Its shutdown grace is the engine's (SIGTERM reaches both at once; neither should give
    up on a request the other still serves); `extra` comes last, so a user's flag wins."""
    host, port = _host_port(address, "--smg-address")
    return [executable, "launch", "--backend", "vllm", "--worker-urls", worker_url(engine_address),
            "--host", host.strip("[]"), "--port", str(port), "--log-level", _SMG_LOG_LEVELS[log_level],
            "--shutdown-grace-period-secs", str(max(1, round(grace_seconds))), *parsers, *extra]


#: Terminal colour codes (SMG colours its log lines whatever its output is, NO_COLOR too).
_COLOUR = re.compile(r"\x1b\[[0-9;]*m")


def forward_lines(stream: TextIO, prefix: str, sink: TextIO) -> threading.Thread:
    """Copy `stream` to `sink` line by line, each line prefixed, on a daemon thread that ends at
    EOF (when the child exits): SMG's own log lines then read as `smg: ...` among tito's, without
    colour codes unless `sink` is a terminal (a log file or journal would keep them as noise)."""
    plain = not sink.isatty()

    def copy() -> None:
        for line in stream:
            sink.write(f"{prefix}{_COLOUR.sub('', line) if plain else line}")
            sink.flush()

    thread = threading.Thread(target=copy, name=f"{prefix.strip()} output", daemon=True)
    thread.start()
    return thread


def start_smg(command: list[str], sink: TextIO | None = None) -> subprocess.Popen:
    """Start SMG with its output (stdout and stderr together) prefixed `smg: ` on `sink` (stderr)."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               errors="replace")
    forward_lines(process.stdout, "smg: ", sink or sys.stderr)
    return process
