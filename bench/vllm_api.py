"""vLLM's token-in/token-out HTTP API: tito's gateway against vLLM's own servers, in one run.

    .venv/bin/python bench/vllm_api.py [--rounds 2] [--concurrency 1 32] [--output-len 64] [--stream-tokens 256]
    .venv/bin/python bench/vllm_api.py --skip-derender --skip-aiperf --concurrency 32   # (b) alone, at c=32
    .venv/bin/python bench/vllm_api.py --smoke   # tito alone, a few short calls: checks that it runs

Starts, on one model (default tiny-qwen2-h256, float32, prefix caching off; its vocabulary has
`<think>` and `<tool_call>`, so tito detects the qwen3 reasoning and hermes tool parsers and vLLM
is given the same):
  - tito:   `tito serve all --gateway-address 127.0.0.1:PORT` (three services, gateway over them);
  - vLLM:   `vllm launch render MODEL` (render and derender endpoints, no engine) and
            `vllm serve MODEL --enable-scale-out` (generate), as llm-d's coordinator runs them.
The same client code drives both sides, in paired rounds (the order rotates each round):

(a) Streamed derender, per chunk: a 256-token answer (reasoning, content, one tool call) sent one
    token per call to `/v1/chat/completions/derender` with `stream: true`, carrying each side's
    `stream_state` (vLLM's: every output token so far, replayed through a fresh parser per call;
    tito's: derender's sealed state, its size independent of the output's length), with
    `chat_request` and `prompt_token_ids` on every call as vLLM needs them; 1 and 16 such
    streams at once (--skip-derender leaves it out). Measured over HTTP, server to server:
    per-chunk latency over the first and the last 32 chunks of a stream, chunks/s, and the
    state's size at the end.
(b) The pipeline: render -> generate (streamed) -> derender (whole) over HTTP for 32 chats with
    64 greedy tokens (ignore_eos), at each concurrency: output tok/s, and TTFT (render sent to the
    first generated token) p50.
(c) AIPerf (PyPI aiperf, the test extra): `aiperf profile --endpoint-type vllm_generate` (tito's
    endpoint plugin, tito_client.aiperf_plugin) against each side's generate endpoint, 32
    streamed requests of 32 synthetic prompt tokens (the same on both sides: --random-seed) and
    64 output tokens (greedy, ignore_eos), at each concurrency; every request must succeed with
    exactly that many tokens. AIPerf's output tok/s and TTFT p50 (its own start-up, about 20 s
    a run here, is outside its measurement). --skip-aiperf leaves it out.

Prints per side and setting, then the ratios (median [min-max] over rounds), and for (b) the CPU
milliseconds per output token of every server process (tito's gateway, render, engine server,
engine core, derender; vLLM's render server, API server, EngineCore, Worker) and of the client,
from /proc (Linux): on a few shared cores, where each side spends its time:

    derender x16 chunks/s tito / vLLM 3.1x ...        higher is better
    c=32 tok/s tito / vLLM 1.3x ...                   higher is better
    c=1 TTFT p50 tito / vLLM 0.8x ...                 lower is better
    aiperf c=32 tok/s tito / vLLM 1.1x ...            (c), the same

--smoke: tito's side alone, in seconds: 24-token derender streams at 1 and 2 streams, 4 chats of
4 tokens at concurrency 2, AIPerf's 4 requests of 4 tokens at concurrency 2, one round. Targets
(issue 36): pipeline tok/s at c=32 >= 1.2x vLLM's and TTFT p50 at c=1 <= vLLM's.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway import free_port, wait_healthy
from processes import process_tree_cpu, spawn, stop_process, vllm_cli

TITO, VLLM = "tito", "vLLM"
KV_CACHE_BYTES = 64 << 20
VLLM_IDLE_S = 1.5  # vLLM's engine busy-polls for about a second after its last step
SERVED = "bench"
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]
EDGE = 32  # chunks at each end of a derender stream whose latency is reported
AIPERF_INPUT_LEN = 32
AIPERF_TIMEOUT_S = 600


class Side:
    """One side's URLs: where it renders, generates and derenders."""

    def __init__(self, name: str, render: str, generate: str) -> None:
        self.name, self.render, self.generate = name, render, generate


