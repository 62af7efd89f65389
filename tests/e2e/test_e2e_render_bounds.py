"""Bounded work per request in `tito serve render` (a process, measured from outside):

- a 50 MB message is refused in under a second, the server's memory grows by less than 100 MB, and
  small renders running meanwhile stay under twice their idle latency;
- runaway chat templates are stopped within a second of their deadline, and afterwards every render
  thread is free again (a normal render is as fast as before, the process is idle).
"""

from __future__ import annotations

import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc
import pytest

from tito.grpc_errors import error_details
from tito_client.pipeline import wait_until_serving
from tito.v1 import chat_pb2, render_pb2, render_pb2_grpc
from tito_render.server import RENDER_THREADS

pytestmark = pytest.mark.e2e

RUNAWAY = "{% for a in range(100000) %}{% for b in range(100000) %}{% endfor %}{% endfor %}{{ messages[0].content }}"


@pytest.fixture(scope="module")
def render_process(tiny_text_model, tmp_path_factory):
    address = f"unix:{tmp_path_factory.mktemp('render') / 'render.sock'}"
    process = subprocess.Popen([sys.executable, "-m", "tito_cli", "serve", "render", "--address", address,
                                "--model", str(tiny_text_model), "--log-level", "warning",
                                "--max-template-seconds", "2"])
    try:
        wait_until_serving(address, timeout=120)
        yield address, process.pid
    finally:
        process.terminate()
        process.wait(30)


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


def _cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / 100  # utime + stime, in clock ticks of 10 ms


def _chat(content: str, **fields) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content=content)], **fields)


def _latency(stub, request) -> float:
    start = time.perf_counter()
    stub.RenderChat(request, timeout=30)
    return time.perf_counter() - start


@contextmanager
def _small_renders_meanwhile(stub, request) -> Iterator[list[float]]:
    """Renders `request` over and over on another thread while the body runs; their latencies."""
    latencies: list[float] = []
    done = threading.Event()

    def loop():
        while not done.is_set():
            latencies.append(_latency(stub, request))

    neighbour = threading.Thread(target=loop)
    neighbour.start()
    try:
        yield latencies
    finally:
        done.set()
        neighbour.join()


def test_a_50_mb_message_is_refused_fast_and_small_renders_keep_their_pace(render_process):
    address, pid = render_process
    options = [("grpc.max_send_message_length", 128 << 20)]
    with grpc.insecure_channel(address, options=options) as channel:
        stub = render_pb2_grpc.RenderServiceStub(channel)
        small = _chat("Hello there, how are you today?")
        for _ in range(20):
            _latency(stub, small)  # warm
        idle = statistics.median(_latency(stub, small) for _ in range(50))
        huge = _chat("x" * (50 << 20))
        rss_before = _rss_mib(pid)
        with _small_renders_meanwhile(stub, small) as busy:
            start = time.perf_counter()
            with pytest.raises(grpc.RpcError) as exc:
                stub.RenderChat(huge, timeout=30)
            elapsed = time.perf_counter() - start
            time.sleep(0.2)
        rss_after = _rss_mib(pid)
    details = error_details(exc.value)
    assert (details["code"], details["reason"], details["fields"]) == (
        grpc.StatusCode.INVALID_ARGUMENT, "PROMPT_TOO_LONG", ["messages[0].content"])
    print(f"\n50 MB message refused in {elapsed * 1000:.0f} ms; RSS {rss_before:.0f} -> {rss_after:.0f} MiB; small "
          f"render p50 idle {idle * 1000:.2f} ms, meanwhile {statistics.median(busy) * 1000:.2f} ms")
    assert elapsed < 1.0
    assert rss_after - rss_before < 100
    assert statistics.median(busy) < 2 * idle + 0.002  # + 2 ms: the timer's grain on a busy 2-core machine


def test_runaway_templates_are_stopped_and_every_render_thread_comes_back(render_process):
    address, pid = render_process
    with grpc.insecure_channel(address) as channel:
        stub = render_pb2_grpc.RenderServiceStub(channel)
        small = _chat("Hello")
        idle = statistics.median(_latency(stub, small) for _ in range(20))
        answers: list[tuple[float, grpc.RpcError]] = []

        def runaway(deadline: float | None):
            start = time.perf_counter()
            try:
                stub.RenderChat(_chat("hi", chat_template=RUNAWAY), timeout=deadline)
            except grpc.RpcError as exc:
                answers.append((time.perf_counter() - start, exc))

        # More runaways than render threads: some stopped by the server's 2 s limit, some whose
        # caller gives up after 1 s (their threads must be freed too).
        threads = [threading.Thread(target=runaway, args=(1.0 if k % 2 else 30,)) for k in range(RENDER_THREADS + 2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        time.sleep(1.0)  # every template past its deadline plus the grace this test allows
        cpu_before = _cpu_seconds(pid)
        time.sleep(1.0)
        cpu_idle = _cpu_seconds(pid) - cpu_before
        after = statistics.median(_latency(stub, small) for _ in range(20))
    codes = sorted({exc.code() for _, exc in answers}, key=str)
    assert len(answers) == RENDER_THREADS + 2 and codes == sorted(
        {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED}, key=str), codes
    limited = [(seconds, exc) for seconds, exc in answers if exc.code() == grpc.StatusCode.RESOURCE_EXHAUSTED]
    assert all(error_details(exc)["reason"] == "TEMPLATE_TIMEOUT" for _, exc in limited)
    # Waiting for a free thread counts toward a call's time: stopped within a second of 2 s, plus
    # one more round for the calls that queued behind the first RENDER_THREADS runaways.
    assert max(seconds for seconds, _ in limited) < 2 * (2.0 + 1.0)
    assert cpu_idle < 0.3, f"the server still burns CPU ({cpu_idle:.2f} s in 1 s): a template is still running"
    assert after < 3 * idle + 0.005


def test_a_long_valid_prompt_does_not_stall_other_renders(render_process):
    """Just under the length bound, the text is tokenized in render's helper process: small renders
    meanwhile keep their pace (the Rust tokenizer would hold this process's GIL throughout)."""
    address, _ = render_process
    with grpc.insecure_channel(address) as channel:
        stub = render_pb2_grpc.RenderServiceStub(channel)
        small = _chat("Hello there")
        long = _chat("the sea " * 15000 + "ok", sampling=render_pb2.SamplingOptions(max_tokens=1))  # 120k characters
        with pytest.raises(grpc.RpcError) as exc:  # tokenized (in the helper): too many tokens for the context
            stub.RenderChat(long, timeout=60)
        assert error_details(exc.value)["reason"] == "PROMPT_TOO_LONG"
        idle = statistics.median(_latency(stub, small) for _ in range(30))
        with _small_renders_meanwhile(stub, small) as busy:
            for _ in range(3):
                with pytest.raises(grpc.RpcError):
                    stub.RenderChat(long, timeout=60)
    assert statistics.median(busy) < 2 * idle + 0.002
    print(f"\nsmall render latency while long prompts render: p50 {statistics.median(busy) * 1000:.1f} ms, "
          f"max {max(busy) * 1000:.1f} ms (idle p50 {idle * 1000:.1f} ms)")
    assert max(busy) < 0.25, f"a small render waited {max(busy) * 1000:.0f} ms behind the long one"
