"""An engine that cannot start says why in one line naming the flag that fixes it, and exits 2:
a model directory it cannot load, a KV size the machine cannot hold or that cannot hold one
request, on both backends; the model's files are checked before anything else is logged."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def serve_engine(*args: str, log_level: str = "warning", timeout: float = 600) -> tuple[int, list[str]]:
    """Run `tito serve engine ARGS` to its exit; its status and its non-empty stderr lines."""
    command = [sys.executable, "-m", "tito_cli", "serve", "engine", "--log-level", log_level, *args]
    result = subprocess.run(command, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    return result.returncode, [line for line in result.stderr.splitlines() if line.strip()]


#: What importing vLLM logs on a CPU machine at WARNING (e.g. that its Triton has no CPU backend):
#: vLLM's own records, not tito's, and no traceback.
VLLM_IMPORT_WARNING = re.compile(r"^\d{4}-\d\d-\d\d [\d:,]+ WARNING engine \[-\] vllm\.")


def one_line(lines: list[str], vllm: bool) -> str:
    """The one line the refusal is; with vLLM imported, only vLLM's own import warnings precede it."""
    before = [line for line in lines[:-1] if not (vllm and VLLM_IMPORT_WARNING.match(line))]
    assert lines and not before, lines
    return lines[-1]


def _memory_total() -> int:
    return next(int(line.split()[1]) * 1024 for line in Path("/proc/meminfo").read_text().splitlines()
                if line.startswith("MemTotal:"))


@pytest.fixture
def no_weights(tmp_path) -> Path:
    model = tmp_path / "no-weights"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "qwen2"}')
    return model


@pytest.fixture
def truncated(tiny_text_model_d64, tmp_path) -> Path:
    model = tmp_path / "truncated"
    shutil.copytree(tiny_text_model_d64, model)
    with (model / "model.safetensors").open("r+b") as weights:
        weights.truncate(100_000)
    return model


@pytest.fixture
def unknown_architecture(tiny_text_model_d64, tmp_path) -> Path:
    model = tmp_path / "unknown"
    shutil.copytree(tiny_text_model_d64, model)
    config = json.loads((model / "config.json").read_text())
    config["architectures"] = ["NoSuchForCausalLM"]
    (model / "config.json").write_text(json.dumps(config))
    return model


BACKENDS = [pytest.param(("--backend", "native"), id="native"),
            pytest.param(("--backend", "vllm"), id="vllm", marks=pytest.mark.vllm)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_model_without_weights_is_one_line_before_any_start_up_line(backend, no_weights, tmp_path):
    code, lines = serve_engine("--address", f"unix:{tmp_path / 's.sock'}", "--model", str(no_weights), *backend,
                               log_level="info")
    # Not even the config / CPU placement / listening / bind lines: the model is checked first.
    assert code == 2 and len(lines) == 1, lines
    assert lines[0] == (f"tito serve engine: --model {no_weights}: no weight files "
                        f"(*.safetensors, pytorch_model*.bin) in {no_weights}")


@pytest.mark.parametrize("backend", BACKENDS)
def test_truncated_weights_are_one_line(backend, truncated, tmp_path):
    code, lines = serve_engine("--address", f"unix:{tmp_path / 's.sock'}", "--model", str(truncated), *backend,
                               log_level="info")
    assert code == 2 and len(lines) == 1, lines
    assert lines[0].startswith(f"tito serve engine: --model {truncated}: {truncated / 'model.safetensors'} is "
                               f"truncated or damaged"), lines


@pytest.mark.vllm
def test_a_model_vllm_cannot_serve_is_one_line(unknown_architecture, tmp_path):
    code, lines = serve_engine("--address", f"unix:{tmp_path / 's.sock'}", "--model", str(unknown_architecture),
                               "--backend", "vllm")
    line = one_line(lines, vllm=True)
    assert code == 2, lines
    assert line.startswith(f"tito serve engine: vLLM cannot serve --model {unknown_architecture}: "), lines
    assert "NoSuchForCausalLM" in line and len(line) < 400, lines


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_kv_size_the_machine_cannot_hold_is_one_line_naming_the_flag(backend, tiny_text_model_d64, tmp_path):
    too_much = 2 * _memory_total()
    code, lines = serve_engine("--address", f"unix:{tmp_path / 's.sock'}", "--model", str(tiny_text_model_d64),
                               "--kv-cache-bytes", str(too_much), *backend)
    line = one_line(lines, vllm="vllm" in backend)
    assert code == 2 and line.startswith(f"tito serve engine: --kv-cache-bytes {too_much} "), lines
    assert "does not fit in memory" in line and "lower --kv-cache-bytes" in line, lines


@pytest.mark.vllm
def test_a_kv_size_below_one_full_context_is_one_line_naming_the_flags(tiny_text_model_d64, tmp_path):
    # tiny-qwen2-d64 in float32: 1,024 bytes a token, 2,048 positions: vLLM needs 2 MiB for one request.
    code, lines = serve_engine("--address", f"unix:{tmp_path / 's.sock'}", "--model", str(tiny_text_model_d64),
                               "--backend", "vllm", "--kv-cache-bytes", str(1 << 20))
    line = one_line(lines, vllm=True)
    assert code == 2 and "cannot hold one request of the full context (2,048 tokens" in line, lines
    assert "raise --kv-cache-bytes to at least 2097152" in line and "lower --max-model-len to 1024" in line, lines


@pytest.mark.vllm
def test_gemma3_on_vllms_cpu_build_is_one_line_naming_the_native_backend(tiny_interleaved_vl_model, tmp_path):
    # vLLM's CPU attention has no mask for image tokens attending both ways; it would run them causally.
    code, lines = serve_engine("--address", f"unix:{tmp_path / 's.sock'}", "--model", str(tiny_interleaved_vl_model),
                               "--backend", "vllm")
    line = one_line(lines, vllm=True)
    assert code == 2 and line.startswith(f"tito serve engine: vLLM cannot serve --model {tiny_interleaved_vl_model} "
                                         f"on CPU: its image tokens attend to one another in both directions "
                                         f"(gemma3)"), lines
    assert line.endswith("serve it with --backend native"), lines
