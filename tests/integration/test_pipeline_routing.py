"""Chats through render -> routed engine -> derender over three real native engines: a follow-up
turn goes to the engine that holds its prefix (and is served from its cache), an engine killed
mid-run loses no chat (each continues on another engine, request migration), draining engines
finish or hand over theirs while new chats go elsewhere, and a rolling restart loses nothing."""

from __future__ import annotations

import asyncio
import json

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tito.grpc_errors import error_details
from tito_client import AsyncChatPipeline, ChatPipeline, EngineRouter, Endpoints
from tito_client.routing import Choice
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, render_pb2
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.config import EngineConfig
from tito_engine.server import create_server as create_engine
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render
from waiting import wait_for

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


def solo_runs(pipeline, requests) -> list[tuple[str, int, int]]:
    """Each chat alone, one after another: (text, prompt tokens, completion tokens)."""
    return [outcome(list(pipeline.stream_chat(request))) for request in requests]


def outcome(chunks) -> tuple[str, int, int]:
    usage = usage_of(chunks)
    return "".join(chunk.content + chunk.reasoning_content for chunk in chunks), usage.prompt_tokens, \
        usage.completion_tokens


def long_chats(count: int, max_tokens: int) -> list[render_pb2.RenderChatRequest]:
    """Greedy chats, and seeded sampled ones (odd k): both must continue exactly after a move."""
    requests = [chat([f"Count to {k} slowly."], max_tokens=max_tokens, ignore_eos=True) for k in range(count)]
    for k, request in enumerate(requests):
        if k % 2:
            request.sampling.temperature, request.sampling.seed = 1.0, 1000 + k
    return requests


def idle(engine) -> bool:
    with engine.channel() as channel:
        load = engine_pb2_grpc.EngineServiceStub(channel).GetLoad(engine_pb2.GetLoadRequest(), timeout=5)
    return load.running_requests + load.waiting_requests + load.kv_blocks_used == 0  # no KV block held


async def stream_all(pipelines, requests, started: list[asyncio.Event]):
    async def run(k):
        chunks = []
        async for chunk in pipelines[k].stream_chat(requests[k]):
            chunks.append(chunk)
            if chunk.content:
                started[k].set()
        return chunks

    return [asyncio.ensure_future(run(k)) for k in range(len(requests))]


async def all_streaming(tasks, started: list[asyncio.Event]) -> None:
    """Until every chat has text; a chat that ends or fails before (its error raised here) or
    TIMEOUT fails the test instead of leaving it waiting for an event that never comes."""
    waits = [asyncio.ensure_future(event.wait()) for event in started]
    pending = set(waits) | set(tasks)
    try:
        while not all(event.is_set() for event in started):
            done, pending = await asyncio.wait(pending, timeout=TIMEOUT, return_when=asyncio.FIRST_COMPLETED)
            if not done:
                raise AssertionError(f"chats without text after {TIMEOUT} s")
            for task in done & set(tasks):
                k = tasks.index(task)
                if not started[k].is_set():
                    task.result()  # its error, if it failed
                    raise AssertionError(f"chat {k} ended before it streamed any text")
    finally:
        for wait in waits:
            wait.cancel()


def test_an_engine_killed_mid_run_loses_no_chat_and_every_output_equals_its_solo_run(fleet):
    """The engine dies with chats in flight; each continues on another engine from the ids it had
    (request migration): 0 chats fail, every text (greedy and seeded) and usage equals its solo run."""
    render, derender, engines = fleet
    addresses = [engine.address for engine in engines]
    victim = engines[0]
    requests = long_chats(6, max_tokens=160)
    with EngineRouter(addresses[1:], load_interval=0.05) as router, \
            ChatPipeline(Endpoints(render, addresses[1], derender), timeout=TIMEOUT, router=router) as pipeline:
        expected = solo_runs(pipeline, requests)

    async def main():
        with EngineRouter(addresses, policy="round_robin", load_interval=0.05) as router:
            async with AsyncChatPipeline(Endpoints(render, addresses[0], derender), timeout=TIMEOUT,
                                         router=router) as pipeline:
                started = [asyncio.Event() for _ in requests]
                tasks = await stream_all([pipeline] * len(requests), requests, started)  # round robin: 2 each
                await all_streaming(tasks, started)
                assert router.status()[victim.address]["in_flight"] == 2
                # The engine dies with chats in flight: its gRPC server goes away at once.
                await asyncio.to_thread(victim.call, lambda: victim.running.server.stop(0))
                results = await asyncio.gather(*tasks, return_exceptions=True)
                assert not [r for r in results if isinstance(r, BaseException)]
                assert [outcome(chunks) for chunks in results] == expected
                assert not router.status()[victim.address]["reachable"]
                router.policy = "cache_aware"
                after = [await run_new(pipeline, k) for k in range(4)]
                assert victim.address not in after

    async def run_new(pipeline, k):
        chunks = [chunk async for chunk in pipeline.stream_chat(chat([f"A new question {k}."]))]
        assert usage_of(chunks).completion_tokens > 0
        return pipeline.last_engine

    asyncio.run(main())
    for survivor in engines[1:]:  # nothing left running or waiting there (no slot leaked)
        wait_for(lambda: idle(survivor), "the survivor idle")


