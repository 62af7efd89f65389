"""SMG's cache-aware routing over two native tito engines, fed by their KV events, next to tito's own
EngineRouter on the same multi-turn chats.

    .venv/bin/python bench/smg.py [--conversations 8] [--turns 4] [--rounds 2] [--new-tokens 12]
    .venv/bin/python bench/smg.py --smoke   # 3 conversations of 2 turns, one round: checks that it runs
    .venv/bin/python bench/smg.py --throughput [--vllm] [--concurrency 1 32] [--rounds 2]
    .venv/bin/python bench/smg.py --throughput --vllm --shape qwen2.5-0.5b [--rounds 1]

Starts two `tito serve engine` processes (tiny-qwen2, one CPU thread each, prefix caching on) and
two SMG gateways over both (`smg launch --backend vllm --policy cache_aware`, and `--policy
round_robin` as the cache-blind reference). SMG subscribes to each engine's
`vllm.grpc.engine.VllmEngine.SubscribeKvEvents` and routes by the blocks the engines report.

The workload is bench/routing.py's, text only: every conversation shares one long system prompt,
each turn repeats the conversation so far (the earlier answers are fixed texts, so every way sees
the same requests) plus a new user message; conversations run concurrently, each turn after the
previous one's answer and a short think time (a router's index follows the KV events, which
arrive just after the answer). tito's ways send the chats rendered by tito's renderer over
tito.v1; SMG's send the same messages as OpenAI chats, which SMG renders with the model's chat
template itself (the prompt token counts printed per way show both render alike).

Each round runs the workload five ways, every engine's prefix cache reset before each:
`one engine` (tito, one engine: the hit-rate baseline), `tito cache_aware` and `tito round_robin`
(EngineRouter over both), `smg cache_aware` and `smg round_robin`. Per way, measured as
bench/routing.py measures it: prefix-cache hit rate (cached / prompt tokens, from each answer's
usage), prefill tokens computed, TTFT p50/p90, output tokens/s, plus `sticky`: the share of later
turns sent to the engine that served the conversation's previous turn (SMG names it in its
`x-smg-routed-worker-id` header). Ends with the paired ratios

    smg cache_aware hit rate N.NNx of one engine        (target >= 0.9)
    smg cache_aware hit rate N.NNx of tito cache_aware

--throughput (bench/smg_throughput.py): output throughput and TTFT of SMG in front of one tito
engine against tito's own gateway -> render -> engine -> derender over the same engine process
(`tito serve all`, its engine on TCP; settings as bench/gateway.py's: tiny-qwen2-h256, float32,
prefix caching off, 64 MiB of KV cache), and with --vllm SMG in front of `vllm serve --grpc` (vLLM
with smg-grpc-servicer, the field's own stack) on the same checkpoint and settings: `vllm bench
serve --backend openai-chat`, random 128 in / 64 out, greedy, ignore_eos, at each concurrency, in
paired rounds (the order rotates), then `c=N smg -> tito engine / ...` ratios (median [min-max]).
--shape qwen2.5-0.5b: the same on Qwen2.5-0.5B's shape with random weights (float32, 512 MiB of KV
cache and a 4,096-token context on every side); under --smoke the tiny model stands in.
--throughput --smoke: SMG and tito only, a few short chats streamed by httpx, one round.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import httpx

from processes import log_tail, spawn, stop_process
from routing import ANSWER, CITIES, SYSTEM, free_port, percentile, start_engines, stop_engines
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, render_pb2
from tito_client.routing import EngineRouter
from tito_models.paths import resolve_model
from tito_models.tiny import TEXT_MODEL
from tito_render.config import RenderConfig
from tito_render.convert import chat_response
from tito_render.model import load_render_model
from tito_render.renderer import Renderer

START_TIMEOUT_S = 600
SMG_WAYS = ("cache_aware", "round_robin")
WAYS = ("one engine", "tito cache_aware", "tito round_robin", *(f"smg {policy}" for policy in SMG_WAYS))


def conversations(count: int, turns: int) -> list[list[list[tuple[str, str]]]]:
    """Per conversation, per turn, the whole chat so far as (role, text) pairs."""
    chats = []
    for c in range(count):
        city = CITIES[c % len(CITIES)]
        messages = [("system", SYSTEM), ("user", f"I want to visit {city} next month with my family of four.")]
        per_turn = []
        for t in range(turns):
            if t:
                messages += [("assistant", ANSWER),
                             ("user", f"Question {t} about {city}: what about hotels near the centre, night {t}?")]
            per_turn.append(list(messages))
        chats.append(per_turn)
    return chats


def rendered(renderer: Renderer, chats, new_tokens: int) -> list[list[engine_pb2.GenerateRequest]]:
    """tito's render of every turn (once), greedy with ignore_eos."""
    sampling = render_pb2.SamplingOptions(max_tokens=new_tokens, temperature=0.0, ignore_eos=True)
    return [[chat_response(renderer, render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role=role, content=text) for role, text in turn],
        sampling=sampling)).generate_request for turn in turns] for turns in chats]


