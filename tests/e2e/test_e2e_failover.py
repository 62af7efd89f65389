"""Failover that loses nothing, bounded: three native engines as processes behind the router, 128
greedy chats at concurrency 32.

- Chaos: one engine, then another, is SIGKILLed mid-stream and restarted on its address (kill,
  restart, kill another; two kills, as each restart loads torch anew). No chat fails, every
  output equals its undisturbed run, the router sees each restarted engine and routes to it
  again, and the survivors hold no KV block after.
- Rolling restart: every engine in turn is sent SIGTERM (it drains: finishes or hands back its
  chats), exits and starts again on its port, under the same load. No chat fails, outputs equal.

The chats run in phases (one more than the disruptions): each disruption fires from a chat's text while the chosen
engine has chats of its own in flight, and the next phase starts once the engine is back and the
router has seen it. Every step waits on state it can observe (router status, health, GetLoad),
never on a clock, so a slow or a fast machine runs the same scenario.
"""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Callable

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

CHATS = 128
CONCURRENCY = 32
KILLS = 2  # kill, restart, kill another: the chats run in KILLS + 1 phases
NEW_TOKENS = 24
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


class RecordingRouter(EngineRouter):
    """The router, remembering where it sent each request (to see a restarted engine used again)
    and which engines chats moved away from (request migration picks with `avoid`)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.picks: list[str] = []
        self.moved_from: list[str] = []

    def pick(self, request, avoid=None):
        choice = super().pick(request, avoid)
        self.picks.append(choice.address)
        if avoid is not None:
            self.moved_from.append(avoid)
        return choice


class Disruptions:
    """Takes engines down one after another while chats stream, on a thread of its own.

    `disrupt(engine)` brings one engine down and back up (its process serving again). Each round
    fires at a chat's text, on the engine with the most chats in flight among those not yet
    disrupted (so each round takes another engine), and ends once the router has polled the
    engine back as reachable."""

    def __init__(self, engines: list[EngineProcess], disrupt: Callable[[EngineProcess], None], count: int):
        self.engines = engines
        self._disrupt = disrupt
        self.count = count
        self.rounds: list[dict] = []  # per round: the engine, its chats in flight, picks before its return
        self.done = [asyncio.Event() for _ in range(count)]
        self._busy = False
        self._errors: list[BaseException] = []

    def on_text(self, phase: int, router: RecordingRouter, loop: asyncio.AbstractEventLoop) -> None:
        if self._busy or phase != len(self.rounds) or phase >= self.count:
            return
        status = router.status()
        done = {r["address"] for r in self.rounds}
        busy = [e for e in self.engines if e.address not in done and status[e.address]["in_flight"]]
        if not busy:
            return  # the next text tries again
        victim = max(busy, key=lambda e: status[e.address]["in_flight"])
        self.rounds.append({"address": victim.address, "in_flight": status[victim.address]["in_flight"]})
        self._busy = True
        threading.Thread(target=self._run, args=(victim, router, loop, self.done[phase]), daemon=True).start()

    def phase_over(self, phase: int) -> None:
        """A phase's chats all ended before its disruption could fire: let the next phase start
        (check() then fails on the missing round) rather than wait forever."""
        if phase < self.count and len(self.rounds) <= phase:
            self.done[phase].set()

    def _run(self, victim: EngineProcess, router: RecordingRouter, loop, done: asyncio.Event) -> None:
        try:
            self._disrupt(victim)
            wait_for(lambda: router.status()[victim.address]["reachable"]
                     and not router.status()[victim.address]["draining"], f"the router to see {victim.address} back")
            self.rounds[-1]["picks_before_return"] = len(router.picks)
        except BaseException as exc:  # noqa: BLE001 - reported by check(), never lost in a thread
            self._errors.append(exc)
        finally:
            self._busy = False
            loop.call_soon_threadsafe(done.set)

    def check(self) -> None:
        if self._errors:
            raise self._errors[0]


def wait_for(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


async def run_chats(render: str, derender: str, addresses: list[str], disruptions: Disruptions | None = None):
    """The 128 chats, 32 at a time; with `disruptions`, phase p + 1 starts once disruption p is over."""
    phases = disruptions.count + 1 if disruptions is not None else 1
    phase_of = [k * phases // CHATS for k in range(CHATS)]
    loop = asyncio.get_running_loop()
    slots = asyncio.Semaphore(CONCURRENCY)
    unfinished = [phase_of.count(phase) for phase in range(phases)]
    # Round robin: each phase's chats spread over every engine the router sees, whenever they
    # arrive (least load counts a chat only once its stream starts, so a burst can go to one).
    with RecordingRouter(addresses, policy="round_robin", load_interval=0.05) as router:
        async with AsyncChatPipeline(Endpoints(render, addresses[0], derender), timeout=TIMEOUT,
                                     router=router) as pipeline:

            async def one(k: int):
                phase = phase_of[k]
                if disruptions is not None and phase:
                    await disruptions.done[phase - 1].wait()
                try:
                    async with slots:
                        chunks = []
                        async for chunk in pipeline.stream_chat(chat(k)):
                            if chunk.content and disruptions is not None:
                                disruptions.on_text(phase, router, loop)
                            chunks.append(chunk)
                        return chunks
                finally:
                    unfinished[phase] -= 1
                    if disruptions is not None and not unfinished[phase]:
                        disruptions.phase_over(phase)

            results = await asyncio.gather(*(one(k) for k in range(CHATS)), return_exceptions=True)
            return results, router


@pytest.fixture(scope="module")
def fleet(tiny_text_model, tmp_path_factory):
    log_dir = tmp_path_factory.mktemp("engines")
    engines = [EngineProcess(tiny_text_model, free_address(), log_dir).start() for _ in range(3)]
    try:
        for engine in engines:
            engine.wait_serving()
        yield engines
    finally:
        for engine in engines:
            engine.kill()


@pytest.fixture(scope="module")
def sidecars(tiny_text_model, module_aio_server) -> tuple[str, str]:
    model = str(tiny_text_model)
    render = module_aio_server(lambda: create_render(RenderConfig(address="127.0.0.1:0", model=model))).address
    derender = module_aio_server(lambda: create_derender(DerenderConfig(address="127.0.0.1:0", model=model))).address
    return render, derender


@pytest.fixture(scope="module")
def undisturbed(fleet, sidecars) -> list[tuple[str, int, int]]:
    """Every chat's text and usage with no engine disturbed (greedy: what each must give)."""
    results, router = asyncio.run(run_chats(*sidecars, [engine.address for engine in fleet]))
    assert not router.moved_from
    assert not [r for r in results if isinstance(r, BaseException)]
    return [outcome(chunks) for chunks in results]