class StartsOn(EngineRouter):
    """Sends every new chat to `first` while it is reachable (moves go where the policy says)."""

    def __init__(self, addresses, first: str, **kwargs):
        super().__init__(addresses, **kwargs)
        self.first = first

    def pick(self, request, avoid=None):
        if avoid is None and self.status()[self.first]["reachable"]:
            return Choice(self.first, 0, "test")
        return super().pick(request, avoid)


def test_n_choices_and_structured_output_continue_exactly_when_their_engine_dies(fleet):
    """A seeded n = 2 chat (each choice continued on its own, choice i under seed + i) and a
    json_schema chat (the new engine advances the grammar over the earlier ids) lose their engine
    mid-stream: every choice's text equals the solo run's and the JSON still parses."""
    render, derender, engines = fleet
    addresses = [engine.address for engine in engines]
    victim = engines[0]
    choices = chat(["Count to 9 slowly."], max_tokens=120, ignore_eos=True)
    choices.sampling.n, choices.sampling.temperature, choices.sampling.seed = 2, 1.0, 4242
    schema = {"type": "object", "properties": {"words": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                         "minItems": 20, "maxItems": 20}},
              "required": ["words"], "additionalProperties": False}
    structured = chat(["List twenty words."], max_tokens=600)
    structured.chat_template_kwargs.update({"enable_thinking": False})  # the constraint from the first token
    structured.response_format.type = "json_schema"
    structured.response_format.json_schema.name = "words"
    structured.response_format.json_schema.schema.update(schema)
    requests = [choices, structured]
    with EngineRouter(addresses[1:], load_interval=0.05) as router, \
            ChatPipeline(Endpoints(render, addresses[1], derender), timeout=TIMEOUT, router=router) as pipeline:
        expected = [texts_by_choice(list(pipeline.stream_chat(request))) for request in requests]

    async def main():
        with StartsOn(addresses, victim.address, load_interval=0.05) as router:
            async with AsyncChatPipeline(Endpoints(render, addresses[0], derender), timeout=TIMEOUT,
                                         router=router) as pipeline:
                started = [asyncio.Event() for _ in requests]
                tasks = await stream_all([pipeline] * len(requests), requests, started)
                await all_streaming(tasks, started)
                assert router.status()[victim.address]["in_flight"] == 2
                await asyncio.to_thread(victim.call, lambda: victim.running.server.stop(0))
                return await asyncio.wait_for(asyncio.gather(*tasks), TIMEOUT)

    results = [texts_by_choice(chunks) for chunks in asyncio.run(main())]
    assert results == expected
    assert len(results[0]) == 2 and results[0][0] != results[0][1]  # two distinct seeded choices
    assert len(json.loads(results[1][0])["words"]) == 20
    for survivor in engines[1:]:
        wait_for(lambda: idle(survivor), "the survivor idle")


def texts_by_choice(chunks) -> dict[int, str]:
    texts: dict[int, str] = {}
    for chunk in chunks:
        texts[chunk.index] = texts.get(chunk.index, "") + chunk.content
    return texts


