"""Chaos, bounded: three native engines as processes behind the router, 32 greedy chats at
concurrency 32; one engine is SIGKILLed mid-stream and restarted on its address. No chat fails,
every output equals its undisturbed run (the same chats on one engine), the restarted engine
serves again, and nothing is left running on any engine afterwards (no KV slot leaked)."""

from __future__ import annotations

import asyncio
import threading

import grpc
import pytest

from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, render_pb2
from tito_client import AsyncChatPipeline, EngineRouter, Endpoints
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

from engine_processes import EngineProcess, free_address

pytestmark = pytest.mark.e2e

CHATS = 32
NEW_TOKENS = 96
TIMEOUT = 120
WORDS = "sea sky river stone cloud garden lantern harbour meadow violin winter amber".split()


def chat(k: int) -> render_pb2.RenderChatRequest:
    words = " ".join(WORDS[(k + i) % len(WORDS)] for i in range(3 + k % 5))
    return render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content=f"Tell a story about {words}, number {k}.")],
        sampling=render_pb2.SamplingOptions(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True))


def outcome(chunks) -> tuple[str, int, int]:
    usage = [chunk.usage for chunk in chunks if chunk.HasField("usage")][-1]
    return "".join(chunk.content for chunk in chunks), usage.prompt_tokens, usage.completion_tokens


@pytest.fixture
def engines(tiny_text_model, tmp_path):
    fleet = [EngineProcess(tiny_text_model, free_address(), tmp_path).start() for _ in range(3)]
    try:
        for engine in fleet:
            engine.wait_serving()
        yield fleet
    finally:
        for engine in fleet:
            engine.stop()


async def run_chats(render: str, derender: str, addresses: list[str], policy: str,
                    on_streaming=None) -> list:
    with EngineRouter(addresses, policy=policy, load_interval=0.05) as router:
        async with AsyncChatPipeline(Endpoints(render, addresses[0], derender), timeout=TIMEOUT,
                                     router=router) as pipeline:
            streaming = 0

            async def one(k: int):
                nonlocal streaming
                chunks, counted = [], False
                async for chunk in pipeline.stream_chat(chat(k)):
                    chunks.append(chunk)
                    if chunk.content and not counted:
                        counted, streaming = True, streaming + 1
                        if on_streaming is not None:
                            on_streaming(streaming, router)
                return chunks

            return await asyncio.gather(*(one(k) for k in range(CHATS)), return_exceptions=True)


def test_an_engine_sigkilled_and_restarted_mid_stream_loses_no_chat(engines, tiny_text_model, aio_server):
    model = str(tiny_text_model)
    render = aio_server(lambda: create_render(RenderConfig(address="127.0.0.1:0", model=model))).address
    derender = aio_server(lambda: create_derender(DerenderConfig(address="127.0.0.1:0", model=model))).address
    undisturbed = asyncio.run(run_chats(render, derender, [engines[2].address], "least_load"))
    expected = [outcome(chunks) for chunks in undisturbed]

    victim = engines[0]
    killed: dict[str, int] = {}
    restarted = threading.Event()

    def kill_and_restart():
        victim.kill()
        victim.start().wait_serving()
        restarted.set()

    def on_streaming(streaming: int, router: EngineRouter) -> None:
        # Once half the chats are streaming, the engine dies at the first moment it has chats of
        # its own in flight (its chats may all have ended by the half-way mark on a fast machine).
        if killed or streaming < CHATS // 2:
            return
        in_flight = router.status()[victim.address]["in_flight"]
        if in_flight:
            killed["in_flight"] = in_flight
            threading.Thread(target=kill_and_restart, daemon=True).start()

    results = asyncio.run(run_chats(render, derender, [engine.address for engine in engines], "least_load",
                                    on_streaming))
    failed = [result for result in results if isinstance(result, BaseException)]
    assert not failed, failed[:3]
    assert killed.get("in_flight", 0) > 0  # the engine died with chats of its own in flight
    assert [outcome(chunks) for chunks in results] == expected
    assert restarted.wait(TIMEOUT) and victim.starts == 2
    for engine in engines:  # nothing running or waiting anywhere: no slot left behind
        with grpc.insecure_channel(engine.address) as channel:
            load = engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        assert (load.running_requests, load.waiting_requests, load.kv_blocks_used) == (0, 0, 0)
