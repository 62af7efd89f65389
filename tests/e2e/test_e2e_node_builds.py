"""clients/node builds: its TypeScript compiles and its own tests pass (node --test), and
buf.gen.yaml generates TypeScript for the contract with clients/node's pinned buf and ts-proto
that type-checks (tsc --noEmit) and whose bytes Python's protobuf reads as meant (Struct from a
plain object, uint64 from a string, enums from names)."""

from __future__ import annotations

import base64
import json
import re
import shutil
import subprocess

import pytest
from google.protobuf import json_format

from tito.v1 import engine_pb2, multimodal_pb2, render_pb2

from node_project import NODE_DIR, ROOT, ensure_installed, run_tool

pytestmark = [pytest.mark.e2e, pytest.mark.node]


def test_clients_node_pins_the_buf_that_ci_lints_with():
    ci_buf = re.search(r"@bufbuild/buf@([\d.]+)", (ROOT / ".ci" / "run").read_text()).group(1)
    package = json.loads((NODE_DIR / "package.json").read_text())
    assert package["devDependencies"]["@bufbuild/buf"] == ci_buf


def test_generated_typescript_compiles_and_speaks_the_wire_format():
    ensure_installed()
    generated = NODE_DIR / "gen"
    shutil.rmtree(generated, ignore_errors=True)
    run_tool("buf", "generate", cwd=ROOT)
    render = (generated / "tito" / "v1" / "render.ts").read_text()
    assert "export const RenderServiceService" in render and "RenderServiceClient" in render
    assert (generated / "google" / "rpc" / "error_details.ts").exists()
    # `npm run check-gen` (tsc --noEmit over gen/ and typed/), emitting too so that typed/wire_sample.ts
    # can run: one type-check, failing on any error (tsc exits non-zero).
    run_tool("tsc", "-p", "tsconfig.gen.json", "--noEmit", "false")
    request = render_pb2.RenderChatRequest.FromString(base64.b64decode(_wire_sample("encode")))
    assert json_format.MessageToDict(request.chat_template_kwargs) == {  # a plain object, wrapped by ts-proto
        "enable_thinking": False, "depth": {"list": [1, "two", None]}}
    assert request.sampling.seed == 2**64 - 1  # forceLong=string, sent as "18446744073709551615"
    assert request.mm_payload == multimodal_pb2.MM_PAYLOAD_METADATA  # stringEnums=true
    assert request.tool_choice.WhichOneof("choice") == "mode"
    assert request.messages[0].content_parts[1].image.data == bytes([1, 2, 3])
    load = engine_pb2.GetLoadResponse(running_requests=3, finished_requests=2**63 + 5)
    decoded = json.loads(_wire_sample("decode-load", base64.b64encode(load.SerializeToString()).decode()))
    assert decoded["finished_requests"] == str(2**63 + 5) and decoded["running_requests"] == 3


def _wire_sample(*args: str) -> str:
    result = subprocess.run(["node", "dist-gen/typed/wire_sample.js", *args], cwd=NODE_DIR, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


def test_client_compiles_and_its_unit_tests_pass():
    ensure_installed()
    run_tool("tsc", "-p", "tsconfig.json")
    tests = sorted(str(path.relative_to(NODE_DIR)) for path in (NODE_DIR / "dist").glob("*.test.js"))
    assert tests, "no compiled tests in clients/node/dist"
    result = subprocess.run(["node", "--test", *tests], cwd=NODE_DIR, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and "# fail 0" in result.stdout, result.stdout + result.stderr
