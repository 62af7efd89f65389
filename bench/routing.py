"""Cache-aware routing over three native engines, against round robin, least load and one engine.

    .venv/bin/python bench/routing.py [--conversations 9] [--turns 4] [--rounds 2] [--new-tokens 12]
    .venv/bin/python bench/routing.py --smoke   # 3 conversations of 2 turns, one round: checks that it runs

Starts three `tito serve engine` processes (the tiny Qwen2-VL model, one CPU thread each, prefix
caching on) on local ports and renders a multi-turn chat workload once, in this process: every
conversation shares one long system prompt, each turn repeats the whole conversation so far plus a
new user message (the previous answers are fixed texts, so every policy sees the same requests),
and a few conversations start with an image. The conversations run concurrently, each turn after
the previous one's answer (and a short think time: the router's index follows the engines' KV
events, which arrive just after the answer).

Each round runs the same workload four ways, every engine's prefix cache reset
(`ResetPrefixCache`) before each: `one engine` (everything on one engine: the hit-rate baseline),
then `cache_aware`, `least_load` and `round_robin` over the three (tito_client.routing.EngineRouter
fed by SubscribeKvEvents). Per way: prefix-cache hit rate (cached / prompt tokens, from each
response's usage), prefill tokens computed (prompt - cached), TTFT p50/p90 and output tokens/s.
Ends with the paired ratio `cache_aware hit rate N.NNx of one engine` (target >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import io
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time

import grpc
import numpy as np
from PIL import Image

from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, render_pb2
from tito_client.routing import EngineRouter
from tito_models.tiny import VL_MODEL
from tito_render.config import RenderConfig
from tito_render.model import load_render_model
from tito_render.renderer import Renderer
from tito_render.convert import chat_response

START_TIMEOUT_S = 600
SYSTEM = ("You are the assistant of a small travel agency. Answer in two short sentences, friendly and "
          "precise, and always name the city the customer asked about. Prices are in euros. ") * 4
ANSWER = "Certainly, here is what I found for you, with the prices and the dates you asked for."
CITIES = ["Paris", "Lisbon", "Vienna", "Prague", "Oslo", "Rome", "Madrid", "Berlin", "Athens", "Dublin", "Riga",
          "Porto"]


def png(seed: int) -> bytes:
    pixels = np.random.RandomState(seed).randint(0, 256, size=(56, 56, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def workload(renderer: Renderer, conversations: int, turns: int, new_tokens: int, images_every: int):
    """Per conversation, its turns' GenerateRequests (rendered once)."""
    chats = []
    for c in range(conversations):
        city = CITIES[c % len(CITIES)]
        first = [chat_pb2.ContentPart(text=f"I want to visit {city} next month with my family of four.")]
        if images_every and c % images_every == 0:
            first.append(chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=png(c))))
        messages = [chat_pb2.ChatMessage(role="system", content=SYSTEM),
                    chat_pb2.ChatMessage(role="user", content_parts=first)]
        requests = []
        for t in range(turns):
            if t:
                messages.append(chat_pb2.ChatMessage(role="assistant", content=ANSWER))
                messages.append(chat_pb2.ChatMessage(role="user", content=f"Question {t} about {city}: what about "
                                                                          f"hotels near the centre, night {t}?"))
            rendered = chat_response(renderer, render_pb2.RenderChatRequest(
                messages=messages, sampling=render_pb2.SamplingOptions(max_tokens=new_tokens, temperature=0.0,
                                                                       ignore_eos=True)))
            requests.append(rendered.generate_request)
        chats.append(requests)
    return chats


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def start_engines(count: int, tmp: str, engine_process: bool = True,
                  model: str = VL_MODEL) -> tuple[list[str], list[subprocess.Popen]]:
    """`engine_process`: each engine core in its own process (--smoke: in its server's)."""
    addresses, processes = [], []
    for index in range(count):
        address = f"127.0.0.1:{free_port()}"
        log = open(os.path.join(tmp, f"engine-{index}.log"), "w+b")  # noqa: SIM115 (closed with the process)
        command = [sys.executable, "-m", "tito_cli", "serve", "engine", "--model", model, "--address", address,
                   "--log-level", "warning", "--cpu-threads", "1", "--core-cpus", "none",
                   *(() if engine_process else ("--no-engine-process",))]
        processes.append(subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True))
        processes[-1].log = log
        addresses.append(address)
    deadline = time.monotonic() + START_TIMEOUT_S
    for address, process in zip(addresses, processes):
        with grpc.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            while True:
                if process.poll() is not None:
                    process.log.seek(0)
                    raise RuntimeError(f"engine {address} exited: {process.log.read().decode()[-3000:]}")
                try:
                    stub.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=2)
                    break
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"engine {address} did not start in time") from None
                    time.sleep(0.2)
    return addresses, processes


