"""Every bench command a README lists runs, so a refactor cannot break one unseen (bench/derender.py
once ended in an AttributeError after derender's tokenizer changed under it).

The commands are read from the READMEs (README.md, services/*/README.md, docs/*.md): a new bench
command in a README is covered without touching this file. Each runs with `--smoke`, the smallest
settings every bench takes (a few prompts or calls, one round, tito's side alone: no vLLM, `vllm
serve` or other peer), so each takes seconds; two runner processes share the commands out and
run theirs one after another, paying the imports they share (torch, transformers) once
(tests/support/bench_smoke_runner.py). Commands that differ only in the sizes `--smoke` sets
itself run once. Every bench script must be listed by some README.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted(ROOT.glob("services/*/README.md")), *sorted(ROOT.glob("docs/**/*.md"))]
# `bench/NAME.py`, then its flags and their values; `[--optional ...]` parts are left out. The
# command ends at anything else: a backtick, `#`, `(`, a comma, the end of the line.
COMMAND = re.compile(r"bench/(?P<script>\w+)\.py(?P<args>(?:[ \t]+(?:\[[^\]\n`]*\]|--[\w-]+(?:[ \t]+[\w.][\w.-]*)*))*)")
OPTIONAL = re.compile(r"\[[^\]]*\]")
#: Sizes `--smoke` sets itself: commands that differ only in these are one smoke run.
SMOKE_SETS = {"--concurrency", "--repeats", "--rounds"}
#: Two runners at a time, each running its share of the commands in turn.
PARALLEL_RUNS = 2
RUN_TIMEOUT_S = 900


def readme_commands() -> dict[tuple[str, ...], list[str]]:
    """{(script, *args): where the READMEs list it}, args without the sizes --smoke sets."""
    found: dict[tuple[str, ...], list[str]] = {}
    for doc in DOCS:
        for number, line in enumerate(doc.read_text(encoding="utf-8").splitlines(), 1):
            for match in COMMAND.finditer(line):
                args = OPTIONAL.sub(" ", match["args"]).split()
                kept, skipping = [], False
                for arg in args:
                    if arg.startswith("--"):
                        skipping = arg in SMOKE_SETS
                    if not skipping:
                        kept.append(arg)
                found.setdefault((match["script"], *kept), []).append(f"{doc.relative_to(ROOT)}:{number}")
    return found


COMMANDS = readme_commands()


def bench_scripts() -> list[str]:
    """The runnable benches (helpers such as bench/processes.py have no __main__)."""
    return sorted(path.stem for path in (ROOT / "bench").glob("*.py")
                  if 'if __name__ == "__main__":' in path.read_text(encoding="utf-8"))


def test_every_bench_script_is_listed_by_a_readme():
    listed = {command[0] for command in COMMANDS}
    assert set(bench_scripts()) <= listed, (
        f"bench scripts no README lists (so no smoke run covers them): {sorted(set(bench_scripts()) - listed)}")


def test_the_readme_commands_are_found():
    """The parser reads what the READMEs write (a change of their form must not empty the list)."""
    assert ("engine", "--vllm") in COMMANDS and ("engine", "--shape", "qwen2.5-0.5b") in COMMANDS
    assert ("derender",) in COMMANDS and ("epd",) in COMMANDS
    assert ("failover",) in COMMANDS  # three engines, one killed and restarted: request migration's cost
    assert ("pd",) in COMMANDS  # prefill/decode disaggregation against the same engines colocated


def run_smoke(commands: list[tuple[str, ...]], cache_dir: Path, results: Path) -> dict[str, dict]:
    """Run `commands` one after another in one runner process (tests/support/bench_smoke_runner.py:
    the imports the benches share are paid once); their outcomes by command JSON."""
    environment = dict(os.environ, TITO_CACHE_DIR=str(cache_dir))
    runner = ROOT / "tests" / "support" / "bench_smoke_runner.py"
    try:
        subprocess.run([sys.executable, str(runner), str(results), *(json.dumps(c) for c in commands)], cwd=ROOT,
                       env=environment, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        pass  # the commands it finished are in the file; the others are missing
    return json.loads(results.read_text()) if results.exists() else {}


@pytest.fixture(scope="module")
def smoke_runs(model_cache, tmp_path_factory) -> dict[str, dict]:
    """Every command's outcome; PARALLEL_RUNS runners share them out."""
    commands = list(COMMANDS)
    shares = [commands[index::PARALLEL_RUNS] for index in range(PARALLEL_RUNS)]
    directory = tmp_path_factory.mktemp("bench-smoke")
    with ThreadPoolExecutor(PARALLEL_RUNS) as pool:
        runs = [pool.submit(run_smoke, share, model_cache, directory / f"runner-{index}.json")
                for index, share in enumerate(shares)]
        return {command: outcome for run in runs for command, outcome in run.result().items()}


@pytest.mark.parametrize("command", list(COMMANDS), ids=" ".join)
def test_readme_bench_command_runs(smoke_runs, command):
    where = f"bench/{' '.join(command)} --smoke (listed at {', '.join(COMMANDS[command])})"
    outcome = smoke_runs.get(json.dumps(command))
    assert outcome is not None, f"{where} did not finish within the runner's {RUN_TIMEOUT_S} s"
    assert outcome["status"] == 0, f"{where} exited {outcome['status']}:\n{outcome['output']}"
