"""Chats through render -> routed engine -> derender over three real native engines: a follow-up
turn goes to the engine that holds its prefix (and is served from its cache), policies spread the
work, and an engine killed mid-run fails only its own in-flight chats, with a clear status, while
new chats go elsewhere and nothing else is lost."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tito_client import AsyncChatPipeline, ChatPipeline, EngineRouter, Endpoints
from tito.v1 import chat_pb2, render_pb2
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.config import EngineConfig
from tito_engine.server import create_server as create_engine
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

TIMEOUT = 120
SYSTEM = ("You are a careful assistant. Answer in one short sentence, and always mention the number "
          "you were asked about. Never add anything else. ") * 3


def chat(turns: list[str], max_tokens: int = 8, ignore_eos: bool = False) -> render_pb2.RenderChatRequest:
    messages = [chat_pb2.ChatMessage(role="system", content=SYSTEM)]
    for index, text in enumerate(turns):
        messages.append(chat_pb2.ChatMessage(role="user" if index % 2 == 0 else "assistant", content=text))
    return render_pb2.RenderChatRequest(messages=messages, sampling=render_pb2.SamplingOptions(
        max_tokens=max_tokens, temperature=0.0, ignore_eos=ignore_eos))


@pytest.fixture
def fleet(tiny_text_model, aio_server):
    model = str(tiny_text_model)
    render = aio_server(lambda: create_render(RenderConfig(address="127.0.0.1:0", model=model)))
    derender = aio_server(lambda: create_derender(DerenderConfig(address="127.0.0.1:0", model=model)))
    engines = [aio_server(lambda: create_engine(EngineConfig(address="127.0.0.1:0", model=model, device="cpu",
                                                             engine_process=False, max_model_len=2048)))
               for _ in range(3)]
    return render.address, derender.address, engines


def usage_of(chunks):
    return [chunk.usage for chunk in chunks if chunk.HasField("usage")][-1]


def wait_for(predicate, what, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.02)
    raise AssertionError(f"never happened: {what}")


def test_follow_up_turns_go_where_their_prefix_is(fleet):
    render, derender, engines = fleet
    addresses = [engine.address for engine in engines]
    with EngineRouter(addresses, load_interval=0.05) as router, \
            ChatPipeline(Endpoints(render, addresses[0], derender), timeout=TIMEOUT, router=router) as pipeline:
        first_turns = [[f"Tell me about the number {k}."] for k in range(3)]
        homes = []
        for turns in first_turns:
            chunks = list(pipeline.stream_chat(chat(turns)))
            assert usage_of(chunks).completion_tokens > 0
            homes.append(pipeline.last_engine)
        for turns, home in zip(first_turns, homes):
            follow_up = chat(turns + ["It is a fine number.", "And what about twice that number?"])
            wait_for(lambda: router.pick(pipeline.render.RenderChat(follow_up, timeout=TIMEOUT).generate_request)
                     .address == home, "the first turn's blocks indexed")
            chunks = list(pipeline.stream_chat(follow_up))
            assert pipeline.last_engine == home
            assert usage_of(chunks).prompt_tokens > 0
        # The shared system prompt made every engine warm for it; the follow-ups hit their own
        # conversation's blocks: served from the cache, not recomputed.
        assert all(router.status()[address]["cached_blocks"] > 0 for address in set(homes))


def test_an_engine_killed_mid_run_fails_only_its_own_chats(fleet):
    render, derender, engines = fleet
    addresses = [engine.address for engine in engines]
    victim = engines[0]

    async def main():
        with EngineRouter(addresses, policy="round_robin", load_interval=0.05) as router:
            async with AsyncChatPipeline(Endpoints(render, addresses[0], derender), timeout=TIMEOUT,
                                         router=router) as pipeline:
                started: dict[int, asyncio.Event] = {k: asyncio.Event() for k in range(6)}

                async def run(k):
                    chunks = []
                    async for chunk in pipeline.stream_chat(chat([f"Count to {k} slowly."], max_tokens=600,
                                                                 ignore_eos=True)):
                        chunks.append(chunk)
                        started[k].set()
                    return chunks

                tasks = [asyncio.ensure_future(run(k)) for k in range(6)]  # round robin: 2 per engine
                await asyncio.gather(*(started[k].wait() for k in range(6)))
                on_victim = router.status()[victim.address]["in_flight"]
                assert on_victim == 2
                # The engine dies with chats in flight: its gRPC server goes away at once.
                await asyncio.to_thread(victim.call, lambda: victim.running.server.stop(0))
                results = await asyncio.gather(*tasks, return_exceptions=True)
                failed = [r for r in results if isinstance(r, BaseException)]
                assert len(failed) == 2
                for error in failed:  # a clear status: the engine went away, not an internal error
                    assert isinstance(error, grpc.RpcError)
                    assert error.code() == grpc.StatusCode.UNAVAILABLE
                for chunks in (r for r in results if not isinstance(r, BaseException)):
                    assert usage_of(chunks).completion_tokens == 600  # nothing else was lost
                wait_for(lambda: not router.status()[victim.address]["reachable"], "the dead engine left out")
                router.policy = "cache_aware"
                after = [await run_new(pipeline, router, k) for k in range(4)]
                assert victim.address not in after

    async def run_new(pipeline, router, k):
        request = chat([f"A new question {k}."])
        chunks = [chunk async for chunk in pipeline.stream_chat(request)]
        assert usage_of(chunks).completion_tokens > 0
        return pipeline.last_engine

    asyncio.run(main())
