"""`tito serve engine` with no flag but --model starts on a machine that is doing other things.

Another process holds half of the machine's memory (touched, so it is really taken); the engine
sizes its KV cache from what is left (tito_engine/kv_sizing.py), logs the capacity as bytes and
tokens of context, and serves. vLLM left to its own sizing would ask for 0.92 of the machine and
refuse to start here.
"""

from __future__ import annotations

import re
import signal
import subprocess
import sys
from collections.abc import Iterator

import grpc
import pytest

from tito_client.pipeline import wait_until_serving
from tito.v1 import engine_pb2, engine_pb2_grpc

pytestmark = pytest.mark.e2e

HOLDER = """
import sys
total = next(int(line.split()[1]) * 1024 for line in open("/proc/meminfo") if line.startswith("MemTotal:"))
held = b"\\1" * (total // 2)  # every page written: the memory is taken, not just reserved
print(len(held), flush=True)
sys.stdin.read()  # until the test closes our stdin
"""


@pytest.fixture
def half_the_memory_held() -> Iterator[int]:
    holder = subprocess.Popen([sys.executable, "-c", HOLDER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        held = int(holder.stdout.readline())
        yield held
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)


def _serve_with_defaults(model: str, address: str, *args: str) -> tuple[str, list[int]]:
    """Start `tito serve engine --model MODEL [ARGS]`, generate once, stop it; its stderr and tokens."""
    process = subprocess.Popen([sys.executable, "-m", "tito_cli", "serve", "engine", "--address", address,
                                "--model", model, "--log-level", "info", *args],
                               stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        try:
            wait_until_serving(address, timeout=600)
        except Exception:
            process.kill()
            raise AssertionError(f"the engine did not start:\n{process.communicate()[1][-4000:]}") from None
        with grpc.insecure_channel(address) as channel:
            responses = engine_pb2_grpc.EngineServiceStub(channel).Generate(engine_pb2.GenerateRequest(
                token_ids=list(range(10, 40)), sampling_params={"max_tokens": 8, "temperature": 0, "ignore_eos": True}),
                timeout=300)
            tokens = [token for response in responses for token in response.token_ids]
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=120)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, stderr[-4000:]
    return stderr, tokens


def _capacity(stderr: str, prefix: str) -> tuple[float, int]:
    match = re.search(rf"{prefix}: ([0-9.]+) GiB = ([0-9,]+) tokens of context", stderr)
    assert match is not None, stderr[-4000:]
    return float(match.group(1)), int(match.group(2).replace(",", ""))


@pytest.mark.vllm
def test_the_vllm_backend_starts_with_no_flags_beside_a_process_holding_half_the_memory(half_the_memory_held,
                                                                                         tmp_path):
    stderr, tokens = _serve_with_defaults("tiny-qwen2-d64", f"unix:{tmp_path / 'engine.sock'}", "--backend", "vllm")
    assert len(tokens) == 8
    gib, context_tokens = _capacity(stderr, "vLLM KV cache")
    # tiny-qwen2-d64 in float32: 1,024 bytes a token; capped at 64 sequences of 2,048 tokens.
    assert context_tokens == 64 * 2048 and gib == pytest.approx(0.125, abs=0.01)
    assert "vLLM computes in float32" in stderr


def test_the_native_engine_sizes_its_cache_from_memory_with_no_flags(half_the_memory_held, tmp_path):
    stderr, tokens = _serve_with_defaults("tiny-qwen2-d64", f"unix:{tmp_path / 'engine.sock'}")
    assert len(tokens) == 8
    _, context_tokens = _capacity(stderr, "KV cache")
    assert context_tokens == 64 * 2048
