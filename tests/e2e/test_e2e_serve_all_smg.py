"""End to end: `tito serve all --smg-address 127.0.0.1:PORT` over tito-demo. The one command
starts render, engine, derender and the real SMG (PyPI smg) in front of the engine; the official
`openai` SDK chats through SMG's address, where SMG's own parsers, chosen by tito for the model,
split the demo's `<think>` block and parse its `get_weather` call; SMG's log lines come out
prefixed among the services'; one SIGTERM stops every process and frees every port."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import sys
import time

import openai
import pytest

from service_processes import free_port, wait_until_healthy

pytestmark = [pytest.mark.e2e, pytest.mark.smg]

STOP_SECONDS = 60


def _accepts(host: str, port: int) -> bool:
    with socket.socket() as probe:
        probe.settimeout(1)
        return probe.connect_ex((host, port)) == 0


@pytest.fixture(scope="module")
def served(demo_model, tmp_path_factory):
    """`tito serve all --smg-address` for tito-demo: yields (process, SMG's base URL, engine port,
    the file its output goes to); stopped by the test that checks the stop, else here."""
    directory = tmp_path_factory.mktemp("serve-all-smg")
    engine_port, smg_port = free_port(), free_port()
    output = directory / "serve-all.log"
    with open(output, "wb") as log:
        process = subprocess.Popen(
            [sys.executable, "-m", "tito_cli", "serve", "all", "--model", str(demo_model),
             "--render-address", f"unix:{directory / 'render.sock'}",
             "--derender-address", f"unix:{directory / 'derender.sock'}",
             "--engine-address", f"127.0.0.1:{engine_port}", "--smg-address", f"127.0.0.1:{smg_port}",
             # SMG's metrics default to port 29000 on every interface: one of this machine's instead.
             f"--smg-args=--prometheus-host 127.0.0.1 --prometheus-port {free_port()}"],
            stdout=log, stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{smg_port}"
    try:
        # Listed by the name the engine reports (until then SMG lists "unknown") once SMG has
        # registered the engine as its worker and fetched its tokenizer.
        wait_until_healthy(f"{base}/v1/models", process, timeout=300, name="tito serve all",
                           accept=lambda reply: str(demo_model) in {entry.get("id") for entry in reply.json()["data"]})
        yield process, base, engine_port, output
    finally:
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
            process.wait(STOP_SECONDS)


def test_chats_through_smg_use_the_parsers_tito_chose_for_the_model(served):
    from tito_models import demo

    _, base, _, _ = served
    with openai.OpenAI(base_url=f"{base}/v1", api_key="none", max_retries=0, timeout=120) as client:
        [model] = [entry.id for entry in client.models.list().data]  # the engine's name for it
        greeting = client.chat.completions.create(model=model, max_tokens=80, temperature=0,
                                                  messages=[{"role": "user", "content": "Hello! What can you do?"}])
        message = greeting.choices[0].message
        assert message.content.strip() == demo.GREETING_ANSWER
        assert message.reasoning_content.strip() == "The user says hello. I will say what I can do."
        weather = client.chat.completions.create(
            model=model, max_tokens=80, temperature=0, tools=[demo.WEATHER_TOOL],
            messages=[{"role": "user", "content": "What is the weather in Tokyo?"}])
    [call] = weather.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Tokyo"}


def test_sigterm_stops_smg_and_the_services_and_smgs_lines_are_prefixed(served):
    process, base, engine_port, output = served
    smg_port = int(base.rsplit(":", 1)[1])
    process.send_signal(signal.SIGTERM)
    assert process.wait(STOP_SECONDS) == 0
    # Every child is gone with its parent: neither SMG's port nor the engine's accepts a connection.
    deadline = time.monotonic() + 10
    while (_accepts("127.0.0.1", smg_port) or _accepts("127.0.0.1", engine_port)) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _accepts("127.0.0.1", smg_port) and not _accepts("127.0.0.1", engine_port)
    lines = output.read_text(errors="replace").splitlines()
    smg_lines = [line for line in lines if line.startswith("smg: ")]
    assert smg_lines and not any("\x1b[" in line for line in smg_lines), lines[-20:]  # a log file: no colours
