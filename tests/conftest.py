"""Shared fixtures: tiny models built once per session, and grpc.aio servers on port 0.

pytest-grpc cannot host grpc.aio servicers, so `AioServer` is the small equivalent: it runs a
service's real `create_server(config)` on an event loop in a background thread, exposes the bound
address, and shuts the server down cleanly. Tests talk to it with ordinary synchronous stubs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest
from filelock import FileLock

# Test support code (tokenizers with real vocabularies, family tokenizers) lives beside the tests,
# not in the runtime package; test modules import it by module name.
sys.path.insert(0, str(Path(__file__).parent / "support"))

from smg_calls import smg_command  # noqa: E402
from source_tree import PACKAGE_ROOTS  # noqa: E402
from tito.contract import ERROR_REASONS  # noqa: E402
from tito_models.demo import ensure_demo_model  # noqa: E402
from tito.errors import TitoError  # noqa: E402
from tito_models.tiny import (INTERLEAVED_VL_MODEL, LLAMA_MODEL, LLAMA_MODEL_D64, PADDED_TEXT_MODEL,  # noqa: E402
                              QWEN2_5_VL_MODEL, QWEN3_MODEL, QWEN3_VL_MODEL, SMG_VL_MODEL, TEXT_MODEL, TEXT_MODEL_D64,
                              VL_MODEL, ensure_model)

# Every error reason raised in this test process, so the session can fail if one is missing from
# the contract's ErrorReason enum (the static scan in test_core_error_reasons.py cannot see
# reasons computed at run time).
_RAISED_REASONS: set[str] = set()
_original_error_init = TitoError.__init__


_PACKAGE_DIRS = tuple(str(root) + os.sep for root in PACKAGE_ROOTS.values())


def _recording_error_init(self, message, *, reason, **kwargs):
    # Only errors tito's own code raises: tests build errors with made-up reasons on purpose.
    if sys._getframe(1).f_code.co_filename.startswith(_PACKAGE_DIRS):
        _RAISED_REASONS.add(reason)
    _original_error_init(self, message, reason=reason, **kwargs)


TitoError.__init__ = _recording_error_init


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    worker_output = getattr(session.config, "workeroutput", None)
    if worker_output is not None:  # an xdist test process: the controlling one reports for all
        worker_output["raised_reasons"] = sorted(_RAISED_REASONS)
        return
    undocumented = sorted(_RAISED_REASONS - ERROR_REASONS)
    if undocumented:
        session.config.get_terminal_writer().line(
            f"error reasons raised but missing from proto/tito/v1/errors.proto: {undocumented}", red=True)
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.hookimpl(optionalhook=True)
def pytest_testnodedown(node, error) -> None:
    """An xdist test process ended: the reasons it saw raised join this process's."""
    _RAISED_REASONS.update(getattr(node, "workeroutput", {}).get("raised_reasons", ()))


