"""The OpenAI gateway measured by vLLM's own benchmark client, against `vllm serve`, in one run.

    .venv/bin/python bench/gateway.py [--rounds 2] [--concurrency 1 32] [--input-len 128] [--output-len 64]
    .venv/bin/python bench/gateway.py --smoke   # tito alone, a few short chats: checks that it runs

Starts, on one model (default tiny-qwen2-h256), float32, prefix caching off on both sides, 64 MiB
of KV cache, at most 64 running sequences, each side at its own prompt tokens per step (tito's CPU
default 512, vllm serve's CPU default 2048; --vllm-batched-tokens N runs vLLM at N):
  - tito:        `tito serve all --gateway-address 127.0.0.1:PORT` as a user starts it (the three
                 services on Unix sockets, their default CPU placement, the gateway over them);
  - vllm serve:  `vllm serve DIR` on a local port (--enforce-eager, generation config "vllm");
then, in paired rounds (the order of the two rotates from round to round), at each concurrency:
`vllm bench serve --backend openai-chat --dataset-name random --seed S --ignore-eos
--temperature 0` against each server, the same prompts (vLLM's random dataset with a fixed seed)
and the same output length; and right after, the same chats (the same dataset, drawn with vLLM's
own code and tokenizer) through `AsyncChatPipeline` directly to tito's three services, in this
process, at the same concurrency: what the gateway adds to the path.

Prints per setup and concurrency (best round by output throughput) request and output-token
throughput, TTFT and TPOT p50/p99, then one line per concurrency:

    c=32 tito / vllm serve 1.07x [min-max]          output-token throughput, median over rounds
    c=32 TTFT p50 tito / vllm serve 0.80x [min-max]  lower is better
    c=32 gateway / AsyncChatPipeline direct 0.95x [min-max]

--smoke: tito's half alone, in seconds: no vllm serve, and instead of `vllm bench serve` (whose
import alone takes longer than the whole smoke run) the same kind of chats streamed from the
gateway by httpx; 4 prompts of a few words, 4 output tokens, concurrency 2, one round.

Targets (issue 19): tito >= vllm serve on throughput at both concurrencies and not worse on TTFT
p50; the gateway >= 0.90 of the direct pipeline's throughput. vLLM's engine busy-polls for about a
second after its last step, so every measurement starts after a 1.5 s pause.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from processes import log_tail, spawn, stop_process, vllm_cli

ROOT = Path(__file__).resolve().parents[1]
VLLM_IDLE_S = 1.5
KV_CACHE_BYTES = 64 << 20
MAX_RUNNING = 64
START_TIMEOUT_S = 600
TITO, VLLM, DIRECT = "tito serve gateway", "vllm serve", "AsyncChatPipeline direct"

def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def wait_healthy(url: str, process: subprocess.Popen, name: str) -> None:
    import httpx

    deadline = time.monotonic() + START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"{name} exited with code {process.returncode}:\n{log_tail(process)}")
        try:
            if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"{name} did not become healthy in {START_TIMEOUT_S}s:\n{log_tail(process)}")


def num_prompts(concurrency: int, args) -> int:
    return max(args.min_prompts, 2 * concurrency)


def bench_serve(url: str, model: str, concurrency: int, args, out_dir: Path, tag: str) -> dict:
    """One `vllm bench serve` run; its saved result (JSON)."""
    name = f"{tag}.json"
    command = vllm_cli(
        "bench", "serve", "--backend", "openai-chat", "--base-url", url, "--endpoint", "/v1/chat/completions",
        "--model", model, "--tokenizer", model, "--dataset-name", "random", "--random-input-len",
        str(args.input_len), "--random-output-len", str(args.output_len), "--num-prompts",
        str(num_prompts(concurrency, args)), "--max-concurrency", str(concurrency), "--seed", str(args.seed),
        "--ignore-eos", "--temperature", "0", "--percentile-metrics", "ttft,tpot", "--metric-percentiles", "50,99",
        "--disable-tqdm", "--save-result", "--result-dir", str(out_dir), "--result-filename", name)
    done = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"},
                          timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"vllm bench serve against {url} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}")
    result = json.loads((out_dir / name).read_text())
    if result.get("completed") != num_prompts(concurrency, args):
        raise RuntimeError(f"vllm bench serve against {url}: {result.get('completed')} of "
                           f"{num_prompts(concurrency, args)} requests completed:\n{done.stdout[-3000:]}")
    return {"req/s": result["request_throughput"], "tok/s": result["output_throughput"],
            "ttft p50": result["p50_ttft_ms"], "ttft p99": result["p99_ttft_ms"],
            "tpot p50": result["p50_tpot_ms"], "tpot p99": result["p99_tpot_ms"]}


def random_chats(model: str, count: int, args) -> list[str]:
    """The prompts `vllm bench serve --dataset-name random` sends, drawn with vLLM's own code."""
    from vllm.benchmarks.datasets.datasets import RandomDataset
    from vllm.tokenizers import get_tokenizer

    tokenizer = get_tokenizer(model, tokenizer_mode="auto", trust_remote_code=False)
    samples = RandomDataset(random_seed=args.seed, dataset_path=None).sample(
        tokenizer=tokenizer, num_requests=count, input_len=args.input_len, output_len=args.output_len)
    return [sample.prompt for sample in samples]


