"""Each service installs and runs with only what it needs.

- In this environment (everything installed), `tito serve derender` serves and `tito serve render
  --help` answers without importing torch, xgrammar or transformers' model code (sys.modules read
  in a fresh process).
- `pip install ".[derender]"` into a fresh virtual environment (nothing else in it) runs a
  Derender stream, and that environment has no torch and no xgrammar at all.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import venv
from pathlib import Path

import grpc
import pytest

from source_tree import ROOT
from tito.v1 import derender_pb2, derender_pb2_grpc, engine_pb2
from tito_client.pipeline import wait_until_serving

pytestmark = pytest.mark.e2e

#: Modules whose presence means a heavy stack was loaded.
HEAVY = ("torch", "xgrammar", "transformers.models")


def _loaded_heavy(code: str) -> list[str]:
    script = textwrap.dedent(code) + textwrap.dedent(f"""
        import sys
        print(sorted(name for name in sys.modules if any(name == h or name.startswith(h + ".") for h in {HEAVY!r})))
    """)
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return eval(result.stdout.strip().splitlines()[-1])  # noqa: S307 - our own script's list of names


def test_serving_derender_imports_no_torch(tiny_text_model, tmp_path):
    address = f"unix:{tmp_path / 'derender.sock'}"
    loaded = _loaded_heavy(f"""
        import asyncio
        from tito_cli.main import build_parser
        from tito_derender import server

        args = build_parser(["derender"]).parse_args(
            ["serve", "derender", "--address", {address!r}, "--model", {str(tiny_text_model)!r}])
        config = server.config_from_args(args)

        async def serve_once():
            running = await server.create_server(config)
            await running.stop(0)

        asyncio.run(serve_once())
    """)
    assert loaded == []


def test_render_help_imports_no_torch():
    loaded = _loaded_heavy("""
        import contextlib, io
        from tito_cli.main import main
        with contextlib.redirect_stdout(io.StringIO()), contextlib.suppress(SystemExit):
            main(["serve", "render", "--help"])
    """)
    assert loaded == []


@pytest.fixture(scope="module")
def derender_venv(tmp_path_factory) -> Path:
    """A fresh virtual environment holding `tito[derender]` and what it depends on, nothing else."""
    home = tmp_path_factory.mktemp("derender-venv")
    venv.EnvBuilder(with_pip=True).create(home)
    python = home / "bin" / "python"
    install = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-compile", "--disable-pip-version-check",
                              f"{ROOT}[derender]"], capture_output=True, text=True, timeout=1200)
    assert install.returncode == 0, install.stderr[-3000:]
    return home


def test_derender_alone_has_no_torch_and_no_xgrammar(derender_venv):
    listed = subprocess.run([str(derender_venv / "bin" / "python"), "-m", "pip", "list", "--format", "freeze"],
                            capture_output=True, text=True, timeout=120, check=True).stdout.lower()
    names = {line.split("==")[0] for line in listed.splitlines()}
    assert "tito" in names and "transformers" in names
    assert not names & {"torch", "xgrammar", "triton", "pillow"}, names


def test_derender_alone_runs_a_stream(derender_venv, tiny_text_model, tmp_path):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(tiny_text_model))
    ids = tokenizer.encode(" Hello there, café!", add_special_tokens=False)
    address = f"unix:{tmp_path / 'derender.sock'}"
    env = {key: value for key, value in os.environ.items() if not key.startswith("TITO_")}
    process = subprocess.Popen([str(derender_venv / "bin" / "tito"), "serve", "derender", "--address", address,
                                "--model", str(tiny_text_model), "--log-level", "warning"],
                               env=env, stderr=subprocess.PIPE, text=True)
    try:
        wait_until_serving(address, timeout=120)
        with grpc.insecure_channel(address) as channel:
            stub = derender_pb2_grpc.DerenderServiceStub(channel)
            requests = [derender_pb2.DerenderRequest(context=derender_pb2.DerenderContext(request_id="alone"))]
            requests += [derender_pb2.DerenderRequest(generate_response=engine_pb2.GenerateResponse(
                index=0, token_ids=[token])) for token in ids]
            requests.append(derender_pb2.DerenderRequest(generate_response=engine_pb2.GenerateResponse(
                index=0, finish_reason=engine_pb2.FINISH_REASON_LENGTH)))
            chunks = [reply.chunk for reply in stub.Derender(iter(requests), timeout=60)]
        assert "".join(chunk.content for chunk in chunks) == tokenizer.decode(ids)
        assert chunks[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
        # The same interpreter cannot import torch at all: derender did all of the above without it.
        probe = subprocess.run([str(derender_venv / "bin" / "python"), "-c", "import torch"],
                               capture_output=True, text=True, timeout=60)
        assert probe.returncode != 0 and "No module named 'torch'" in probe.stderr
    finally:
        process.terminate()
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_derender_alone_refuses_to_build_a_tiny_model_in_one_line(derender_venv, tmp_path):
    """Without torch a tiny model cannot be built: one line naming the fix, exit status 2."""
    env = {key: value for key, value in os.environ.items() if not key.startswith("TITO_")}
    env["TITO_CACHE_DIR"] = str(tmp_path / "empty-cache")
    result = subprocess.run([str(derender_venv / "bin" / "tito"), "serve", "derender", "--address",
                             f"unix:{tmp_path / 'd.sock'}", "--model", "tiny-qwen2"],
                            env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.splitlines() if line.startswith("tito serve derender:")]
    assert len(lines) == 1 and "tito[models]" in lines[0], result.stderr[-2000:]