def idle_loads(engines: list[EngineProcess]) -> list[tuple[int, int, int]]:
    """Each engine's (running, waiting, KV blocks used), once it is idle or after TIMEOUT."""
    loads = []
    for engine in engines:
        with grpc.insecure_channel(engine.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            deadline = time.monotonic() + TIMEOUT
            while True:  # a finished stream frees its slot at the engine's next step: wait for it
                load = stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
                used = (load.running_requests, load.waiting_requests, load.kv_blocks_used)
                if used == (0, 0, 0) or time.monotonic() > deadline:
                    break
                time.sleep(0.05)
        loads.append(used)
    return loads


def check_run(results, router: RecordingRouter, disruptions: Disruptions, undisturbed,
              engines: list[EngineProcess]) -> None:
    disruptions.check()
    failed = [result for result in results if isinstance(result, BaseException)]
    assert not failed, failed[:3]
    assert [outcome(chunks) for chunks in results] == undisturbed
    assert len(disruptions.rounds) == disruptions.count
    assert len({r["address"] for r in disruptions.rounds}) == disruptions.count  # another engine each time
    for round_ in disruptions.rounds:
        assert round_["in_flight"] > 0  # the engine went down with chats of its own streaming
        assert round_["address"] in router.picks[round_["picks_before_return"]:]  # and was routed to once back
    assert idle_loads(engines) == [(0, 0, 0)] * len(engines)  # no slot or KV block left behind


def test_engines_sigkilled_and_restarted_one_after_another_lose_no_chat(fleet, sidecars, undisturbed):
    def kill_and_restart(engine: EngineProcess) -> None:
        engine.kill()
        engine.start().wait_serving()

    disruptions = Disruptions(fleet, kill_and_restart, KILLS)
    results, router = asyncio.run(run_chats(*sidecars, [engine.address for engine in fleet], disruptions))
    check_run(results, router, disruptions, undisturbed, fleet)
    assert set(router.moved_from) == {r["address"] for r in disruptions.rounds}  # every kill moved chats elsewhere


def test_a_rolling_restart_under_load_loses_no_chat(fleet, sidecars, undisturbed):
    def drain_and_restart(engine: EngineProcess) -> None:
        assert engine.terminate() == 0  # SIGTERM: the engine drains, then exits cleanly
        engine.start().wait_serving()

    disruptions = Disruptions(fleet, drain_and_restart, len(fleet))  # every engine, one by one
    results, router = asyncio.run(run_chats(*sidecars, [engine.address for engine in fleet], disruptions))
    check_run(results, router, disruptions, undisturbed, fleet)