def smoke_chats(count: int) -> list[str]:
    """--smoke's prompts: a few words each (no vLLM dataset)."""
    return [f"Count from {i} to {i + 3} in words." for i in range(count)]


async def gateway_chats(url: str, model: str, prompts: list[str], concurrency: int, output_len: int) -> dict:
    """--smoke's stand-in for `vllm bench serve`: the chats streamed from the gateway by httpx,
    `concurrency` at a time; output tok/s and TTFT as `direct` measures them."""
    import httpx

    ttfts: list[float] = []
    tokens = 0
    queue = list(prompts)
    async with httpx.AsyncClient(base_url=url, timeout=600) as client:
        async def worker():
            nonlocal tokens
            while queue:
                body = {"model": model, "messages": [{"role": "user", "content": queue.pop(0)}], "stream": True,
                        "max_tokens": output_len, "temperature": 0, "ignore_eos": True,
                        "stream_options": {"include_usage": True}}
                started, first = time.perf_counter(), None
                async with client.stream("POST", "/v1/chat/completions", json=body) as response:
                    response.raise_for_status()
                    async for line in response.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line.removeprefix("data: "))
                        if first is None and any(c["delta"].get("content") for c in chunk["choices"]):
                            first = time.perf_counter() - started
                        tokens += (chunk.get("usage") or {}).get("completion_tokens", 0)
                ttfts.append((first or 0.0) * 1000)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return rates(prompts, tokens, elapsed, ttfts)


def rates(prompts: list[str], tokens: int, elapsed: float, ttfts: list[float]) -> dict:
    ttfts = sorted(ttfts)
    return {"req/s": len(prompts) / elapsed, "tok/s": tokens / elapsed, "ttft p50": statistics.median(ttfts),
            "ttft p99": ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], "tpot p50": float("nan"),
            "tpot p99": float("nan")}


async def direct(endpoints, prompts: list[str], concurrency: int, output_len: int) -> dict:
    """The same chats through AsyncChatPipeline, `concurrency` at a time: output tok/s and TTFT
    (derender batched as the gateway does it, so the ratio is the HTTP layer's cost)."""
    from tito.v1 import chat_pb2, render_pb2
    from tito_client.pipeline import AsyncChatPipeline

    ttfts: list[float] = []
    tokens = 0
    queue = list(prompts)
    async with AsyncChatPipeline(endpoints, timeout=600, batch_derender=True) as pipeline:
        async def worker():
            nonlocal tokens
            while queue:
                prompt = queue.pop(0)
                request = render_pb2.RenderChatRequest(
                    messages=[chat_pb2.ChatMessage(role="user", content=prompt)],
                    sampling=render_pb2.SamplingOptions(max_tokens=output_len, temperature=0.0, ignore_eos=True))
                started, first = time.perf_counter(), None
                async for chunk in pipeline.stream_chat(request):
                    if first is None and chunk.content:
                        first = time.perf_counter() - started
                    if chunk.finish_reason:
                        tokens += chunk.usage.completion_tokens
                ttfts.append((first or 0.0) * 1000)
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        elapsed = time.perf_counter() - started
    return rates(prompts, tokens, elapsed, ttfts)


def print_best_rounds(results: dict[tuple[str, int], list[dict]], setups, args) -> None:
    """The settings, then per concurrency and setup its best round (by output throughput)."""
    prompts = "a few words each (--smoke)" if args.smoke else \
        f"{args.input_len} prompt tokens (vLLM random dataset, seed {args.seed})"
    print(f"\nmodel {args.model}, float32, prefix caching off, {prompts}, {args.output_len} output tokens "
          f"(ignore_eos, greedy), {args.rounds} rounds; best round:")
    width = max(26, *(len(name) for name in setups))
    print(f"{'setup':<{width}} {'c':>3} {'req/s':>7} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} {'TPOT p50':>9} "
          f"{'TPOT p99':>9}   (ms)")
    for concurrency in args.concurrency:
        for name in setups:
            best = max(results[(name, concurrency)], key=lambda r: r["tok/s"])
            print(f"{name:<{width}} {concurrency:>3} {best['req/s']:>7.2f} {best['tok/s']:>8.1f} "
                  f"{best['ttft p50']:>9.1f} {best['ttft p99']:>9.1f} {best['tpot p50']:>9.1f} "
                  f"{best['tpot p99']:>9.1f}")
    print()


