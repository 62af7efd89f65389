"""clients/node for the tests: `npm ci` once per package-lock.json, then its local tools."""

from __future__ import annotations

import hashlib
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
NODE_DIR = ROOT / "clients" / "node"
NODE_BIN = NODE_DIR / "node_modules" / ".bin"


def ensure_installed() -> None:
    """`npm ci` unless node_modules already holds this exact lock file's packages (a stamp named
    after the lock file's hash says so), so repeated runs reuse node_modules."""
    lock = hashlib.sha256((NODE_DIR / "package-lock.json").read_bytes()).hexdigest()[:16]
    stamp = NODE_DIR / "node_modules" / f".tito-installed-{lock}"
    if stamp.exists():
        return
    result = subprocess.run(["npm", "ci", "--no-audit", "--no-fund"], cwd=NODE_DIR, capture_output=True,
                            text=True, timeout=600)
    assert result.returncode == 0, f"npm ci failed in clients/node:\n{result.stdout}\n{result.stderr}"
    stamp.touch()


def run_tool(name: str, *args: str, cwd: Path = NODE_DIR, timeout: float = 300) -> subprocess.CompletedProcess:
    """Run a tool that clients/node's packages install (tsc, buf, ...), asserting success."""
    result = subprocess.run([str(NODE_BIN / name), *args], cwd=cwd, capture_output=True, text=True,
                            timeout=timeout)
    assert result.returncode == 0, f"{name} {' '.join(args)} failed:\n{result.stdout}\n{result.stderr}"
    return result
