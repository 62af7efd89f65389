"""Shared fixtures: tiny models built once per session, and grpc.aio servers on port 0.

pytest-grpc cannot host grpc.aio servicers, so `AioServer` is the small equivalent: it runs a
service's real `create_server(config)` on an event loop in a background thread, exposes the bound
address, and shuts the server down cleanly. Tests talk to it with ordinary synchronous stubs.
"""

from __future__ import annotations

import asyncio
import importlib.util
import os
import threading
from collections.abc import Awaitable, Callable
from pathlib import Path

import grpc
import pytest

from tito.demo_model import ensure_demo_model
from tito.tiny_models import INTERLEAVED_VL_MODEL, TEXT_MODEL, TEXT_MODEL_D64, VL_MODEL, ensure_model


def pytest_runtest_setup(item: pytest.Item) -> None:
    """Tests marked `vllm` skip where vLLM is not installed, unless TITO_REQUIRE_VLLM is set (the
    README's test command sets it): there a missing vLLM fails them instead of hiding them."""
    if item.get_closest_marker("vllm") is None or importlib.util.find_spec("vllm") is not None:
        return
    if os.environ.get("TITO_REQUIRE_VLLM"):
        pytest.fail("vLLM is not installed but TITO_REQUIRE_VLLM is set: run bash scripts/bootstrap.sh --vllm")
    pytest.skip("needs vLLM (bash scripts/bootstrap.sh --vllm)")


@pytest.fixture(scope="session")
def model_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="session")
def tiny_text_model(model_cache) -> Path:
    return ensure_model(TEXT_MODEL, model_cache)


@pytest.fixture(scope="session")
def tiny_text_model_d64(model_cache) -> Path:
    """tiny-qwen2 with head_dim 64: the text model both engine backends load (vLLM's CPU attention
    refuses head_dim 16)."""
    return ensure_model(TEXT_MODEL_D64, model_cache)


@pytest.fixture(scope="session")
def tiny_vl_model(model_cache) -> Path:
    return ensure_model(VL_MODEL, model_cache)


@pytest.fixture(scope="session")
def tiny_interleaved_vl_model(model_cache) -> Path:
    """A tiny Gemma3: image spans interleave boundary tokens with soft tokens (is_embed masks)."""
    return ensure_model(INTERLEAVED_VL_MODEL, model_cache)


@pytest.fixture(scope="session")
def demo_model(model_cache) -> Path:
    """tito-demo: the Qwen2-VL tito trains itself (once per session, seconds to a minute)."""
    return ensure_demo_model(model_cache)


class AioServer:
    """Runs `factory()` (a coroutine returning a tito.serving.RunningServer) on a private loop."""

    def __init__(self, factory: Callable[[], Awaitable]):
        self._factory = factory
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="aio-server")
        self.running = None

    def start(self) -> "AioServer":
        self._thread.start()
        try:
            self.running = asyncio.run_coroutine_threadsafe(self._factory(), self._loop).result(timeout=120)
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

    def start(factory):
        server = AioServer(factory).start()
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
