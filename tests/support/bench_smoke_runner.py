"""Runs bench commands with --smoke one after another in one process, for tests/e2e/test_bench_smoke.py.

    python tests/support/bench_smoke_runner.py RESULTS.json '["engine", "--vllm"]' '["derender"]' ...

Each command runs as `python bench/<name>.py ARGS --smoke` would run it (the script as __main__ with
its own argv and the bench directory on the path), so the imports the benches share (torch,
transformers, tito's services: seconds each) are paid once per runner, not once per command. A
command's outcome (its exit status, or 1 and the traceback for an exception) goes to
RESULTS.json, keyed by its JSON; a command that fails does not stop the ones after it.
"""

from __future__ import annotations

import contextlib
import io
import json
import runpy
import sys
import time
import traceback
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"


def run(script: str, args: list[str]) -> tuple[int, str]:
    """(exit status, the output's tail) of one bench command."""
    output = io.StringIO()
    path = BENCH / f"{script}.py"
    sys.argv = [str(path), *args, "--smoke"]
    try:
        with contextlib.redirect_stdout(output), contextlib.redirect_stderr(output):
            runpy.run_path(str(path), run_name="__main__")
        status = 0
    except SystemExit as exit_:
        status = exit_.code if isinstance(exit_.code, int) else (0 if exit_.code is None else 1)
        if not isinstance(exit_.code, int | None):
            output.write(str(exit_.code))
    except BaseException:  # noqa: BLE001 - the command failed: report it, run the next one
        status = 1
        output.write(traceback.format_exc())
    return status, output.getvalue()[-6000:]


def main() -> int:
    results_path, *commands = sys.argv[1:]
    sys.path.insert(0, str(BENCH))  # as `python bench/<name>.py` puts it there (benches import bench/processes.py)
    results = {}
    for command in commands:
        script, *args = json.loads(command)
        started = time.monotonic()
        status, output = run(script, args)
        results[command] = {"status": status, "output": output, "seconds": time.monotonic() - started}
        Path(results_path).write_text(json.dumps(results))  # as it goes: a runner killed later keeps these
    return 0


if __name__ == "__main__":
    sys.exit(main())