@dataclass
class Tally:
    prompt: int = 0
    cached: int = 0
    generated: int = 0
    ttfts: list[float] = field(default_factory=list)
    later_turns: int = 0
    stayed: int = 0

    def turn(self, previous: str | None, engine: str) -> None:
        if previous is not None:
            self.later_turns += 1
            self.stayed += previous == engine

    def result(self, wall: float) -> dict:
        return {"hit_rate": self.cached / self.prompt, "prompt": self.prompt, "prefill": self.prompt - self.cached,
                "ttft_p50": percentile(self.ttfts, 0.5) * 1000, "ttft_p90": percentile(self.ttfts, 0.9) * 1000,
                "tok_s": self.generated / wall, "sticky": self.stayed / self.later_turns if self.later_turns else 1.0}


async def reset_caches(addresses: list[str]) -> None:
    for address in addresses:
        async with grpc.aio.insecure_channel(address) as channel:
            await engine_pb2_grpc.EngineServiceStub(channel).ResetPrefixCache(engine_pb2.ResetPrefixCacheRequest(),
                                                                               timeout=60)


async def run_tito(targets: list[str], policy: str, requests, think: float) -> dict:
    """The workload through tito's EngineRouter over `targets` (tito.v1 Generate)."""
    channels = {address: grpc.aio.insecure_channel(address) for address in targets}
    stubs = {address: engine_pb2_grpc.EngineServiceStub(channel) for address, channel in channels.items()}
    tally = Tally()
    with EngineRouter(targets, policy=policy, load_interval=0.05) as router:
        await asyncio.sleep(0.3)  # the router's first GetLoad and subscriptions

        async def conversation(turns):
            previous = None
            for request in turns:
                address = router.pick(request).address
                tally.turn(previous, address)
                previous = address
                started, first = time.perf_counter(), None
                with router.track(address):
                    async for response in stubs[address].Generate(request, timeout=600):
                        if first is None and response.token_ids:
                            first = time.perf_counter() - started
                        tally.generated += len(response.token_ids)
                        if response.HasField("usage"):
                            tally.prompt += response.usage.prompt_tokens
                            tally.cached += response.usage.cached_tokens
                tally.ttfts.append(first)
                await asyncio.sleep(think)

        began = time.perf_counter()
        await asyncio.gather(*(conversation(turns) for turns in requests))
        wall = time.perf_counter() - began
    for channel in channels.values():
        await channel.close()
    return tally.result(wall)


