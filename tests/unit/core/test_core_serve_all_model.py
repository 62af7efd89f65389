"""`tito serve all --model NAME` builds a built-in model once and starts every service with the name
given, so each reports that name (render's and the engine's GetModelInfo, the gateway's
/v1/models), never the cache directory the name resolves to."""

from __future__ import annotations

import signal
import subprocess
import sys

from tito_cli import main as cli
from tito_models.tiny import TEXT_MODEL


def test_every_service_gets_the_model_name_not_its_cache_path(tiny_text_model, model_cache, tmp_path,
                                                              monkeypatch):
    started: list[list[str]] = []

    class Recorded(subprocess.Popen):
        """Records the command it was given and runs a process that ends at once instead."""

        def __init__(self, args, **kwargs):
            started.append(list(args))
            super().__init__([sys.executable, "-c", "pass"])

    monkeypatch.setenv("TITO_CACHE_DIR", str(model_cache))  # where the fixture built it
    monkeypatch.setattr(subprocess, "Popen", Recorded)
    monkeypatch.setattr(signal, "signal", lambda *_: None)  # serve_all's handlers stay out of pytest
    addresses = [arg for name in cli.SERVICES for arg in (f"--{name}-address", f"unix:{tmp_path / name}.sock")]
    cli.main(["serve", "all", "--model", TEXT_MODEL, "--gateway-address", f"unix:{tmp_path}/gateway.sock",
              *addresses])
    services = [command for command in started if command[3] == "serve" and command[4] in cli.SERVICES]
    assert sorted(command[4] for command in services) == sorted(cli.SERVICES)
    for command in services:
        assert command[command.index("--model") + 1] == TEXT_MODEL, command
    assert str(tiny_text_model) not in " ".join(" ".join(command) for command in started)
