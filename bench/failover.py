"""What engine failures cost a fleet that loses no request: throughput over three native engines
with one SIGKILLed every few seconds (and restarted), against the same fleet undisturbed.

    .venv/bin/python bench/failover.py [--seconds 30] [--kill-every 10] [--concurrency 16] [--rounds 2]
    .venv/bin/python bench/failover.py --smoke   # a few seconds, one kill, one round: checks that it runs

Starts three `tito serve engine` processes (the tiny Qwen2 text model, one CPU thread each, model
and server in one process so that SIGKILL takes the whole engine) and renders a set of distinct
greedy chats once, in this process. A closed loop keeps `--concurrency` chats in flight for
`--seconds` through tito_client's EngineRouter (least load), each chat's engine stream an
AsyncMigratingStream: a chat whose engine dies continues on another (request migration).

Each round runs two ways, in alternating order: `undisturbed`, and `chaos`: every `--kill-every`
seconds one engine (in turn) is SIGKILLed and restarted on its address at once (it serves again
after its start-up, several seconds here: the fleet runs with two engines meanwhile). Per way:
output tokens/s, chats completed, chats failed (must be 0) and chats whose tokens differ from the
same chat undisturbed (must be 0: greedy). Ends with the paired ratio `chaos throughput N.NNx of
undisturbed` (goal: >= 0.6 with a kill every 10 s).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import itertools
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, render_pb2
from tito_client.engine_stream import AsyncMigratingStream
from tito_client.routing import EngineRouter
from tito_models.tiny import TEXT_MODEL
from tito_render.config import RenderConfig
from tito_render.convert import chat_response
from tito_render.model import load_render_model
from tito_render.renderer import Renderer

START_TIMEOUT_S = 300
DISTINCT_CHATS = 24
WORDS = "sea sky river stone cloud garden lantern harbour meadow violin winter amber".split()


def free_address() -> str:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{probe.getsockname()[1]}"


class Engine:
    """One engine process at a fixed address, to kill and start again."""

    def __init__(self, address: str, log_dir: str):
        self.address = address
        self.log_path = os.path.join(log_dir, f"engine-{address.rsplit(':', 1)[1]}.log")
        self.process: subprocess.Popen | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "tito_cli", "serve", "engine", "--model", TEXT_MODEL, "--address",
                   self.address, "--log-level", "warning", "--cpu-threads", "1", "--core-cpus", "none",
                   "--no-engine-process"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            os.killpg(self.process.pid, signal.SIGKILL)
            self.process.wait()

    def wait_ready(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT_S
        with grpc.insecure_channel(self.address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            while True:
                if self.process.poll() is not None:
                    with open(self.log_path, errors="replace") as log:
                        raise RuntimeError(f"engine {self.address} exited: {log.read()[-3000:]}")
                try:
                    stub.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=2)
                    return
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"engine {self.address} did not start in time") from None
                    time.sleep(0.2)


def chats(new_tokens: int) -> list[engine_pb2.GenerateRequest]:
    renderer = Renderer(load_render_model(RenderConfig(model=TEXT_MODEL)))
    requests = []
    for k in range(DISTINCT_CHATS):
        words = " ".join(WORDS[(k + i) % len(WORDS)] for i in range(3 + k % 6))
        rendered = chat_response(renderer, render_pb2.RenderChatRequest(
            messages=[chat_pb2.ChatMessage(role="user", content=f"Tell a story about {words}, number {k}.")],
            sampling=render_pb2.SamplingOptions(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)))
        requests.append(rendered.generate_request)
    return requests


async def run_way(engines: list[Engine], requests, args, kill_every: float | None,
                  reference: dict[int, list[int]]) -> dict:
    """Keep `args.concurrency` chats in flight for `args.seconds`; kill an engine every `kill_every` s."""
    addresses = [engine.address for engine in engines]
    channels = {address: grpc.aio.insecure_channel(address) for address in addresses}
    stubs = {address: engine_pb2_grpc.EngineServiceStub(channel) for address, channel in channels.items()}
    totals = {"tokens": 0, "completed": 0, "failed": 0, "differing": 0, "kills": 0}
    errors: collections.Counter = collections.Counter()
    order = itertools.count()
    with EngineRouter(addresses, policy="least_load", load_interval=0.05) as router:
        await asyncio.sleep(0.3)  # the router's first GetLoad
        began = time.perf_counter()
        stop_at = began + args.seconds

        async def one(k: int) -> None:
            request = engine_pb2.GenerateRequest()
            request.CopyFrom(requests[k % len(requests)])
            request.request_id = f"chat-{k}"  # ids are unique among an engine's live requests
            stream = AsyncMigratingStream(router, lambda where, generate: stubs[where].Generate(generate, timeout=600),
                                          request, router.pick(request).address)
            ids: list[int] = []
            try:
                async for response in stream:
                    ids.extend(response.token_ids)
                    totals["tokens"] += len(response.token_ids)
            except grpc.RpcError as error:
                totals["failed"] += 1
                errors[f"{error.code().name}: {error.details()}"[:160]] += 1
                return
            totals["completed"] += 1
            known = reference.setdefault(k % len(requests), ids)
            totals["differing"] += known != ids

        async def worker() -> None:
            while time.perf_counter() < stop_at:
                await one(next(order))

        async def chaos() -> None:
            victims = itertools.cycle(engines)
            while True:
                await asyncio.sleep(kill_every)
                if time.perf_counter() >= stop_at:
                    return
                victim = next(victims)
                victim.kill()
                victim.start()  # it serves again after its start-up; the router sees it return
                totals["kills"] += 1

        killer = asyncio.ensure_future(chaos()) if kill_every else None
        await asyncio.gather(*(worker() for _ in range(args.concurrency)))
        wall = time.perf_counter() - began
        if killer is not None:
            killer.cancel()
    for channel in channels.values():
        await channel.close()
    for engine in engines:  # the next way starts with the whole fleet serving
        engine.wait_ready()
    for error, count in errors.most_common(3):  # what a failed chat was told (there should be none)
        print(f"    {count} failed with {error}", flush=True)
    return {**totals, "tok_s": totals["tokens"] / wall}


def print_row(label: str, result: dict) -> None:
    print(f"  {label:<11} {result['tok_s']:8.1f} tok/s  completed {result['completed']:5d}  failed "
          f"{result['failed']}  differing {result['differing']}  kills {result['kills']}", flush=True)


async def bench(args) -> None:
    requests = chats(args.new_tokens)
    print(f"workload: {args.concurrency} chats in flight for {args.seconds:.0f} s, {len(requests)} distinct greedy "
          f"chats of {args.new_tokens} new tokens; chaos: an engine SIGKILLed every {args.kill_every:g} s and "
          f"restarted", flush=True)
    reference: dict[int, list[int]] = {}  # each chat's tokens, from its first completed run
    with tempfile.TemporaryDirectory() as tmp:
        engines = [Engine(free_address(), tmp) for _ in range(3)]
        for engine in engines:
            engine.start()
        try:
            for engine in engines:
                engine.wait_ready()
            rounds = []
            for round_index in range(args.rounds):
                print(f"round {round_index + 1}", flush=True)
                ways = ("undisturbed", "chaos") if round_index % 2 == 0 else ("chaos", "undisturbed")
                results = {}
                for way in ways:
                    results[way] = await run_way(engines, requests, args,
                                                 args.kill_every if way == "chaos" else None, reference)
                    print_row(way, results[way])
                rounds.append(results)
        finally:
            for engine in engines:
                engine.kill()
    failed = sum(r[way]["failed"] for r in rounds for way in r)
    differing = sum(r[way]["differing"] for r in rounds for way in r)
    ratio = statistics.mean(r["chaos"]["tok_s"] / r["undisturbed"]["tok_s"] for r in rounds)
    print(f"chats failed {failed}, chats differing from their undisturbed tokens {differing}")
    print(f"chaos throughput {ratio:.2f}x of undisturbed")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=30.0, help="length of each way's run")
    parser.add_argument("--kill-every", type=float, default=10.0, help="seconds between kills in the chaos way")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--smoke", action="store_true", help="the smallest run: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.seconds, args.kill_every, args.concurrency, args.rounds, args.new_tokens = 3.0, 1.5, 4, 1, 16
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
