"""`tito serve all --smg-address`: SMG's command line (the engine as its worker, tito's parsers in
SMG's names, the engine's grace, the user's flags last), the addresses SMG can use, the start-up
error when SMG is not installed, and SMG's output prefixed among the services' lines."""

from __future__ import annotations

import io
import re
import signal
import subprocess
import sys
import threading

import pytest

from tito.config import ConfigError
from tito.parsers import REASONING_FORMATS, TOOL_FORMATS
from tito_cli import main as cli
from tito_cli import smg as smg_launch

from engine_processes import free_address


def test_tito_parsers_become_smgs_names_and_none_becomes_passthrough():
    assert smg_launch.parser_flags("qwen3", "hermes") == ["--reasoning-parser", "qwen3", "--tool-call-parser", "qwen"]
    # tito parses nothing: SMG must not guess a parser from the model's name either.
    assert smg_launch.parser_flags("", "") == ["--reasoning-parser", "passthrough", "--tool-call-parser", "passthrough"]
    # SMG reads harmony its own way: no flag rather than a wrong one.
    assert smg_launch.parser_flags("gpt_oss", "gpt_oss") == []


def test_qwen3_reasoning_without_tool_calls_takes_smgs_symphony_table_alone():
    # SMG's legacy qwen3 files a think-less answer as reasoning; its qwen3_tagged table does as tito
    # does, and SMG takes no other parser name beside it.
    assert smg_launch.parser_flags("qwen3", "") == ["--parser", "symphony", "--reasoning-parser", "qwen3_tagged"]
    # deepseek_r1 starts in reasoning in both: SMG's legacy parser is the same format.
    assert smg_launch.parser_flags("deepseek_r1", "") == ["--reasoning-parser", "deepseek_r1",
                                                          "--tool-call-parser", "passthrough"]


def _choices(help_text: str, flag: str) -> set[str]:
    match = re.search(re.escape(flag) + r" \{([^}]*)\}", help_text)
    assert match, flag
    return set(match.group(1).split(","))


@pytest.mark.smg
def test_every_smg_parser_name_tito_declares_is_one_the_installed_smg_offers():
    help_text = subprocess.run([smg_launch.smg_executable(), "launch", "--help"], capture_output=True, text=True,
                               timeout=60).stdout
    for flag, table in (("--reasoning-parser", REASONING_FORMATS), ("--tool-call-parser", TOOL_FORMATS)):
        offered = _choices(help_text, flag)
        declared = {name for entry in table.values() for name in (entry.smg, getattr(entry, "smg_symphony", ""))
                    if name} | {smg_launch.SMG_NO_PARSER}
        assert declared <= offered, (flag, declared - offered)


def test_smg_dials_the_engine_over_tcp_and_a_wildcard_listener_on_the_loopback():
    assert smg_launch.worker_url("10.0.0.5:50052") == "grpc://10.0.0.5:50052"
    assert smg_launch.worker_url("0.0.0.0:50052") == "grpc://127.0.0.1:50052"
    assert smg_launch.worker_url("[::]:50052") == "grpc://[::1]:50052"
    for address in ("unix:/run/engine.sock", "127.0.0.1:0", "nohost"):
        with pytest.raises(ConfigError, match="HOST:PORT"):
            smg_launch.worker_url(address)


def test_smg_not_installed_is_a_start_up_error_that_says_how_to_install_it(monkeypatch, capsys):
    monkeypatch.setattr(smg_launch, "smg_executable", lambda: None)
    built = []
    monkeypatch.setattr(cli, "build_once", built.append)
    assert cli.main(["serve", "all", "--smg-address", "127.0.0.1:38080"]) == 2
    error = capsys.readouterr().err
    assert "tito serve all: --smg-address needs SMG's `smg` command" in error and "pip install smg==" in error
    assert not built  # refused before any model is built