def pytest_terminal_summary(terminalreporter, exitstatus: int, config: pytest.Config) -> None:
    """The CPU class the run was on, beside its counts (quiet runs too): tests that need an
    instruction set skip on the other classes, so a green run says which class it covered."""
    from tito.cpu_isa import describe

    terminalreporter.write_line(f"cpu class: {describe()}")


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `vllm` skip where vLLM is not installed, tests marked `smg` where SMG's `smg`
    command is, and tests marked `node` where Node.js or npm is missing, unless TITO_REQUIRE_VLLM /
    TITO_REQUIRE_SMG / TITO_REQUIRE_NODE is set (the README's test command sets them): there a
    missing tool fails them instead of hiding them."""
    if item.get_closest_marker("vllm") is not None and importlib.util.find_spec("vllm") is None:
        if os.environ.get("TITO_REQUIRE_VLLM"):
            pytest.fail("vLLM is not installed but TITO_REQUIRE_VLLM is set: run bash scripts/bootstrap.sh --vllm")
        pytest.skip("needs vLLM (bash scripts/bootstrap.sh --vllm)")
    if item.get_closest_marker("smg") is not None and smg_command() is None:
        if os.environ.get("TITO_REQUIRE_SMG"):
            pytest.fail("the smg command is not installed but TITO_REQUIRE_SMG is set: run bash scripts/bootstrap.sh")
        pytest.skip("needs SMG's smg command (PyPI smg, in tito's test extra: bash scripts/bootstrap.sh)")
    if item.get_closest_marker("node") is not None and not (shutil.which("node") and shutil.which("npm")):
        if os.environ.get("TITO_REQUIRE_NODE"):
            pytest.fail("Node.js and npm are not on PATH but TITO_REQUIRE_NODE is set: install Node.js 20 or newer")
        pytest.skip("needs Node.js 20+ and npm on PATH")


def xdist_worker() -> str | None:
    """The pytest-xdist worker this process is ("gw0", ...), None when pytest runs alone."""
    return os.environ.get("PYTEST_XDIST_WORKER")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    """Where the tiny models are built. The test processes of one run share it (their base temp
    directories have one parent): builds are atomic (tiny.build_cached), so a model two processes
    ask for at once is built at most twice and used by both."""
    if xdist_worker() is None:
        return tmp_path_factory.mktemp("models")
    shared = tmp_path_factory.getbasetemp().parent / "models"
    shared.mkdir(exist_ok=True)
    return shared


@pytest.fixture(scope="session")
def tiny_text_model(model_cache) -> Path:
    return ensure_model(TEXT_MODEL, model_cache)


@pytest.fixture(scope="session")
def tiny_text_model_d64(model_cache) -> Path:
    """tiny-qwen2 with head_dim 64: the text model both engine backends load (vLLM's CPU attention
    refuses head_dim 16)."""
    return ensure_model(TEXT_MODEL_D64, model_cache)


@pytest.fixture(scope="session")
def tiny_padded_model(model_cache) -> Path:
    """tiny-qwen2 with 1088 embedding rows for its 1013-entry tokenizer (ids 1013..1087 are
    padding ids), like real checkpoints' padded vocabularies."""
    return ensure_model(PADDED_TEXT_MODEL, model_cache)


@pytest.fixture(scope="session")
def tiny_vl_model(model_cache) -> Path:
    return ensure_model(VL_MODEL, model_cache)


@pytest.fixture(scope="session")
def tiny_interleaved_vl_model(model_cache) -> Path:
    """A tiny Gemma3: image spans interleave boundary tokens with soft tokens (is_embed masks)."""
    return ensure_model(INTERLEAVED_VL_MODEL, model_cache)


@pytest.fixture(scope="session")
def tiny_llama_model(model_cache) -> Path:
    """A tiny Llama 3.1-style model (rope_type llama3, GQA, no biases)."""
    return ensure_model(LLAMA_MODEL, model_cache)


@pytest.fixture(scope="session")
def tiny_llama_model_d64(model_cache) -> Path:
    """tiny-llama with head_dim 64 (the same rotary scaling): the Llama both engine backends load
    (vLLM's CPU attention refuses head_dim 16)."""
    return ensure_model(LLAMA_MODEL_D64, model_cache)


@pytest.fixture(scope="session")
def tiny_qwen3_model(model_cache) -> Path:
    """A tiny Qwen3 (per-head q/k norms, head_dim 32 from the config)."""
    return ensure_model(QWEN3_MODEL, model_cache)


@pytest.fixture(scope="session")
def tiny_qwen2_5_vl_model(model_cache) -> Path:
    """A tiny Qwen2.5-VL (windowed vision attention, video time axis in M-RoPE)."""
    return ensure_model(QWEN2_5_VL_MODEL, model_cache)


@pytest.fixture(scope="session")
def tiny_qwen3_vl_model(model_cache) -> Path:
    """A tiny Qwen3-VL (interleaved M-RoPE, DeepStack, timestamped video spans; head_dim 64)."""
    return ensure_model(QWEN3_VL_MODEL, model_cache)


@pytest.fixture(scope="session")
def tiny_smg_vl_model(model_cache) -> Path:
    """tiny-qwen2-vl with `<image>` for its image pad token, as SMG's Qwen2-VL preprocessing wants."""
    return ensure_model(SMG_VL_MODEL, model_cache)


@pytest.fixture(scope="module")
def renderer(tiny_vl_model):
    """render's Renderer over the tiny Qwen2-VL, one per test module. A module that renders with
    another model, limits or signer overrides this fixture with its own `load_renderer(...)`."""
    from renderers import load_renderer  # importing render takes seconds: only modules that render pay it

    return load_renderer(tiny_vl_model)


def _start_demo_build(tmp_path_factory) -> tuple[Path, subprocess.Popen]:
    """A tito-demo build in a process of its own, into <its directory>/again."""
    directory = tmp_path_factory.mktemp("demo-again")
    with open(directory / "build.log", "wb") as log:
        process = subprocess.Popen([sys.executable, "-m", "tito_models.demo", str(directory / "again")],
                                   stdout=log, stderr=subprocess.STDOUT)
    return directory, process


@pytest.fixture(scope="session")
def _demo_second_build(request, tmp_path_factory):
    """A second tito-demo build, for sessions with a test of `demo_rebuild`: a process of its own,
    started just before `demo_model` trains. A build keeps to one core (demo.THREADS), so on two
    cores both builds take the time of one instead of the rebuild's minute later on."""
    # With several test processes every one collects every test, so none knows it will run the
    # rebuild: the rebuild then trains when its test asks, beside the other process's tests.
    if xdist_worker() is not None or not any("demo_rebuild" in item.fixturenames for item in request.session.items):
        yield None
        return
    directory, process = _start_demo_build(tmp_path_factory)
    yield directory, process
    if process.poll() is None:  # the session ended before the test that waits for it ran
        process.kill()
        process.wait()


@pytest.fixture(scope="session")
def demo_model(model_cache, _demo_second_build) -> Path:
    """tito-demo: the Qwen2-VL tito trains itself (once per run, seconds to a minute: a test
    process that finds another one training it waits for that build)."""
    with FileLock(model_cache / "tito-demo.lock"):
        return ensure_demo_model(model_cache)


@pytest.fixture(scope="session")
def demo_rebuild(demo_model, _demo_second_build, tmp_path_factory) -> Path:
    """A second tito-demo build from scratch, in another process than `demo_model`'s."""
    directory, process = _demo_second_build or _start_demo_build(tmp_path_factory)
    assert process.wait(timeout=900) == 0, (directory / "build.log").read_text(errors="replace")
    return directory / "again"


class AioServer:
    """Runs `factory()` (a coroutine returning a tito.serving.RunningServer) on a private loop."""

    def __init__(self, factory: Callable[[], Awaitable]):
        self._factory = factory
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="aio-server")
        self.running = None

    def start(self, timeout: float = 120) -> "AioServer":
        self._thread.start()
        try:
            self.running = asyncio.run_coroutine_threadsafe(self._factory(), self._loop).result(timeout=timeout)
        except BaseException:
            self.stop()  # nothing started: do not leave the loop's thread behind
            raise
        return self

    @property
    def address(self) -> str:
        return self.running.address

    def channel(self) -> grpc.Channel:
        return grpc.insecure_channel(self.address)

    def call(self, coro_factory: Callable[[], Awaitable], timeout: float = 30):
        """Run a coroutine on the server's loop (e.g. to inspect server state)."""
        return asyncio.run_coroutine_threadsafe(coro_factory(), self._loop).result(timeout=timeout)

    def stop(self, grace: float = 1.0) -> None:
        if self.running is not None:
            asyncio.run_coroutine_threadsafe(self.running.stop(grace), self._loop).result(timeout=60)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)

    def __enter__(self) -> "AioServer":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


def _server_starter():
    """A `start(factory) -> AioServer` function and the list of servers it started."""
    started: list[AioServer] = []

    def start(factory, timeout: float = 120):
        server = AioServer(factory).start(timeout)
        started.append(server)
        return server

    return start, started


def _stop_all(started: list[AioServer]) -> None:
    for server in reversed(started):
        server.stop()


@pytest.fixture
def aio_server():
    """Factory fixture: `aio_server(lambda: create_server(config))` -> started AioServer."""
    start, started = _server_starter()
    yield start
    _stop_all(started)


@pytest.fixture(scope="module")
def module_aio_server():
    """Like `aio_server`, but the servers live for the whole test module (load a model once)."""
    start, started = _server_starter()
    yield start
    _stop_all(started)
