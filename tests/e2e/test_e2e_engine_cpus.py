"""`tito serve engine` on CPU (a process, read from /proc): the engine core runs on the last CPU,
the server (every thread of it) on the others, and the core's thread for a lone prefill's linears
on the server's (none with `--no-cpu-lone-prefill-borrow`); `--core-cpus none` pins nothing."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tito.cpu_affinity import allowed_cpus, format_cpu_list
from tito_client.pipeline import wait_until_serving

pytestmark = [pytest.mark.e2e,
              pytest.mark.skipif(len(allowed_cpus()) < 2 or not Path("/proc/self/task").is_dir(),
                                 reason="needs Linux and at least 2 CPUs")]


def cpus_by_thread(pid: int) -> dict[int, str]:
    lists = {}
    for task in Path(f"/proc/{pid}/task").iterdir():
        for line in (task / "status").read_text().splitlines():
            if line.startswith("Cpus_allowed_list:"):
                lists[int(task.name)] = line.split(":", 1)[1].strip()
    return lists


def cpus_of_every_thread(pid: int) -> set[str]:
    return set(cpus_by_thread(pid).values())


def check_core_threads(pid: int, core: str, lent: str | None) -> None:
    """The core's main thread on `core`; its others there too, but for the lone prefill's (on `lent`)."""
    threads = cpus_by_thread(pid)
    assert threads.pop(pid) == core
    assert set(threads.values()) <= {core, lent}, threads
    assert (lent in threads.values()) == (lent is not None), threads


def core_pid(server_pid: int) -> int:
    children = []
    for entry in Path("/proc").iterdir():
        try:
            if (entry.name.isdigit() and int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == server_pid
                    and b"resource_tracker" not in (entry / "cmdline").read_bytes()):  # multiprocessing's helper
                children.append(int(entry.name))
        except OSError:  # a process that ended meanwhile
            pass
    assert len(children) == 1, children
    return children[0]


LAST, OTHERS = format_cpu_list({max(allowed_cpus())}), format_cpu_list(allowed_cpus() - {max(allowed_cpus())})


@pytest.mark.parametrize("flags, core, server, lent", [
    ([], LAST, OTHERS, OTHERS),
    (["--no-cpu-lone-prefill-borrow"], LAST, OTHERS, None),
    (["--core-cpus", "none"], format_cpu_list(allowed_cpus()), format_cpu_list(allowed_cpus()), None),
])
def test_the_engine_core_gets_cpus_of_its_own(tiny_text_model, tmp_path, flags, core, server, lent):
    address = f"unix:{tmp_path / 'engine.sock'}"
    process = subprocess.Popen([sys.executable, "-m", "tito_cli", "serve", "engine", "--address", address,
                                "--model", str(tiny_text_model), "--device", "cpu", "--cpu-threads", "1",
                                "--log-level", "warning", *flags])
    try:
        wait_until_serving(address, timeout=120)
        assert cpus_of_every_thread(process.pid) == {server}
        check_core_threads(core_pid(process.pid), core, lent)
    finally:
        process.terminate()
        process.wait(30)


def children_by_service(parent_pid: int) -> dict[str, int]:
    """`tito serve all`'s three service processes, by the service each runs."""
    found = {}
    for entry in Path("/proc").iterdir():
        try:
            if not entry.name.isdigit() or int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) != parent_pid:
                continue
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:  # a process that ended meanwhile
            continue
        if b"serve" in argv:
            found[argv[argv.index(b"serve") + 1].decode()] = int(entry.name)
    return found


def test_serve_all_keeps_render_and_derender_off_the_engine_core(tiny_text_model, tmp_path):
    """As a user starts it, with no placement flag: the engine core on the last CPU, render, derender
    and the engine's server on the others (a tiny model: the core keeps a CPU to itself)."""
    addresses = {name: f"unix:{tmp_path / f'{name}.sock'}" for name in ("render", "engine", "derender")}
    flags = [flag for name, address in addresses.items() for flag in (f"--{name}-address", address)]
    process = subprocess.Popen([sys.executable, "-m", "tito_cli", "serve", "all", "--model", str(tiny_text_model),
                                "--device", "cpu", "--log-level", "warning", *flags])
    try:
        for address in addresses.values():
            wait_until_serving(address, timeout=180)
        services = children_by_service(process.pid)
        assert set(services) == {"render", "engine", "derender"}
        for name in ("render", "derender", "engine"):
            assert cpus_of_every_thread(services[name]) == {OTHERS}, name
        check_core_threads(core_pid(services["engine"]), LAST, OTHERS)
    finally:
        process.terminate()
        process.wait(60)