def test_smg_needs_a_tcp_engine_address(monkeypatch, capsys):
    monkeypatch.setattr(smg_launch, "smg_executable", lambda: "/usr/bin/true")
    assert cli.main(["serve", "all", "--smg-address", "127.0.0.1:38080", "--engine-address", "unix:engine.sock"]) == 2
    assert "--engine-address 'unix:engine.sock': SMG needs HOST:PORT" in capsys.readouterr().err


def test_smg_args_without_smg_is_refused(capsys):
    assert cli.main(["serve", "all", "--smg-args=--policy cache_aware"]) == 2
    assert "--smg-args needs --smg-address" in capsys.readouterr().err


def test_serve_all_starts_smg_over_its_engine_with_the_models_parsers(tiny_text_model, tmp_path, monkeypatch):
    started: list[list[str]] = []

    class Recorded(subprocess.Popen):
        """Records the command it was given and runs a process that prints one line and ends."""

        def __init__(self, args, **kwargs):
            started.append(list(args))
            super().__init__([sys.executable, "-c", "print('ready')"], **kwargs)

    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # serve_all's handlers stay out of pytest
    monkeypatch.setattr(smg_launch, "smg_executable", lambda: "/opt/smg/bin/smg")
    monkeypatch.setattr("tito_render.model.model_parsers", lambda config: ("qwen3", "hermes"))
    serving = threading.Event()
    serving.set()  # the recorded engine never serves: SMG starts as if it did
    monkeypatch.setattr(cli, "_serving_event", lambda address: serving)
    engine, smg_address = free_address(), free_address()
    monkeypatch.setenv("TITO_GRACE_SECONDS", "7")  # the engine's grace: SMG's too
    cli.main(["serve", "all", "--model", str(tiny_text_model), f"--render-address=unix:{tmp_path}/render.sock",
              f"--derender-address=unix:{tmp_path}/derender.sock", "--engine-address", engine,
              "--smg-address", smg_address, "--smg-args=--policy cache_aware --log-level debug"])
    [smg] = [command for command in started if command[0] == "/opt/smg/bin/smg"]
    host, port = smg_address.rsplit(":", 1)
    assert smg == ["/opt/smg/bin/smg", "launch", "--backend", "vllm", "--worker-urls", f"grpc://{engine}",
                   "--host", host, "--port", port, "--log-level", "info", "--shutdown-grace-period-secs", "7",
                   "--reasoning-parser", "qwen3", "--tool-call-parser", "qwen",
                   "--policy", "cache_aware", "--log-level", "debug"]


def test_smgs_output_is_prefixed_line_by_line_without_colour_codes_off_a_terminal():
    sink = io.StringIO()
    output = "listening on 127.0.0.1:8080\n\x1b[2m2026-12-07\x1b[0m \x1b[32m INFO\x1b[0m worker grpc://a registered\n"
    smg_launch.forward_lines(io.StringIO(output), "smg: ", sink).join(5)
    assert sink.getvalue() == "smg: listening on 127.0.0.1:8080\nsmg: 2026-12-07  INFO worker grpc://a registered\n"


@pytest.mark.smg
def test_the_command_tito_builds_is_one_smgs_launcher_parses():
    from smg.launch_router import parse_router_args

    command = smg_launch.smg_command("smg", "127.0.0.1:8080", "0.0.0.0:50052", "warning", 12.5,
                                     smg_launch.parser_flags("deepseek_r1", "kimi_k2"), ["--policy", "round_robin"])
    parsed = parse_router_args(command[2:])
    assert parsed.worker_urls == ["grpc://127.0.0.1:50052"] and (parsed.host, parsed.port) == ("127.0.0.1", 8080)
    assert (parsed.reasoning_parser, parsed.tool_call_parser) == ("deepseek_r1", "kimik2")
    assert parsed.policy == "round_robin" and parsed.log_level == "warn" and parsed.shutdown_grace_period_secs == 12
