"""End to end: `tito serve render|engine|derender --metrics-port PORT` as processes; after one
chat through them, each /metrics (HTTP GET) counts it."""

from __future__ import annotations

import socket
import time
import urllib.request

import pytest

from tito_client.pipeline import ChatPipeline, Endpoints
from tito.v1 import chat_pb2, render_pb2

from service_processes import running_services

pytestmark = pytest.mark.e2e


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def scrape(port: int, settled_by: str) -> str:
    """/metrics once `settled_by` (a call's count line) is there: a server records a call a moment
    after its client has the status."""
    deadline = time.monotonic() + 10
    while True:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            page = reply.read().decode()
        if settled_by in page.splitlines() or time.monotonic() > deadline:
            return page
        time.sleep(0.02)


#: Lines each page must hold; the first is a call's count (the page is settled once it is there).
EXPECTED = {
    "render": ['tito_grpc_requests_total{code="OK",method="/tito.v1.RenderService/RenderChat"} 1.0',
               'tito_render_duration_seconds_count{kind="chat"} 1.0'],
    "engine": ['tito_grpc_requests_total{code="OK",method="/tito.v1.EngineService/Generate"} 1.0',
               "tito_engine_time_to_first_token_seconds_count 1.0", "tito_engine_generation_tokens_total 4.0"],
    "derender": ['tito_grpc_requests_total{code="OK",method="/tito.v1.DerenderService/Derender"} 1.0',
                 "tito_derender_completion_tokens_total 4.0"],
}


def test_each_service_counts_one_chat_on_its_metrics_port(tiny_text_model, tmp_path):
    ports = {name: free_port() for name in ("render", "engine", "derender")}
    extra = {name: ["--metrics-port", str(port)] for name, port in ports.items()}
    with running_services(tiny_text_model, tmp_path, "cpu", extra) as (addresses, _):
        with ChatPipeline(Endpoints(**addresses), timeout=120) as pipeline:
            chunks = list(pipeline.stream_chat(render_pb2.RenderChatRequest(
                messages=[chat_pb2.ChatMessage(role="user", content="Hello!")],
                sampling=render_pb2.SamplingOptions(max_tokens=4, min_tokens=4, temperature=0.0))))
        assert chunks[-1].finish_reason
        pages = {name: scrape(port, EXPECTED[name][0]) for name, port in ports.items()}
    for name, lines in EXPECTED.items():
        for line in lines:
            assert line in pages[name].splitlines(), (name, line)