def stop_engines(processes: list[subprocess.Popen]) -> None:
    for process in processes:
        if process.poll() is None:
            process.terminate()
    for process in processes:
        try:
            process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        process.wait()
        process.log.close()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def run_way(addresses: list[str], all_addresses: list[str], policy: str, chats, think: float) -> dict:
    """One way of serving the workload: reset every cache, route every turn, measure."""
    for address in all_addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            await engine_pb2_grpc.EngineServiceStub(channel).ResetPrefixCache(engine_pb2.ResetPrefixCacheRequest(),
                                                                               timeout=60)
    channels = {address: grpc.aio.insecure_channel(address) for address in addresses}
    stubs = {address: engine_pb2_grpc.EngineServiceStub(channel) for address, channel in channels.items()}
    totals = {"prompt": 0, "cached": 0, "generated": 0}
    ttfts: list[float] = []
    with EngineRouter(addresses, policy=policy, load_interval=0.05) as router:
        await asyncio.sleep(0.3)  # the router's first GetLoad and subscriptions

        async def conversation(requests):
            for request in requests:
                address = router.pick(request).address
                started = time.perf_counter()
                first = None
                with router.track(address):
                    async for response in stubs[address].Generate(request, timeout=600):
                        if first is None and response.token_ids:
                            first = time.perf_counter() - started
                        totals["generated"] += len(response.token_ids)
                        if response.HasField("usage"):
                            totals["prompt"] += response.usage.prompt_tokens
                            totals["cached"] += response.usage.cached_tokens
                ttfts.append(first)
                await asyncio.sleep(think)

        began = time.perf_counter()
        await asyncio.gather(*(conversation(requests) for requests in chats))
        wall = time.perf_counter() - began
    for channel in channels.values():
        await channel.close()
    return {"hit_rate": totals["cached"] / totals["prompt"], "prefill": totals["prompt"] - totals["cached"],
            "ttft_p50": percentile(ttfts, 0.5) * 1000, "ttft_p90": percentile(ttfts, 0.9) * 1000,
            "tok_s": totals["generated"] / wall}


WAYS = ("one engine", "cache_aware", "least_load", "round_robin")


def print_row(label: str, result: dict) -> None:
    print(f"  {label:<12} hit rate {result['hit_rate']:6.3f}  prefill tokens {result['prefill']:7d}  "
          f"TTFT p50 {result['ttft_p50']:7.1f} ms  p90 {result['ttft_p90']:7.1f} ms  {result['tok_s']:7.1f} tok/s",
          flush=True)


async def bench(args) -> None:
    renderer = Renderer(load_render_model(RenderConfig(model=VL_MODEL)))
    chats = workload(renderer, args.conversations, args.turns, args.new_tokens, args.images_every)
    requests = [request for turns in chats for request in turns]
    print(f"workload: {args.conversations} conversations x {args.turns} turns = {len(requests)} requests, "
          f"{sum(len(r.token_ids) for r in requests)} prompt tokens, "
          f"{sum(len(r.mm_features.items) for r in requests)} image items, {args.new_tokens} new tokens each",
          flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        addresses, processes = start_engines(3, tmp, engine_process=not args.smoke)
        try:
            rounds = []
            for round_index in range(args.rounds):
                print(f"round {round_index + 1}", flush=True)
                results = {}
                for way in WAYS:
                    targets = addresses[:1] if way == "one engine" else addresses
                    policy = "least_load" if way == "one engine" else way
                    results[way] = await run_way(targets, addresses, policy, chats, args.think_ms / 1000)
                    print_row(way, results[way])
                rounds.append(results)
        finally:
            stop_engines(processes)
    print("mean over rounds")
    for way in WAYS:
        print_row(way, {key: statistics.mean(r[way][key] for r in rounds) if key != "prefill"
                        else round(statistics.mean(r[way][key] for r in rounds)) for key in rounds[0][way]})
    for way in ("least_load", "round_robin"):
        ratio = statistics.mean(r[way]["hit_rate"] / r["one engine"]["hit_rate"] for r in rounds)
        print(f"{way} hit rate {ratio:.2f}x of one engine")
    ratio = statistics.mean(r["cache_aware"]["hit_rate"] / r["one engine"]["hit_rate"] for r in rounds)
    print(f"cache_aware hit rate {ratio:.2f}x of one engine")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=9)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--images-every", type=int, default=3, help="every Nth conversation starts with an image")
    parser.add_argument("--think-ms", type=float, default=50.0, help="pause between a turn's answer and the next")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.conversations, args.turns, args.rounds, args.new_tokens, args.think_ms = 3, 2, 1, 2, 10.0
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
