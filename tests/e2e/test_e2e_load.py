"""Load through the three services as processes: 256 concurrent seeded chats for a minute, 10%
cancelled at random points.

Every chat that completes streams exactly its solo run's text (nothing lost, duplicated or mixed
up with another stream), the engine returns to zero running, and the services' resident memory
after the run stays within 10% of what it was after warm-up. TITO_LOAD_SECONDS (default 60)
sets the duration.
"""

from __future__ import annotations

import asyncio
import os
import random
import time
from pathlib import Path

import grpc
import pytest

from tito_cli.main import SERVICES
from tito.v1 import (chat_pb2, derender_pb2, derender_pb2_grpc, engine_pb2, engine_pb2_grpc, render_pb2,
                     render_pb2_grpc)

from service_processes import running_services

pytestmark = pytest.mark.e2e

CONCURRENCY = 256
SECONDS = float(os.environ.get("TITO_LOAD_SECONDS", "60"))
CANCEL_FRACTION = 0.1
DISTINCT_CHATS = 48
TIMEOUT = 120
WORDS = "sea sky river stone cloud garden lantern harbour meadow violin winter amber".split()


@pytest.fixture(scope="module")
def services(tiny_text_model, tmp_path_factory):
    # Room for the whole load at once: 256 streams run together instead of queueing.
    extra = {"engine": ["--max-running-sequences", "256", "--kv-cache-bytes", str(128 << 20)]}
    with running_services(tiny_text_model, tmp_path_factory.mktemp("load-sockets"), "cpu", extra) as running:
        yield running


def _chat(index: int) -> render_pb2.RenderChatRequest:
    rng = random.Random(index)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(3, 30)))
    return render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content=f"Tell me about the {text}.")],
        sampling=render_pb2.SamplingOptions(max_tokens=rng.randint(8, 40), temperature=0.8, seed=index))


class Client:
    """render -> engine -> derender for one chat, over grpc.aio (as a router would)."""

    def __init__(self, addresses: dict[str, str]):
        self.channels = [grpc.aio.insecure_channel(addresses[name]) for name in SERVICES]
        self.render = render_pb2_grpc.RenderServiceStub(self.channels[0])
        self.engine = engine_pb2_grpc.EngineServiceStub(self.channels[1])
        self.derender = derender_pb2_grpc.DerenderServiceStub(self.channels[2])

    async def close(self) -> None:
        for channel in self.channels:
            await channel.close()

    async def chat(self, request: render_pb2.RenderChatRequest, cancel_after: int | None = None) -> str | None:
        """The streamed content, or None when cancelled after `cancel_after` chunks."""
        rendered = await self.render.RenderChat(request, timeout=TIMEOUT)
        generation = self.engine.Generate(rendered.generate_request, timeout=TIMEOUT)

        async def requests():
            yield derender_pb2.DerenderRequest(context=rendered.derender_context)
            async for response in generation:
                yield derender_pb2.DerenderRequest(generate_response=response)

        stream = self.derender.Derender(requests(), timeout=TIMEOUT)
        content, chunks = [], 0
        async for reply in stream:
            content.append(reply.chunk.content)
            chunks += 1
            if cancel_after is not None and chunks > cancel_after:
                stream.cancel()
                generation.cancel()
                return None
            if reply.chunk.cancel_generation:
                generation.cancel()
        return "".join(content)


def _rss_kib(pids: list[int]) -> int:
    """Resident memory of the services and their children (the engine core), in KiB."""
    total = 0
    for pid in pids:
        for candidate in [pid, *_children(pid)]:
            status = Path(f"/proc/{candidate}/status")
            if status.exists():
                for line in status.read_text().splitlines():
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1])
    return total


def _children(pid: int) -> list[int]:
    path = Path(f"/proc/{pid}/task/{pid}/children")
    return [int(child) for child in path.read_text().split()] if path.exists() else []


def test_256_concurrent_chats_for_a_minute_with_cancellations(services):
    addresses, processes = services
    pids = [process.pid for process in processes]

    async def run():
        client = Client(addresses)
        requests = [_chat(index) for index in range(DISTINCT_CHATS)]
        solo = [await client.chat(request) for request in requests]
        assert len(set(solo)) > DISTINCT_CHATS // 2, "chats must differ, or mix-ups would go unseen"
        await asyncio.gather(*(client.chat(requests[k % DISTINCT_CHATS]) for k in range(CONCURRENCY)))  # warm-up
        rss_warm = _rss_kib(pids)

        rng = random.Random(2026)
        completed = cancelled = mismatched = 0
        deadline = time.monotonic() + SECONDS

        async def worker(slot: int):
            nonlocal completed, cancelled, mismatched
            while time.monotonic() < deadline:
                index = rng.randrange(DISTINCT_CHATS)
                cancel_after = rng.randrange(6) if rng.random() < CANCEL_FRACTION else None
                content = await client.chat(requests[index], cancel_after)
                if content is None:
                    cancelled += 1
                elif content == solo[index]:
                    completed += 1
                else:
                    mismatched += 1

        started = time.monotonic()
        await asyncio.gather(*(worker(slot) for slot in range(CONCURRENCY)))
        elapsed = time.monotonic() - started
        load = await client.engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
        for _ in range(100):  # the last cancellations reach the engine within a step or two
            if load.running_requests == 0 and load.waiting_requests == 0:
                break
            await asyncio.sleep(0.05)
            load = await client.engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
        await client.close()
        return completed, cancelled, mismatched, elapsed, load, rss_warm, _rss_kib(pids)

    completed, cancelled, mismatched, elapsed, load, rss_warm, rss_after = asyncio.run(run())
    print(f"\nload: {completed} chats completed, {cancelled} cancelled, {mismatched} mismatched in {elapsed:.0f} s "
          f"at concurrency {CONCURRENCY}; RSS after warm-up {rss_warm // 1024} MiB, after the run "
          f"{rss_after // 1024} MiB")
    assert mismatched == 0
    assert completed > CONCURRENCY and cancelled > 0
    assert (load.running_requests, load.waiting_requests, load.kv_blocks_used) == (0, 0, 0)
    assert rss_after <= rss_warm * 1.10
