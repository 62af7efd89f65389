"""The README's grpcurl walkthrough, run as written against `tito serve all` (so it cannot rot).

Each command of the README's block runs through bash with the block's own `G=...` line, the
addresses swapped for this test's free ports. Every command must succeed, except the one the README
says is refused, which must be refused as the README says.
"""

from __future__ import annotations

import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tito_client.pipeline import wait_until_serving

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
README_PORTS = {"render": 50051, "engine": 50052, "derender": 50053}


def _walkthrough() -> list[str]:
    """The commands of the README's grpcurl block (continuation lines joined), `G=` first."""
    text = (ROOT / "README.md").read_text()
    section = text.split("## Talking to the services with grpcurl", 1)[1].split("\n## ", 1)[0]
    block = section.split("```sh\n", 1)[1].split("```", 1)[0]
    commands, current = [], ""
    for line in block.splitlines():
        if not current and (not line.strip() or line.lstrip().startswith("#")):
            continue
        current += line + "\n"
        if line.endswith("\\") or current.count("'") % 2:  # a continued line, or inside a quoted -d
            continue
        commands.append(current)
        current = ""
    assert commands[0].startswith("G=") and len(commands) > 5, commands
    return commands


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ports(tiny_text_model):
    ports = {name: _free_port() for name in README_PORTS}
    process = subprocess.Popen([sys.executable, "-m", "tito_cli", "serve", "all", "--model", str(tiny_text_model),
                                "--log-level", "warning",
                                *(f"--{name}-address=127.0.0.1:{port}" for name, port in ports.items())], cwd=ROOT)
    try:
        for port in ports.values():
            wait_until_serving(f"127.0.0.1:{port}", timeout=180)
        yield ports
    finally:
        process.terminate()
        process.wait(60)


def test_every_grpcurl_command_of_the_readme_works_as_described(ports):
    commands = _walkthrough()
    setup = commands[0]
    for command in commands[1:]:
        for name, port in README_PORTS.items():
            command = command.replace(f"127.0.0.1:{port}", f"127.0.0.1:{ports[name]}")
        result = subprocess.run(["bash", "-c", setup + command], cwd=ROOT, capture_output=True, text=True, timeout=60)
        output = result.stdout + result.stderr
        if "99999" in command:  # "a bad id is answered INVALID_ARGUMENT with a BadRequest naming token_ids[1]"
            assert result.returncode != 0 and "InvalidArgument" in output and "token_ids[1]" in output, output
            continue
        assert result.returncode == 0, f"{command}\n{output}"
        if " list" in command:
            assert re.search(r"tito\.v1\.RenderService", output) and "grpc.health.v1.Health" in output
            assert "grpc.reflection.v1.ServerReflection" in output and "grpc.reflection.v1alpha" in output
        if "describe grpc.reflection.v1." in command:
            assert "rpc ServerReflectionInfo ( stream .grpc.reflection.v1.ServerReflectionRequest )" in output, output
        if any(method in command for method in ("/Generate", "/Derender", "/RenderChat")):
            assert "token_ids" in output or "content" in output or "chunk" in output, output
