"""The gateway over two engines (processes): tito_client's EngineRouter picks each request's
engine, both serve, and an engine that goes away leaves the other serving."""

from __future__ import annotations

import subprocess
import sys

import grpc
import httpx
import pytest

from tito.v1 import engine_pb2, engine_pb2_grpc
from tito_cli.main import stop_all
from tito_client.pipeline import wait_until_serving

from service_processes import running_gateway, running_services

pytestmark = pytest.mark.e2e


def _finished(address: str) -> int:
    with grpc.insecure_channel(address) as channel:
        return engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10) \
            .finished_requests


def test_two_engines_behind_one_gateway(tiny_text_model, tmp_path_factory):
    sockets = tmp_path_factory.mktemp("routing")
    with running_services(tiny_text_model, sockets) as (addresses, _):
        second = f"unix:{sockets / 'engine-2.sock'}"
        engine = subprocess.Popen([sys.executable, "-m", "tito_cli", "serve", "engine", "--address", second,
                                   "--model", str(tiny_text_model), "--log-level", "warning"])
        try:
            wait_until_serving(second, timeout=300)
            both = {**addresses, "engine": f"{addresses['engine']},{second}"}
            with running_gateway(both, ["--served-model-name", "tiny", "--routing-policy", "round_robin"]) as (base, _):
                for i in range(6):
                    reply = httpx.post(f"{base}/v1/completions", timeout=60, json={
                        "model": "tiny", "prompt": f"hello {i}", "max_tokens": 2})
                    assert reply.status_code == 200, reply.text
                assert _finished(addresses["engine"]) >= 2 and _finished(second) >= 2
                stop_all([engine])  # one engine goes away: the other serves every request
                served = [httpx.post(f"{base}/v1/completions", timeout=60, json={
                    "model": "tiny", "prompt": "again", "max_tokens": 2}).status_code for _ in range(4)]
                assert served.count(200) >= 3 and set(served) <= {200, 503}
                assert httpx.get(f"{base}/health", timeout=10).status_code == 200
        finally:
            stop_all([engine])