def test_draining_engines_finish_or_hand_over_their_chats_and_take_no_new_ones(fleet):
    """One engine drains with a long grace period (its chat finishes there), one is stopped as
    SIGTERM stops it with a short one (its chat is ended as "engine gone" and continues on the
    third); new chats go to the third only, and a draining engine says so in GetLoad and health."""
    render, derender, engines = fleet
    addresses = [engine.address for engine in engines]
    patient, stopping, survivor = engines
    requests = long_chats(3, max_tokens=500)
    with EngineRouter([survivor.address], load_interval=0.05) as router, \
            ChatPipeline(Endpoints(render, survivor.address, derender), timeout=TIMEOUT, router=router) as pipeline:
        expected = solo_runs(pipeline, requests)

    async def main():
        with EngineRouter(addresses, policy="round_robin", load_interval=0.05) as router:
            # One pipeline each (last_engine says where each chat ended), on DerenderBatch as the gateway runs.
            pipelines = [AsyncChatPipeline(Endpoints(render, addresses[0], derender), timeout=TIMEOUT, router=router,
                                           batch_derender=True) for _ in requests]
            started = [asyncio.Event() for _ in requests]
            tasks = await stream_all(pipelines, requests, started)
            await all_streaming(tasks, started)
            homes = {pipeline.last_engine for pipeline in pipelines}
            assert homes == set(addresses)
            async with grpc.aio.insecure_channel(patient.address) as channel:
                stub = engine_pb2_grpc.EngineServiceStub(channel)
                with pytest.raises(grpc.RpcError) as wrong:
                    await stub.Drain(engine_pb2.DrainRequest(grace_seconds=-1.0), timeout=5)
                assert wrong.value.code() == grpc.StatusCode.INVALID_ARGUMENT
                assert error_details(wrong.value)["fields"] == ["grace_seconds"]
                assert not (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)).draining  # refused: no drain
                drained = await stub.Drain(engine_pb2.DrainRequest(grace_seconds=60.0), timeout=5)
                assert drained.in_flight_requests == 1
                assert (await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=5)).draining
                health = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
                assert health.status == health_pb2.HealthCheckResponse.NOT_SERVING
                with pytest.raises(grpc.RpcError) as refused:
                    async for _ in stub.Generate(engine_pb2.GenerateRequest(token_ids=[1, 2]), timeout=5):
                        pass
                assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
                assert error_details(refused.value)["reason"] == "ENGINE_DRAINING"
            assert all(not task.done() for task in tasks)
            stop = asyncio.ensure_future(asyncio.to_thread(stopping.call, lambda: stopping.running.stop(0.1)))
            results = await asyncio.gather(*tasks)
            await stop
            assert [outcome(chunks) for chunks in results] == expected
            finals = [pipeline.last_engine for pipeline in pipelines]  # where each chat ended
            assert patient.address in finals and stopping.address not in finals
            wait_for(lambda: router.status()[patient.address]["draining"], "the router saw the drain")
            for k in range(3):
                chunks = [chunk async for chunk in pipelines[0].stream_chat(chat([f"A new question {k}."]))]
                assert usage_of(chunks).completion_tokens > 0 and pipelines[0].last_engine == survivor.address
            for pipeline in pipelines:
                await pipeline.close()

    asyncio.run(main())


def test_a_rolling_restart_of_every_engine_under_load_loses_no_chat(fleet, tiny_text_model, aio_server):
    """Each engine in turn stops as SIGTERM stops it (drain, a short grace period) while chats run
    on it, and a new engine starts on its address; chats keep coming all along. Every chat
    completes with its solo run's text."""
    render, derender, engines = fleet
    addresses = [engine.address for engine in engines]
    requests = long_chats(6, max_tokens=200)
    with EngineRouter([addresses[0]], load_interval=0.05) as router, \
            ChatPipeline(Endpoints(render, addresses[0], derender), timeout=TIMEOUT, router=router) as pipeline:
        expected = solo_runs(pipeline, requests)

    def replacement(address: str):
        return aio_server(lambda: create_engine(EngineConfig(address=address, model=str(tiny_text_model), device="cpu",
                                                             engine_process=False, max_model_len=2048)))

    async def main():
        with EngineRouter(addresses, policy="least_load", load_interval=0.05) as router:
            async with AsyncChatPipeline(Endpoints(render, addresses[0], derender), timeout=TIMEOUT,
                                         router=router) as pipeline:
                restarting = True
                outcomes: list[tuple[int, tuple]] = []
                busy_at_stop: list[int] = []

                async def worker(first: int):
                    k = first
                    while restarting:
                        chunks = [chunk async for chunk in pipeline.stream_chat(requests[k % len(requests)])]
                        outcomes.append((k % len(requests), outcome(chunks)))
                        k += 1

                async def rolling_restart():
                    nonlocal restarting
                    for engine in engines:
                        await asyncio.to_thread(wait_for, lambda: router.status()[engine.address]["in_flight"] > 0,
                                                "chats on the engine about to restart")
                        busy_at_stop.append(router.status()[engine.address]["in_flight"])
                        await asyncio.to_thread(engine.call, lambda: engine.running.stop(0.2))  # SIGTERM's path
                        await asyncio.to_thread(replacement, engine.address)
                        await asyncio.to_thread(wait_for, lambda: router.status()[engine.address]["reachable"]
                                                and not router.status()[engine.address]["draining"], "it is back")
                    restarting = False

                await asyncio.gather(rolling_restart(), *(worker(first) for first in range(6)))
                assert len(busy_at_stop) == 3 and min(busy_at_stop) > 0
                assert len(outcomes) >= 6
                assert [result for k, result in outcomes] == [expected[k] for k, _ in outcomes]

    asyncio.run(main())