def answer_text(tokens: int) -> str:
    """Reasoning, then content, then one tool call: every parser stage has work."""
    reasoning = "The user asks about the weather in Paris, so I should call the tool. " * (tokens // 24 + 1)
    return (f"<think>\n{reasoning}\n</think>\n\nLet me check that for you.<tool_call>\n"
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')


def chat(index: int, max_tokens: int) -> dict:
    return {"model": SERVED, "messages": [{"role": "user", "content": f"Tell me about the number {index}."}],
            "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}


async def derender_stream(http, side: Side, ids: list[int], prompt: list[int], chat_request: dict) -> dict:
    """One token per call; per-call latencies and the final state's size."""
    state, latencies = None, []
    for i, token in enumerate(ids):
        body = {"stream": True, "model": SERVED, "stream_state": state, "prompt_token_ids": prompt,
                "chat_request": chat_request, "generate_chunk": {
                    "request_id": "chatcmpl-bench", "choices": [{
                        "index": 0, "token_ids": [token], "finish_reason": "stop" if i == len(ids) - 1 else None}]}}
        started = time.perf_counter()
        reply = await http.post(f"{side.render}/v1/chat/completions/derender", json=body)
        latencies.append(time.perf_counter() - started)
        if reply.status_code != 200:
            raise RuntimeError(f"{side.name} streamed derender: {reply.status_code} {reply.text[:500]}")
        state = reply.json()["stream_state"]
    return {"latencies": latencies, "state_bytes": len(json.dumps(state))}


async def derender_bench(side: Side, streams: int, ids: list[int]) -> dict:
    import httpx

    chat_request = {**chat(0, 64), "tools": TOOLS}
    async with httpx.AsyncClient(timeout=600) as http:
        rendered = await http.post(f"{side.render}/v1/chat/completions/render", json=chat_request)
        prompt = rendered.json()["token_ids"]
        started = time.perf_counter()
        runs = await asyncio.gather(*(derender_stream(http, side, ids, prompt, chat_request) for _ in range(streams)))
        elapsed = time.perf_counter() - started
    first = [lat for run in runs for lat in run["latencies"][:EDGE]]
    last = [lat for run in runs for lat in run["latencies"][-EDGE:]]
    return {"chunks/s": streams * len(ids) / elapsed, "first ms": 1e3 * statistics.mean(first),
            "last ms": 1e3 * statistics.mean(last), "state bytes": max(run["state_bytes"] for run in runs)}


async def one_chat(http, side: Side, body: dict) -> tuple[int, float]:
    """render -> streamed generate -> whole derender; (tokens, TTFT in s)."""
    started = time.perf_counter()
    rendered = (await http.post(f"{side.render}/v1/chat/completions/render", json=body)).json()
    tokens: list[int] = []
    ttft, finish = None, "length"
    async with http.stream("POST", f"{side.generate}/inference/v1/generate", json={**rendered, "stream": True}) as s:
        async for line in s.aiter_lines():
            if not line.startswith("data: {"):
                continue
            for choice in json.loads(line[6:]).get("choices", []):
                if choice["token_ids"] and ttft is None:
                    ttft = time.perf_counter() - started
                tokens += choice["token_ids"]
                finish = choice.get("finish_reason") or finish
    derendered = await http.post(f"{side.render}/v1/chat/completions/derender", json={
        "model": SERVED, "chat_request": body, "prompt_token_ids": rendered["token_ids"],
        "prompt_tokens": len(rendered["token_ids"]),
        "generate_response": {"request_id": "chatcmpl-bench", "choices": [
            {"index": 0, "token_ids": tokens, "finish_reason": finish}]}})
    if derendered.status_code != 200 or not tokens:
        raise RuntimeError(f"{side.name} pipeline: {derendered.status_code} {derendered.text[:500]}")
    return len(tokens), ttft or 0.0


async def pipeline_bench(side: Side, chats: list[dict], concurrency: int) -> dict:
    import httpx

    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency + 4)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:
        async def run(body):
            async with gate:
                return await one_chat(http, side, body)

        started = time.perf_counter()
        results = await asyncio.gather(*(run(body) for body in chats))
        elapsed = time.perf_counter() - started
    return {"tok/s": sum(t for t, _ in results) / elapsed, "tokens": sum(t for t, _ in results),
            "ttft p50": 1e3 * statistics.median(ttft for _, ttft in results)}


def process_label(pid: int, name: str, root: str) -> str:
    """A server process's part: tito's service (`tito_cli serve NAME`, its engine core the engine's
    child), vLLM's engine processes by their own names, anything else its root's."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            args = cmdline.read().decode(errors="replace").split("\0")
        with open(f"/proc/{pid}/stat") as stat_file:
            parent = int(stat_file.read().rsplit(")", 1)[1].split()[1])
        with open(f"/proc/{parent}/cmdline", "rb") as cmdline:
            parent_args = cmdline.read().decode(errors="replace").split("\0")
    except OSError:
        return root
    if "tito_cli" in args and "serve" in args:
        return f"tito {args[args.index('serve') + 1]}"
    if "serve" in parent_args and "engine" in parent_args and any("spawn_main" in arg for arg in args):
        return "tito engine core"
    return name if name.startswith("VLLM::") else root


def servers_cpu(roots: dict[str, subprocess.Popen]) -> dict[str, float]:
    """CPU seconds so far of every process of the servers started as `roots` (label -> process),
    summed by process_label."""
    seconds: dict[str, float] = {}
    for root, process in roots.items():
        for pid, (name, used) in process_tree_cpu(process.pid).items():
            label = process_label(pid, name, root)
            seconds[label] = seconds.get(label, 0.0) + used
    return seconds


def measured_pipeline(side: Side, chats: list[dict], concurrency: int, roots: dict[str, subprocess.Popen]) -> dict:
    """pipeline_bench, with the CPU seconds each of the side's server processes (`roots`) and this
    client spent on it ("cpu": label -> seconds)."""
    before, client = servers_cpu(roots), time.process_time()
    result = asyncio.run(pipeline_bench(side, chats, concurrency))
    client, after = time.process_time() - client, servers_cpu(roots)
    result["cpu"] = {label: after[label] - before.get(label, 0.0) for label in after}
    result["cpu"]["client (this process)"] = client
    return result


def aiperf_bench(side: Side, model: str, requests: int, output_len: int, concurrency: int, out: Path) -> dict:
    """One `aiperf profile --endpoint-type vllm_generate` against `side`'s generate endpoint: AIPerf's
    output tok/s and TTFT p50, once every request has succeeded with exactly `output_len` tokens."""
    command = [str(Path(sys.executable).parent / "aiperf"), "profile", "--endpoint-type", "vllm_generate",
               "--url", side.generate, "--model", SERVED, "--tokenizer", model, "--extra-inputs", f"tokenizer:{model}",
               "--streaming", "--request-count", str(requests), "--concurrency", str(concurrency),
               "--prompt-corpus", "random", "--random-seed", "0",
               "--synthetic-input-tokens-mean", str(AIPERF_INPUT_LEN),
               "--output-tokens-mean", str(output_len), "--extra-inputs", "ignore_eos:true",
               "--extra-inputs", "temperature:0", "--use-server-token-count", "--ui-type", "none",
               "--artifact-dir", str(out)]
    # AIPerf 0.13 offline (HF_HUB_OFFLINE set to anything) loads no tokenizer from a directory.
    env = {name: value for name, value in os.environ.items() if name not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    run = subprocess.run(command, capture_output=True, text=True, timeout=AIPERF_TIMEOUT_S, env=env)
    if run.returncode != 0:
        raise RuntimeError(f"{side.name} aiperf exited with {run.returncode}:\n"
                           f"{run.stdout[-3000:]}{run.stderr[-3000:]}")
    summary = json.loads((out / "profile_export_aiperf.json").read_text())
    lengths = summary["output_sequence_length"]
    if summary["request_count"]["avg"] != requests or summary.get("error_summary") or \
            lengths["min"] != output_len or lengths["max"] != output_len:
        raise RuntimeError(f"{side.name} aiperf: {summary['request_count']} requests, output lengths "
                           f"{lengths['min']}-{lengths['max']}, errors {summary.get('error_summary')}")
    return {"tok/s": summary["output_token_throughput"]["avg"], "ttft p50": summary["time_to_first_token"]["p50"]}


def ratio_line(label: str, values: list[float]) -> str:
    return f"{label} {statistics.median(values):.2f}x [{min(values):.2f}-{max(values):.2f}]"


def start(args, model: str, tmp: Path) -> tuple[dict, dict[str, Side]]:
    tito_url = f"http://127.0.0.1:{free_port()}"
    sockets = {name: f"unix:{tmp / (name + '.sock')}" for name in ("render", "engine", "derender")}
    env = {**os.environ, "TITO_DTYPE": "float32", "TITO_PREFIX_CACHING": "false",
           "TITO_KV_CACHE_BYTES": str(KV_CACHE_BYTES), "TITO_SERVED_MODEL_NAME": SERVED}
    processes = {TITO: spawn([sys.executable, "-m", "tito_cli", "serve", "all", "--model", model, "--log-level",
                              "warning",
                              *(arg for name, address in sockets.items() for arg in (f"--{name}-address", address)),
                              "--gateway-address", tito_url.removeprefix("http://")], tmp / "tito.log", env=env)}
    sides = {TITO: Side(TITO, tito_url, tito_url)}
    if not args.smoke:
        render_url, serve_url = f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"
        common = ("--served-model-name", SERVED, "--dtype", "float32", "--reasoning-parser", "qwen3",
                  "--tool-call-parser", "hermes", "--enable-auto-tool-choice", "--host", "127.0.0.1",
                  "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning", "--generation-config", "vllm")
        vllm_env = {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}
        processes["vllm render"] = spawn(vllm_cli("launch", "render", model, *common, "--port",
                                                  render_url.rsplit(":", 1)[1]), tmp / "render.log", env=vllm_env)
        processes["vllm serve"] = spawn(vllm_cli("serve", model, *common, "--enable-scale-out",
                                                 "--no-enable-prefix-caching", "--enforce-eager",
                                                 "--kv-cache-memory-bytes", str(KV_CACHE_BYTES), "--port",
                                                 serve_url.rsplit(":", 1)[1]), tmp / "serve.log", env=vllm_env)
        sides[VLLM] = Side(VLLM, render_url, serve_url)
    return processes, sides


def wait_ready(processes: dict, sides: dict[str, Side]) -> None:
    wait_healthy(sides[TITO].render, processes[TITO], TITO)
    if "vllm render" in processes:
        wait_healthy(sides[VLLM].render, processes["vllm render"], "vllm launch render")
    if "vllm serve" in processes:
        wait_healthy(sides[VLLM].generate, processes["vllm serve"], "vllm serve")


def rounds(args, sides: dict[str, Side]):
    """Each round's side order: as listed, then reversed, and so on."""
    for round_index in range(args.rounds):
        yield round_index, list(sides) if round_index % 2 == 0 else list(reversed(sides))


def side_roots(processes: dict, name: str) -> dict[str, subprocess.Popen]:
    """The server processes of side `name`, by label."""
    return {label: process for label, process in processes.items() if (label == TITO) == (name == TITO)}


def api_rounds(args, sides: dict[str, Side], ids: list[int], processes: dict) -> tuple[dict, dict]:
    """(a) and (b): {(side, streams): [per round]}, {(side, concurrency): [per round]}."""
    chats = [chat(i, args.output_len) for i in range(args.chats)]
    derender: dict[tuple[str, int], list[dict]] = {}
    pipeline: dict[tuple[str, int], list[dict]] = {}
    for round_index, order in rounds(args, sides):
        for name in order:
            for streams in [] if args.skip_derender else args.streams:
                derender.setdefault((name, streams), []).append(asyncio.run(derender_bench(sides[name], streams, ids)))
            for concurrency in args.concurrency:
                time.sleep(0 if args.smoke else VLLM_IDLE_S)
                pipeline.setdefault((name, concurrency), []).append(
                    measured_pipeline(sides[name], chats, concurrency, side_roots(processes, name)))
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    return derender, pipeline


def aiperf_rounds(args, sides: dict[str, Side], model: str, tmp: Path) -> dict:
    """(c): {(side, concurrency): [per round]}."""
    results: dict[tuple[str, int], list[dict]] = {}
    for round_index, order in rounds(args, sides):
        for name in order:
            for concurrency in args.concurrency:
                time.sleep(0 if args.smoke else VLLM_IDLE_S)
                out = tmp / f"aiperf-{name}-c{concurrency}-r{round_index}"
                results.setdefault((name, concurrency), []).append(
                    aiperf_bench(sides[name], model, args.chats, args.output_len, concurrency, out))
        print(f"round {round_index + 1}/{args.rounds} done", flush=True)
    return results


def print_derender(derender: dict, streams_list: list[int], sides: dict[str, Side]) -> None:
    print(f"{'side':<6} {'streams':>7} {'chunks/s':>9} {'first ms':>9} {'last ms':>8} {'state B':>8}")
    for (name, streams), runs in derender.items():
        best = max(runs, key=lambda r: r["chunks/s"])
        print(f"{name:<6} {streams:>7} {best['chunks/s']:>9.0f} {best['first ms']:>9.2f} {best['last ms']:>8.2f} "
              f"{best['state bytes']:>8}")
    if VLLM in sides:
        for streams in streams_list:
            print(ratio_line(f"derender x{streams} chunks/s tito / vLLM", [
                t["chunks/s"] / v["chunks/s"] for t, v in zip(derender[(TITO, streams)], derender[(VLLM, streams)])]))


def print_throughput(label: str, results: dict, concurrencies: list[int], sides: dict[str, Side]) -> None:
    """Each side's best round per concurrency, then tito / vLLM per round (median [min-max])."""
    print(f"{'side':<6} {'c':>7} {'tok/s':>9} {'TTFT p50 ms':>12}")
    for (name, concurrency), runs in results.items():
        best = max(runs, key=lambda r: r["tok/s"])
        print(f"{name:<6} {concurrency:>7} {best['tok/s']:>9.1f} {best['ttft p50']:>12.1f}")
    if VLLM in sides:
        for concurrency in concurrencies:
            tito, vllm = results[(TITO, concurrency)], results[(VLLM, concurrency)]
            print(ratio_line(f"{label}c={concurrency} tok/s tito / vLLM",
                             [t["tok/s"] / v["tok/s"] for t, v in zip(tito, vllm)]))
            print(ratio_line(f"{label}c={concurrency} TTFT p50 tito / vLLM",
                             [t["ttft p50"] / v["ttft p50"] for t, v in zip(tito, vllm)]))


def print_cpu(results: dict) -> None:
    """CPU milliseconds per output token of each server process and of the client, over all
    rounds: where each side spends its time (Linux /proc; nothing elsewhere)."""
    print("CPU ms per output token (all rounds; the client is the same code for both sides):")
    for (name, concurrency), runs in results.items():
        tokens = sum(run["tokens"] for run in runs)
        labels = sorted({label for run in runs for label in run["cpu"]})
        spent = {label: sum(run["cpu"].get(label, 0.0) for run in runs) for label in labels}
        servers = sum(seconds for label, seconds in spent.items() if not label.startswith("client"))
        parts = ", ".join(f"{label} {1e3 * seconds / tokens:.3f}" for label, seconds in spent.items() if seconds)
        print(f"{name:<6} c={concurrency:<4} servers {1e3 * servers / tokens:.3f}: {parts}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="tiny-qwen2-h256")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 32])
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--chats", type=int, default=32)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--stream-tokens", type=int, default=256)
    parser.add_argument("--skip-aiperf", action="store_true", help="leave out (c), AIPerf's vllm_generate")
    parser.add_argument("--skip-derender", action="store_true", help="leave out (a), the streamed derender")
    parser.add_argument("--smoke", action="store_true", help="tito's side alone, the smallest run (see above)")
    args = parser.parse_args()
    if args.smoke:
        args.rounds, args.concurrency, args.streams, args.chats = 1, [2], [1, 2], 4
        args.output_len, args.stream_tokens = 4, 24

    from tokenizers import Tokenizer

    from tito_models.paths import resolve_model

    model = str(resolve_model(args.model))
    ids = Tokenizer.from_file(str(Path(model) / "tokenizer.json")).encode(
        answer_text(args.stream_tokens), add_special_tokens=False).ids[:args.stream_tokens]
    tmp = Path(tempfile.mkdtemp(prefix="tito-vllm-api-bench-"))
    processes, sides = start(args, model, tmp)
    aiperf: dict[tuple[str, int], list[dict]] = {}
    try:
        wait_ready(processes, sides)
        derender, pipeline = api_rounds(args, sides, ids, processes)
        if not args.skip_aiperf:
            aiperf = aiperf_rounds(args, sides, model, tmp)
    finally:
        for process in processes.values():
            stop_process(process)

    print(f"\nmodel {args.model}, float32; derender streams of {len(ids)} tokens, one per call; "
          f"{args.chats} chats x {args.output_len} tokens (greedy, ignore_eos); {args.rounds} rounds, best round:")
    if derender:
        print_derender(derender, args.streams, sides)
    print_throughput("", pipeline, args.concurrency, sides)
    print_cpu(pipeline)
    if aiperf:
        print(f"AIPerf vllm_generate, {args.chats} streamed requests of {AIPERF_INPUT_LEN} prompt tokens "
              f"x {args.output_len} tokens (greedy, ignore_eos), best round:")
        print_throughput("aiperf ", aiperf, args.concurrency, sides)
    return 0


if __name__ == "__main__":
    sys.exit(main())