def ratio_line(label: str, values: list[float]) -> str:
    return f"{label} {statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen2-h256")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--min-prompts", type=int, default=8, help="prompts per run: max(this, 2 x concurrency)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--vllm-batched-tokens", type=int, default=None,
                        help="vllm serve --max-num-batched-tokens (default: vLLM's own, 2048 on CPU)")
    parser.add_argument("--smoke", action="store_true", help="tito's half alone, the smallest run (see above)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.concurrency, args.output_len, args.min_prompts = 1, [2], 4, 4
    setups = (TITO, DIRECT) if args.smoke else (TITO, VLLM, DIRECT)
    pause = 0.0 if args.smoke else VLLM_IDLE_S

    from tito_client.pipeline import Endpoints, wait_until_serving
    from tito_models.paths import resolve_model

    model = str(resolve_model(args.model))
    tmp = Path(tempfile.mkdtemp(prefix="tito-gateway-bench-"))
    sockets = {name: f"unix:{tmp / (name + '.sock')}" for name in ("render", "engine", "derender")}
    tito_url, vllm_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
    # tito serve all passes its environment on: the engine flags as TITO_* variables (tito.env_flags).
    tito_env = {**os.environ, "TITO_DTYPE": "float32", "TITO_PREFIX_CACHING": "false",
                "TITO_KV_CACHE_BYTES": str(KV_CACHE_BYTES), "TITO_MAX_RUNNING_SEQUENCES": str(MAX_RUNNING)}
    processes = {}
    try:
        processes[TITO] = spawn([sys.executable, "-m", "tito_cli", "serve", "all", "--model", model, "--log-level",
                                 "warning", *(arg for name, address in sockets.items()
                                              for arg in (f"--{name}-address", address)),
                                 "--gateway-address", tito_url.removeprefix("http://")], tmp / "tito.log", env=tito_env)
        processes[VLLM] = None if args.smoke else spawn(vllm_cli(
                                         "serve", model, "--dtype", "float32", "--no-enable-prefix-caching",
                                         "--enforce-eager", "--max-num-seqs", str(MAX_RUNNING),
                                         "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
                                         *(("--max-num-batched-tokens", str(args.vllm_batched_tokens))
                                           if args.vllm_batched_tokens else ()), "--generation-config",
                                         "vllm", "--host", "127.0.0.1", "--port", vllm_url.rsplit(":", 1)[1],
                                         "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning"),
                                tmp / "vllm.log", env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
        wait_healthy(tito_url, processes[TITO], TITO)
        for address in sockets.values():
            wait_until_serving(address, timeout=60)
        if not args.smoke:
            wait_healthy(vllm_url, processes[VLLM], VLLM)
        chats = {c: smoke_chats(num_prompts(c, args)) if args.smoke else random_chats(model, num_prompts(c, args), args)
                 for c in args.concurrency}
        endpoints = Endpoints(**sockets)
        results: dict[tuple[str, int], list[dict]] = {}
        for round_index in range(args.rounds):
            for concurrency in args.concurrency:
                order = [TITO, VLLM] if round_index % 2 == 0 else [VLLM, TITO]
                for name in (order if not args.smoke else [TITO]):
                    time.sleep(pause)
                    url = tito_url if name == TITO else vllm_url
                    results.setdefault((name, concurrency), []).append(
                        asyncio.run(gateway_chats(url, model, chats[concurrency], concurrency, args.output_len))
                        if args.smoke else
                        bench_serve(url, model, concurrency, args, tmp, f"{round_index}-{concurrency}-{len(name)}"))
                time.sleep(pause)
                results.setdefault((DIRECT, concurrency), []).append(
                    asyncio.run(direct(endpoints, chats[concurrency], concurrency, args.output_len)))
                print(f"round {round_index + 1}/{args.rounds} c={concurrency}: " + ", ".join(
                    f"{name} {results[(name, concurrency)][-1]['tok/s']:.0f} tok/s" for name in setups), flush=True)
    finally:
        for process in processes.values():
            if process is not None:
                stop_process(process)

    print_best_rounds(results, setups, args)
    for concurrency in args.concurrency:
        tito, pipe = results[(TITO, concurrency)], results[(DIRECT, concurrency)]
        if VLLM in setups:
            vllm = results[(VLLM, concurrency)]
            print(ratio_line(f"c={concurrency} tito / vllm serve",
                             [t["tok/s"] / v["tok/s"] for t, v in zip(tito, vllm)]))
            print(ratio_line(f"c={concurrency} TTFT p50 tito / vllm serve",
                             [t["ttft p50"] / v["ttft p50"] for t, v in zip(tito, vllm)]))
        print(ratio_line(f"c={concurrency} gateway / AsyncChatPipeline direct",
                         [t["tok/s"] / d["tok/s"] for t, d in zip(tito, pipe)]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
