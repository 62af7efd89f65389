"""clients/node builds: its TypeScript compiles and its own tests pass (node --test), and
buf.gen.yaml generates TypeScript for the contract with clients/node's pinned buf and ts-proto
that type-checks (tsc --noEmit)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import pytest

from node_project import NODE_DIR, ROOT, ensure_installed, run_tool

pytestmark = [pytest.mark.e2e, pytest.mark.node]


def test_clients_node_pins_the_buf_that_ci_lints_with():
    ci_buf = re.search(r"@bufbuild/buf@([\d.]+)", (ROOT / ".ci" / "run").read_text()).group(1)
    package = json.loads((NODE_DIR / "package.json").read_text())
    assert package["devDependencies"]["@bufbuild/buf"] == ci_buf


def test_generated_typescript_compiles():
    ensure_installed()
    generated = NODE_DIR / "gen"
    shutil.rmtree(generated, ignore_errors=True)
    run_tool("buf", "generate", cwd=ROOT)
    render = (generated / "tito" / "v1" / "render.ts").read_text()
    assert "export const RenderServiceService" in render and "RenderServiceClient" in render
    assert (generated / "google" / "rpc" / "error_details.ts").exists()
    assert "finished_requests: string" in (generated / "tito" / "v1" / "engine.ts").read_text()  # forceLong
    run_tool("tsc", "-p", "tsconfig.gen.json")


def test_client_compiles_and_its_unit_tests_pass():
    ensure_installed()
    run_tool("tsc", "-p", "tsconfig.json")
    tests = sorted(str(path.relative_to(NODE_DIR)) for path in (NODE_DIR / "dist").glob("*.test.js"))
    assert tests, "no compiled tests in clients/node/dist"
    result = subprocess.run(["node", "--test", *tests], cwd=NODE_DIR, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "# fail 0" in result.stdout, result.stdout + result.stderr