async def run_smg(base: str, model: str, chats, new_tokens: int, think: float) -> dict:
    """The workload as OpenAI chats streamed through SMG at `base`."""
    tally = Tally()
    async with httpx.AsyncClient(base_url=base, timeout=600) as client:
        async def conversation(turns):
            previous = None
            for turn in turns:
                body = {"model": model, "messages": [{"role": role, "content": text} for role, text in turn],
                        "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "stream": True,
                        "stream_options": {"include_usage": True}}
                started, first = time.perf_counter(), None
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    response.raise_for_status()
                    engine = response.headers.get("x-smg-routed-worker-id", "")
                    async for line in response.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        chunk = json.loads(line[6:])
                        if first is None and any(choice["delta"].get("content") for choice in chunk["choices"]):
                            first = time.perf_counter() - started
                        if chunk.get("usage"):
                            usage = chunk["usage"]
                            tally.prompt += usage["prompt_tokens"]
                            tally.cached += (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
                            tally.generated += usage["completion_tokens"]
                tally.turn(previous, engine)
                previous = engine
                tally.ttfts.append(first if first is not None else time.perf_counter() - started)
                await asyncio.sleep(think)

        began = time.perf_counter()
        await asyncio.gather(*(conversation(turns) for turns in chats))
        wall = time.perf_counter() - began
    return tally.result(wall)


def start_smg(addresses: list[str], model: str, policy: str, tmp: Path):
    """`smg launch --backend vllm` over the engines with `policy`; its base URL once it lists the
    model (its workers registered, their KV event streams opened)."""
    port = free_port()
    smg = str(Path(sys.executable).parent / "smg")
    command = [smg, "launch", "--backend", "vllm", "--worker-urls", *(f"grpc://{a}" for a in addresses),
               "--host", "127.0.0.1", "--port", str(port), "--prometheus-port", str(free_port()),
               "--policy", policy, "--model-path", model, "--reasoning-parser", "passthrough", "--log-level", "warn"]
    process = spawn(command, tmp / f"smg-{policy}.log", cwd=tmp)
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + START_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise RuntimeError(f"smg exited with code {process.returncode}:\n{log_tail(process)}")
        try:
            listed = httpx.get(f"{base}/v1/models", timeout=2).json().get("data", [])
            if any(entry.get("id") == model for entry in listed):
                return base, process
        except (httpx.HTTPError, ValueError):
            pass
        if time.monotonic() > deadline:
            raise RuntimeError(f"smg did not list {model} in {START_TIMEOUT_S}s:\n{log_tail(process)}")
        time.sleep(0.2)


def print_row(label: str, result: dict) -> None:
    print(f"  {label:<17} hit rate {result['hit_rate']:6.3f}  sticky {result['sticky']:5.2f}  prompt tokens "
          f"{result['prompt']:6d}  prefill {result['prefill']:6d}  TTFT p50 {result['ttft_p50']:7.1f} ms  "
          f"p90 {result['ttft_p90']:7.1f} ms  {result['tok_s']:7.1f} tok/s", flush=True)


async def bench(args) -> None:
    model = str(resolve_model(TEXT_MODEL))
    chats = conversations(args.conversations, args.turns)
    requests = rendered(Renderer(load_render_model(RenderConfig(model=model))), chats, args.new_tokens)
    print(f"workload: {args.conversations} conversations x {args.turns} turns, "
          f"{sum(len(r.token_ids) for turns in requests for r in turns)} prompt tokens (tito's render), "
          f"{args.new_tokens} new tokens each", flush=True)
    think = args.think_ms / 1000
    with tempfile.TemporaryDirectory() as tmp:
        addresses, engines = start_engines(2, tmp, engine_process=not args.smoke, model=model)
        gateways = []
        try:
            for policy in SMG_WAYS:
                gateways.append(start_smg(addresses, model, policy, Path(tmp)))
            bases = dict(zip(SMG_WAYS, (base for base, _ in gateways)))
            rounds = []
            for round_index in range(args.rounds):
                print(f"round {round_index + 1}", flush=True)
                results = {}
                for way in WAYS:
                    await reset_caches(addresses)
                    if way == "one engine":
                        results[way] = await run_tito(addresses[:1], "least_load", requests, think)
                    elif way.startswith("tito "):
                        results[way] = await run_tito(addresses, way.removeprefix("tito "), requests, think)
                    else:
                        results[way] = await run_smg(bases[way.removeprefix("smg ")], model, chats,
                                                     args.new_tokens, think)
                    print_row(way, results[way])
                rounds.append(results)
        finally:
            for _, process in gateways:
                stop_process(process)
            stop_engines(engines)
    print("mean over rounds")
    for way in WAYS:
        print_row(way, {key: statistics.mean(r[way][key] for r in rounds) if key not in ("prefill", "prompt")
                        else round(statistics.mean(r[way][key] for r in rounds)) for key in rounds[0][way]})
    for way in WAYS[1:]:
        ratio = statistics.mean(r[way]["hit_rate"] / r["one engine"]["hit_rate"] for r in rounds)
        print(f"{way} hit rate {ratio:.2f}x of one engine")
    ratio = statistics.mean(r["smg cache_aware"]["hit_rate"] / r["tito cache_aware"]["hit_rate"] for r in rounds)
    print(f"smg cache_aware hit rate {ratio:.2f}x of tito cache_aware")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--conversations", type=int, default=8)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--think-ms", type=float, default=50.0, help="pause between a turn's answer and the next")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: checks that it runs")
    parser.add_argument("--throughput", action="store_true", help="SMG -> tito engine vs tito's gateway (see above)")
    parser.add_argument("--vllm", action="store_true", help="--throughput: also SMG -> vllm serve --grpc")
    parser.add_argument("--model", default="tiny-qwen2-h256", help="--throughput's model")
    parser.add_argument("--shape", default=None,
                        help="--throughput on a real model's shape in float32 (tito_models.real_shape, e.g. "
                             "qwen2.5-0.5b) instead of --model")
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--min-prompts", type=int, default=8, help="prompts per run: max(this, 2 x concurrency)")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.throughput:
        from smg_throughput import throughput

        if args.smoke:  # tito's side alone: no vLLM
            args.rounds, args.concurrency, args.output_len, args.min_prompts, args.vllm = 1, [2], 4, 4, False
        throughput(args)
        return
    if args.smoke:
        args.conversations, args.turns, args.rounds, args.new_tokens, args.think_ms = 3, 2, 1, 2, 10.0
    asyncio.run(bench(args))


if __name__ == "__main__":
    main()
