"""What prefill/decode disaggregation buys running chats: their decode TPOT p99 and longest gap
while long prompts arrive, with 1 prefill + 1 decode engine, against the same two engines
colocated (both mixed) behind the router.

    .venv/bin/python bench/pd.py [--chats 8] [--long-prompts 4] [--prompt-tokens 1024] [--rounds 2]
    .venv/bin/python bench/pd.py --smoke   # a few seconds, one round: checks that it runs

Starts two `tito serve engine` processes (the benchmarks' tiny Qwen2 text model, hidden 256, one
CPU thread each) and drives them through tito_client's AsyncChatPipeline.generate over an
EngineRouter (least load), which prefills prompts of at least 256 tokens on a prefill engine and
decodes them on a decode engine (tito_client.disaggregation). Each way: `--chats` short greedy
chats start decoding, then `--long-prompts` prompts of `--prompt-tokens` random token ids (new
ones every way, so no prefix cache helps) arrive one after another. Per way: the chats' time per
output token (TPOT) p50 / p99 and their longest gap between two messages while the long prompts
are in flight, and the total output tokens/s. Ways alternate their order per round; the paired
ratios close the run: `P/D TPOT p99 N.NNx of colocated` (goal <= 0.3) and `P/D throughput
N.NNx of colocated` (goal >= 0.9).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time

import grpc

from tito.v1 import engine_pb2, engine_pb2_grpc, sampling_pb2
from tito_client.pipeline import AsyncChatPipeline, Endpoints
from tito_client.routing import EngineRouter
from tito_models.tiny import BENCH_TEXT_MODEL

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from failover import Engine, free_address  # noqa: E402 - the engine processes bench/failover.py starts

PD_MIN_PROMPT_TOKENS = 256


class BenchEngine(Engine):
    """bench/failover.py's engine process, on the benchmarks' model with room for long prompts."""

    def start(self) -> None:
        command = [sys.executable, "-m", "tito_cli", "serve", "engine", "--model", BENCH_TEXT_MODEL, "--address",
                   self.address, "--log-level", "warning", "--cpu-threads", "1", "--core-cpus", "none",
                   "--kv-blocks", "1024", "--max-model-len", "2048"]
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(command, stdout=log, stderr=log, start_new_session=True)


def greedy(token_ids: list[int], max_tokens: int, request_id: str) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id=request_id, token_ids=token_ids, sampling_params=sampling_pb2.
                                      SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))


async def run_way(way: str, addresses: list[str], args, seed: int) -> dict:
    """One way: chats decoding while long prompts arrive; their gaps and the total throughput."""
    rng = random.Random(seed)
    roles = ({"prefill_engines": addresses[:1], "decode_engines": addresses[1:]} if way == "pd"
             else {"prefill_engines": [], "decode_engines": []})
    engines = [] if way == "pd" else addresses
    router = EngineRouter(engines, policy="least_load", load_interval=0.05,
                          pd_min_prompt_tokens=PD_MIN_PROMPT_TOKENS, **roles).start()
    tokens = 0
    gaps: list[float] = []  # seconds per token between the chats' messages while long prompts run
    longest = 0.0
    window = [float("inf"), 0.0]  # when the first long prompt was sent, when the last one finished
    try:
        await asyncio.sleep(0.3)  # the router's first GetLoad
        async with AsyncChatPipeline(Endpoints("127.0.0.1:1", addresses[-1], "127.0.0.1:1"), timeout=600,
                                     router=router) as pipeline:
            started = asyncio.Event()
            decoding = 0

            async def chat(k: int) -> None:
                nonlocal tokens, longest, decoding
                prompt = [rng.randrange(10, 900) for _ in range(24)]
                previous = None
                async for response in pipeline.generate(greedy(prompt, args.new_tokens, f"{way}-{seed}-chat-{k}")):
                    now = time.perf_counter()
                    tokens += len(response.token_ids)
                    if previous is None:
                        decoding += 1
                        if decoding == args.chats:
                            started.set()
                    elif response.token_ids and window[0] <= now and (window[1] == 0.0 or now <= window[1]):
                        gaps.append((now - previous) / len(response.token_ids))
                        longest = max(longest, now - previous)
                    previous = now

            async def long_prompt(k: int) -> None:
                nonlocal tokens
                prompt = [rng.randrange(10, 900) for _ in range(args.prompt_tokens)]
                async for response in pipeline.generate(greedy(prompt, 4, f"{way}-{seed}-long-{k}")):
                    tokens += len(response.token_ids)

            async def arrivals() -> None:
                await started.wait()
                window[0] = time.perf_counter()
                await asyncio.gather(*(long_prompt(k) for k in range(args.long_prompts)))
                window[1] = time.perf_counter()

            began = time.perf_counter()
            await asyncio.gather(arrivals(), *(chat(k) for k in range(args.chats)))
            wall = time.perf_counter() - began
    finally:
        router.close()
    gaps.sort()
    return {"tpot_p50": statistics.median(gaps) if gaps else 0.0,
            "tpot_p99": gaps[min(len(gaps) - 1, int(0.99 * len(gaps)))] if gaps else 0.0,
            "longest": longest, "tok_s": tokens / wall}


def print_row(way: str, result: dict) -> None:
    print(f"  {way:<10} TPOT p50 {result['tpot_p50'] * 1000:7.1f} ms  p99 {result['tpot_p99'] * 1000:7.1f} ms  "
          f"longest gap {result['longest'] * 1000:7.1f} ms  {result['tok_s']:7.1f} tok/s", flush=True)


async def bench(args) -> None:
    print(f"workload: {args.chats} chats decoding {args.new_tokens} tokens while {args.long_prompts} prompts of "
          f"{args.prompt_tokens} tokens arrive; pd = engine 1 prefills (prompts >= {PD_MIN_PROMPT_TOKENS} tokens), "
          f"engine 2 decodes; colocated = both engines mixed", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        engines = [BenchEngine(free_address(), tmp) for _ in range(2)]
        for engine in engines:
            engine.start()
        try:
            for engine in engines:
                engine.wait_ready()
            await warm_up([engine.address for engine in engines])
            rounds = []
            for round_index in range(args.rounds):
                print(f"round {round_index + 1}", flush=True)
                ways = ("colocated", "pd") if round_index % 2 == 0 else ("pd", "colocated")
                results = {}
                for way in ways:
                    results[way] = await run_way(way, [engine.address for engine in engines], args,
                                                 seed=round_index * 2 + (way == "pd"))
                    print_row(way, results[way])
                rounds.append(results)
        finally:
            for engine in engines:
                engine.kill()
    tpot = statistics.mean(r["pd"]["tpot_p99"] / r["colocated"]["tpot_p99"] for r in rounds
                           if r["colocated"]["tpot_p99"])
    throughput = statistics.mean(r["pd"]["tok_s"] / r["colocated"]["tok_s"] for r in rounds)
    print(f"P/D TPOT p99 {tpot:.2f}x of colocated")
    print(f"P/D throughput {throughput:.2f}x of colocated")


async def warm_up(addresses: list[str]) -> None:
    """One long prompt on each engine: its first one pays for lazy set-up that is no part of the way."""
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            async for _ in stub.Generate(greedy(list(range(10, 10 + PD_MIN_PROMPT_TOKENS)), 2, "warm-up"),
                                         timeout=600):
                pass


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--chats", type=int, default=8, help="chats decoding while the long prompts arrive")
    parser.add_argument("--long-prompts", type=int, default=4)
    parser.add_argument("--prompt-tokens", type=int, default=1024, help="tokens of each long prompt")
    parser.add_argument("--new-tokens", type=int, default=128, help="tokens each chat decodes")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true", help="the smallest run: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.chats, args.long_prompts, args.prompt_tokens, args.new_tokens, args.rounds = 2, 1, 300, 24, 1
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
