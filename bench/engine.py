"""Engine throughput over gRPC against Hugging Face generate, or against vLLM, in one run.

    .venv/bin/python bench/engine.py [--model tiny-qwen2] [--device cpu] [--new-tokens 64]
    .venv/bin/python bench/engine.py --vllm [--model tiny-qwen2-h256] [--concurrency 1 32]

    .venv/bin/python bench/engine.py --constrained [--concurrency 32]
    .venv/bin/python bench/engine.py --pipeline [--concurrency 1 32]
    .venv/bin/python bench/engine.py --shape qwen2.5-0.5b [--checkpoints float32 bfloat16] [--repeats 2]
    .venv/bin/python bench/engine.py [any mode] --smoke   # seconds: tito's side alone, checks that it runs

Default run: starts the engine server as a subprocess on a Unix socket, sends the same 32 prompts
of different lengths (greedy, ignore_eos, 64 new tokens each) at concurrency 1, 8 and 32 from a
grpc.aio client, and measures in the same run (server idle meanwhile) HF `generate` one request at
a time (over a subset, per-token rate) and on a static left-padded batch of the 32 prompts. Prints
aggregate output tokens/s per row, TTFT and time-per-output-token percentiles, and the two ratios
the issue asks for at concurrency 32.

--vllm: the same prompts, sampling and concurrencies on four setups instead, all on one model
(default tiny-qwen2-h256: hidden 256, 4 layers, head_dim 64; vLLM's CPU attention needs head_dim
>= 32), float32, the same prefix caching, 64 MiB of KV cache, max_num_seqs 64 (or the top
concurrency), 2048 prompt tokens per step and the model's max_position_embeddings as context limit:
  - tito native over gRPC:        `python -m tito_engine.server` (tito's engine), grpc.aio client;
  - tito vllm backend over gRPC:  the same server with `--backend vllm` (vLLM's AsyncLLM behind
                                  tito's EngineService), the same client;
  - vLLM AsyncLLM in-process:     `AsyncLLM.from_engine_args` in a helper subprocess of this script
                                  (`--vllm-asyncllm-worker`), timed inside that process, so its
                                  processes and threads stay away from the client measuring the
                                  others. One AsyncLLM is kept alive, idle, for the whole run; the
                                  helper takes one JSON line per measurement on stdin and answers
                                  the result as JSON on stdout;
  - vLLM HTTP token-in:           `vllm serve DIR --enable-scale-out` on a local port, streaming
                                  `POST /inference/v1/generate` (Server-Sent Events) from aiohttp.
Every vLLM setup gets detokenize off, generation_config "vllm" (no defaults from the model's
generation_config.json, as tito's vllm backend pins it) and --enforce-eager. vLLM's engine busy-polls
for about a second after its last step, so every measurement starts after a 1.5 s pause. The HF
baselines are not run in this mode. Prints the table for the four setups, the ratios
tito-vllm-backend / AsyncLLM (target >= 0.90 at the top concurrency: tito's gRPC layer costs at most
10%) and tito-vllm-backend / vLLM HTTP (target > 1) at each concurrency, tito native / AsyncLLM and
tito native / vLLM HTTP (target >= 1.0, and >= 1.3 at concurrency 1), and whether the greedy
tokens of the four setups agree in the first round.

--pipeline: `tito serve all` as a user starts it (Unix sockets, the same model as --vllm, its own
default CPU placement: render and derender off the engine core's CPUs); the 32 prompts' words as
user turns of chats, rendered once. Measures,
paired, the engine alone on the rendered GenerateRequests (grpc.aio) and the same chats through
render -> engine -> derender with tito's asyncio pipeline client (tito_client.pipeline.AsyncChatPipeline),
greedy, ignore_eos. Prints both rows and the ratio pipeline / engine alone (target >= 0.9 at the top
concurrency).

--shape NAME: a real model's shape with random weights and Qwen's real vocabulary
(tito_models.real_shape; qwen2.5-0.5b: 494 M parameters), one checkpoint dtype after the other
(--checkpoints, default float32 then bfloat16): tito native, vLLM AsyncLLM and `vllm serve`, the
bfloat16 checkpoint at each side's default dtype (auto: both compute bf16 on a CPU with bf16
instructions), the float32 one computed in float32 on both sides (vLLM's auto would compute it in
bf16 on such a CPU, tito's keeps the checkpoint's precision; `--dtype bfloat16` is tito's way to
trade it for speed), each side's default CPU placement, 1 GiB of KV cache
on every side, max_model_len 4096. Workloads: the 32 short prompts at each --concurrency (at most
4 x concurrency of them: one token costs ~0.1-0.3 s here), then for the last checkpoint 1,024-token
prompts at concurrency 1 and at the top one, and the decode stall: 8 requests decoding 128 tokens
each while 4 prompts of 1,024 tokens arrive, the running ones' TPOT before and while those prefill
(chunked beside them) and the longest gap. Prints each checkpoint's table and the paired ratios
tito / AsyncLLM with the issue's targets (tok/s >= 1.2 at the top concurrency, >= 1.0 at 1 and
for the long prompts; TTFT and TPOT p50 no higher than AsyncLLM's). Default 2 rounds.

--constrained: one native engine server; the same prompts with no row, every other row and every
row under a JSON schema constraint (structured outputs: a typical response_format schema as the
items of an array too long to finish in the new tokens, so each constrained row is masked at every
step). Prints each mix's tok/s and its paired ratios to the unconstrained mix (target >= 0.75 with
every row constrained at the top concurrency): of wall-clock tok/s, and of tokens per CPU second
of the engine's processes (server + core, from /proc: Linux), which other load on a shared
machine disturbs much less.

--smoke: the smallest run of the mode: 4 prompts, 4 new tokens, concurrency 2, one round, the
last checkpoint, tito's engine core in its server's process; vLLM's setups (AsyncLLM, `vllm
serve`, tito's vllm backend) are left out, and
--shape runs on the tiny model instead of building the real shape. It checks that the bench
runs (tests/e2e/test_bench_smoke.py); its figures mean nothing.

The machine may be shared (other load comes and goes within seconds), so the figures are measured
in paired rounds: each round runs, at each concurrency, every setup back to back (the order rotates
from round to round) and, at the top concurrency in the default run, the HF baselines right after
the engine; each ratio is the median over rounds of the paired ratios. The table shows each
setup's best round. HF gets its best torch thread count (1 or the default) in every round.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
import torch

from processes import log_tail, process_tree_cpu_seconds, stop_process, vllm_cli
from processes import spawn as spawn_logged
from tito.cpu_affinity import allowed_cpus, format_cpu_list, run_on
from tito_models.paths import resolve_model
from tito_models.tiny import BENCH_TEXT_MODEL
from tito_client.pipeline import AsyncChatPipeline, Endpoints, wait_until_serving
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, render_pb2, render_pb2_grpc, sampling_pb2
from tito_engine.config import EngineConfig
from tito_engine.startup_plan import plan_startup
from tito_engine.limits import DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_MAX_RUNNING_SEQUENCES

NUM_PROMPTS = 32
WORDS = ("the engine schedules many streams in one batched forward and every step matters when the "
         "model is small so python overhead dominates arithmetic on two cores").split()
HF = "HF generate"
TITO_NATIVE = "tito native over gRPC"
TITO_VLLM = "tito vllm backend over gRPC"
ASYNCLLM = "vLLM AsyncLLM in-process"
VLLM_HTTP = "vLLM HTTP token-in"
ENGINE_ALONE = "tito engine alone on the rendered ids"
PIPELINE = "tito render -> engine -> derender"
VLLM_IDLE_S = 1.5  # vLLM's engine busy-polls ~1 s after its last step
VLLM_MAX_NUM_SEQS = DEFAULT_MAX_RUNNING_SEQUENCES  # vLLM's max_num_seqs counts sequences, like tito's flag
KV_CACHE_BYTES = 64 << 20
MAX_BATCHED_TOKENS = DEFAULT_MAX_PREFILL_TOKENS  # tito's --max-prefill-tokens-per-step (vLLM's max_num_batched_tokens)
START_TIMEOUT_S = 600  # several servers load at once on a small machine
ALL_CPUS = allowed_cpus()
# vLLM engine arguments tito's engine sets from its own flags (services/engine/tito_engine/vllm/args.py).
TITO_SETS = {"model", "max_model_len", "max_num_seqs", "enable_prefix_caching", "max_num_batched_tokens",
             "kv_cache_memory_bytes", "generation_config", "dtype"}


def make_prompts(tokenizer, count: int) -> list[list[int]]:
    """`count` prompts of different lengths (about 8 to 100 tokens) from the model's tokenizer."""
    prompts = []
    for i in range(count):
        words = [WORDS[(i * 7 + j) % len(WORDS)] for j in range(4 + (i * 37) % 70)]
        prompts.append(tokenizer(" ".join(words))["input_ids"])
    return prompts


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    k = (len(ordered) - 1) * q
    low, high = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (k - low)


# ------------------------------------------------------------------------------ client measurement

Stream = Callable[[list[int], int], AsyncIterator[list[int]]]


async def measure(stream: Stream, prompts: list[list[int]], new_tokens: int, concurrency: int) -> dict:
    """Send every prompt through `stream` (prompt, new tokens -> chunks of token ids), at most
    `concurrency` at a time; aggregate tok/s, per-request TTFT and TPOT (ms) and the tokens."""
    gate = asyncio.Semaphore(concurrency)

    async def one(prompt: list[int]) -> tuple[list[int], float, float, float]:
        async with gate:
            start = time.perf_counter()
            first = last = None
            tokens: list[int] = []
            async for chunk in stream(prompt, new_tokens):
                now = time.perf_counter()
                if chunk:
                    if first is None:
                        first = now
                    last = now
                    tokens.extend(chunk)
            return tokens, start, first, last

    began = time.perf_counter()
    results = await asyncio.gather(*(one(p) for p in prompts))
    elapsed = time.perf_counter() - began
    tokens = sum(len(r[0]) for r in results)
    assert tokens == new_tokens * len(prompts), f"expected {new_tokens * len(prompts)} tokens, got {tokens}"
    ttft = [(r[2] - r[1]) * 1000 for r in results]
    tpot = [(r[3] - r[2]) / (len(r[0]) - 1) * 1000 for r in results if len(r[0]) > 1]
    return {"tok_s": tokens / elapsed, "seconds": elapsed, "ttft": ttft, "tpot": tpot,
            "outputs": [r[0] for r in results]}


async def measure_stall(stream: Stream, running: list[list[int]], running_tokens: int, long_prompts: list[list[int]],
                        long_tokens: int) -> dict:
    """Decode stall: `running` requests decode (`running_tokens` each); once every one of them streams,
    the `long_prompts` arrive at once. Returns the running requests' time per output token (ms, p50
    of each chunk's gap over its tokens) before the long prompts came and while they prefilled (until
    the last one's first token), the longest gap a running request saw meanwhile, and the long
    prompts' TTFTs (ms)."""
    arrivals: list[list[tuple[float, int]]] = [[] for _ in running]
    all_streaming = asyncio.Event()
    started = set()

    async def decode(index: int, prompt: list[int]) -> None:
        async for chunk in stream(prompt, running_tokens):
            if chunk:
                arrivals[index].append((time.perf_counter(), len(chunk)))
                if index not in started and len(arrivals[index]) >= 3:
                    started.add(index)
                    if len(started) == len(running):
                        all_streaming.set()

    async def long_one(prompt: list[int]) -> float:
        began = time.perf_counter()
        first = None
        async for chunk in stream(prompt, long_tokens):
            if chunk and first is None:
                first = time.perf_counter()
        return first - began

    decodes = [asyncio.create_task(decode(i, p)) for i, p in enumerate(running)]
    await all_streaming.wait()
    launched = time.perf_counter()
    ttfts = await asyncio.gather(*(long_one(p) for p in long_prompts))
    prefilled = launched + max(ttfts)
    await asyncio.gather(*decodes)
    before, during, longest = [], [], 0.0
    for chunks in arrivals:
        for (previous, _), (now, count) in zip(chunks, chunks[1:]):
            per_token = (now - previous) / count * 1000
            if now <= launched:
                before.append(per_token)
            elif previous >= launched and now <= prefilled:
                during.append(per_token)
            if now > launched and previous < prefilled:
                longest = max(longest, (now - previous) * 1000)
    return {"tpot_before": percentile(before, 0.5), "tpot_during": percentile(during, 0.5),
            "max_gap": longest, "long_ttft": [t * 1000 for t in ttfts]}


# ------------------------------------------------------------------------------ setups

@dataclass(frozen=True)
class Settings:
    """What every setup is given, so that all of them serve the model the same way."""
    model: str
    model_dir: str
    device: str
    prefix_caching: bool
    max_running: int  # sequences (choices), tito's --max-running-sequences and vLLM's max_num_seqs
    max_model_len: int | None = None  # None: the model's own
    kv_cache_bytes: int | None = None  # None: tito's default
    dtype: str | None = "float32"  # None: each side's default (auto: the checkpoint's, as each chooses)
    engine_process: bool = True  # tito native: the engine core in its own process (--smoke: in the server's)

    def tito_flags(self, backend: str) -> list[str]:
        # The vllm backend refuses --device: vLLM runs where its build runs.
        flags = ["--device", self.device] if backend == "native" else []
        if backend == "native" and not self.engine_process:
            flags.append("--no-engine-process")
        if self.dtype is not None:
            flags += ["--dtype", self.dtype]
        flags += ["--model", self.model, "--max-running-sequences", str(self.max_running),
                 "--max-prefill-tokens-per-step", str(MAX_BATCHED_TOKENS),
                 "--prefix-caching" if self.prefix_caching else "--no-prefix-caching"]
        if self.max_model_len is not None:
            flags += ["--max-model-len", str(self.max_model_len)]
        if self.kv_cache_bytes is not None:
            flags += ["--kv-cache-bytes", str(self.kv_cache_bytes)]
        return flags

    def vllm_engine_args(self) -> dict:
        """vLLM AsyncEngineArgs for the vLLM setups (tito's vllm backend gets the same, see TitoEngine)."""
        return {"model": self.model_dir, "dtype": self.dtype or "auto", "enforce_eager": True,
                "max_model_len": self.max_model_len, "enable_prefix_caching": self.prefix_caching,
                "max_num_seqs": self.max_running, "max_num_batched_tokens": MAX_BATCHED_TOKENS,
                "gpu_memory_utilization": 0.1, "kv_cache_memory_bytes": self.kv_cache_bytes or KV_CACHE_BYTES,
                "generation_config": "vllm"}


def vllm_cli_flags(engine_args: dict) -> list[str]:
    """Engine arguments in vLLM's command-line form (`--enforce-eager`, `--no-enable-prefix-caching`)."""
    flags = []
    for name, value in engine_args.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else f"--no-{flag[2:]}")
        elif value is not None:
            flags += [flag, str(value)]
    return flags


def vllm_env() -> dict[str, str]:
    """The environment of the three vLLM setups: the same for all, vLLM's INFO logging off."""
    return {**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"}


def spawn(command: list[str], log_path: str, **kwargs) -> subprocess.Popen:
    """processes.spawn on every CPU this script started with (this process itself may since have
    moved: client_cpus)."""
    return spawn_logged(command, log_path, preexec_fn=lambda: os.sched_setaffinity(0, ALL_CPUS), **kwargs)


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Setup:
    """One way of serving the model: started, waited for, measured from this process, stopped."""
    name = ""
    process: subprocess.Popen | None = None

    def __init__(self, settings: Settings):
        self.settings = settings

    async def start(self, tmp: str) -> None:
        raise NotImplementedError

    async def ready(self) -> None:
        raise NotImplementedError

    async def run(self, prompts: list[list[int]], new_tokens: int, concurrency: int) -> dict:
        raise NotImplementedError

    async def stall(self, experiment: dict) -> dict:
        return await measure_stall(self.stream, **experiment)

    async def check_idle(self) -> None:
        """After the last round: nothing left running."""

    async def stop(self) -> None:
        if self.process is not None:
            stop_process(self.process)

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise RuntimeError(f"{self.name}: the server exited early (exit status {self.process.returncode})")


class TitoEngine(Setup):
    """tito's engine server on a Unix socket, with the native or the vllm backend, over grpc.aio."""

    def __init__(self, settings: Settings, backend: str = "native"):
        super().__init__(settings)
        self.backend = backend
        self.name = TITO_VLLM if backend == "vllm" else TITO_NATIVE

    async def start(self, tmp: str) -> None:
        self.address = f"unix:{os.path.join(tmp, f'engine-{self.backend}.sock')}"
        command = [sys.executable, "-m", "tito_cli", "serve", "engine", "--address", self.address,
                   "--log-level", "warning",
                   "--backend", self.backend, *self.settings.tito_flags(self.backend)]
        env = None
        if self.backend == "vllm":
            engine_args = self.settings.vllm_engine_args()
            command += ["--", *vllm_cli_flags({k: v for k, v in engine_args.items() if k not in TITO_SETS})]
            env = vllm_env()
        self.process = spawn(command, os.path.join(tmp, f"engine-{self.backend}.log"), env=env)

    async def ready(self) -> None:
        self.channel = grpc.aio.insecure_channel(self.address)
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                await self.stub.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=2)
                return
            except grpc.aio.AioRpcError:
                await asyncio.sleep(0.2)
        raise RuntimeError(f"{self.name}: the engine did not start in time")

    async def stream(self, prompt: list[int], new_tokens: int,
                     structured_output: sampling_pb2.StructuredOutput | None = None) -> AsyncIterator[list[int]]:
        request = engine_pb2.GenerateRequest(token_ids=prompt, sampling_params=sampling_pb2.SamplingParams(
            temperature=0.0, max_tokens=new_tokens, ignore_eos=True, structured_output=structured_output))
        async for response in self.stub.Generate(request, timeout=600):
            yield response.token_ids

    async def run(self, prompts, new_tokens, concurrency):
        return await measure(self.stream, prompts, new_tokens, concurrency)

    async def check_idle(self) -> None:
        load = await self.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        assert load.running_requests == 0 and load.kv_blocks_used == 0, (self.name, load)

    async def stop(self) -> None:
        if getattr(self, "channel", None) is not None:
            await self.channel.close()
        await super().stop()


# --constrained: a typical response_format schema (nested object, array, enum, bounded strings and
# integers, required fields), as the items of an array that needs more than 64 tokens, so every
# constrained stream is masked at each of its steps and still runs to max_tokens.
ITEM_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 3},
        "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                     "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"], "additionalProperties": False},
    },
    "required": ["name", "age", "role", "address"],
    "additionalProperties": False,
}
BENCH_SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM_SCHEMA, "minItems": 100}},
                "required": ["items"], "additionalProperties": False}
UNCONSTRAINED = "no row constrained"


class ConstrainedShare(Setup):
    """The same native engine server as `base`, with every `every`-th prompt carrying the JSON
    schema constraint (BENCH_SCHEMA) and the others unconstrained (every=0: none constrained).
    Constrained and unconstrained prompts alternate, so with every=2 they share each step."""

    def __init__(self, base: TitoEngine, every: int, name: str):
        super().__init__(base.settings)
        self.base, self.every, self.name = base, every, name
        self.constraint = sampling_pb2.StructuredOutput(json_schema=json.dumps(BENCH_SCHEMA))

    async def start(self, tmp: str) -> None:  # the base setup runs the server
        pass

    async def ready(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def run(self, prompts, new_tokens, concurrency):
        # measure() hands over the prompt objects themselves: their ids say which are constrained.
        constrained = {id(p) for i, p in enumerate(prompts) if self.every and i % self.every == 0}

        def stream(prompt: list[int], tokens: int) -> AsyncIterator[list[int]]:
            return self.base.stream(prompt, tokens, self.constraint if id(prompt) in constrained else None)

        cpu_before = process_tree_cpu_seconds(self.base.process.pid)
        result = await measure(stream, prompts, new_tokens, concurrency)
        # CPU seconds the engine (server + core process) spent per token: what a step costs,
        # much less disturbed than wall time by other load on a shared machine.
        cpu = process_tree_cpu_seconds(self.base.process.pid) - cpu_before
        result["tokens_per_cpu_s"] = new_tokens * len(prompts) / max(cpu, 1e-9)
        return result


def engine_cpus(settings: Settings) -> tuple[frozenset[int] | None, frozenset[int] | None]:
    """The CPUs tito's engine core takes by default for this model (--core-cpus auto, chosen from its
    work) and the ones it leaves (None: not pinned): the client (this process, a router's stand-in)
    and render / derender run on the latter."""
    plan = plan_startup(EngineConfig(model=settings.model, device=settings.device)).cpus
    return (None, None) if plan is None else (plan.core_cpus, plan.server_cpus)


def keep_client_off_the_core(settings: Settings) -> None:
    """Run this process (the client) where the engine core is not, as a co-located router should."""
    core, others = engine_cpus(settings)
    if others:
        run_on(others)
        print(f"client on CPUs {format_cpu_list(others)}; tito's engine core on {format_cpu_list(core)}", flush=True)


# --pipeline: the same chats rendered once, then through the engine alone and the whole pipeline.
class ServeAll(Setup):
    """`tito serve all` as a user starts it (on Unix sockets; CPU placement its own default: render
    and derender off the engine core's CPUs); renders the chats (one user turn per prompt's words)
    once it is ready, for the two measured setups."""
    name = "tito serve all"

    def __init__(self, settings: Settings, texts: list[str]):
        super().__init__(settings)
        self.texts = texts
        self.rendered: list[engine_pb2.GenerateRequest] = []

    def chat(self, index: int, new_tokens: int) -> render_pb2.RenderChatRequest:
        return render_pb2.RenderChatRequest(
            messages=[chat_pb2.ChatMessage(role="user", content=self.texts[index])],
            sampling=render_pb2.SamplingOptions(max_tokens=new_tokens, temperature=0.0, ignore_eos=True))

    async def start(self, tmp: str) -> None:
        self.addresses = {name: f"unix:{os.path.join(tmp, f'{name}.sock')}"
                          for name in ("render", "engine", "derender")}
        flags = [flag for name, address in self.addresses.items() for flag in (f"--{name}-address", address)]
        env = {**os.environ, "TITO_PREFIX_CACHING": str(self.settings.prefix_caching).lower(),
               "TITO_MAX_RUNNING_SEQUENCES": str(self.settings.max_running),
               "TITO_ENGINE_PROCESS": str(self.settings.engine_process).lower()}
        self.process = spawn([sys.executable, "-m", "tito_cli", "serve", "all", "--model", self.settings.model,
                              "--device", self.settings.device, "--log-level", "warning", *flags],
                             os.path.join(tmp, "serve-all.log"), env=env)

    async def ready(self) -> None:
        for address in self.addresses.values():
            await asyncio.to_thread(wait_until_serving, address, timeout=START_TIMEOUT_S)
        self.channel = grpc.aio.insecure_channel(self.addresses["engine"])
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        async with grpc.aio.insecure_channel(self.addresses["render"]) as channel:
            stub = render_pb2_grpc.RenderServiceStub(channel)
            self.rendered = [(await stub.RenderChat(self.chat(i, 1), timeout=60)).generate_request
                             for i in range(len(self.texts))]

    def endpoints(self) -> Endpoints:
        return Endpoints(**self.addresses)

    async def check_idle(self) -> None:
        load = await self.stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
        assert load.running_requests == 0 and load.kv_blocks_used == 0, (self.name, load)

    async def stop(self) -> None:
        if getattr(self, "channel", None) is not None:
            await self.channel.close()
        await super().stop()


class EngineOnRendered(Setup):
    """The engine alone, given the rendered GenerateRequests (max_tokens set per measurement)."""
    name = ENGINE_ALONE

    def __init__(self, servers: ServeAll):
        super().__init__(servers.settings)
        self.servers = servers

    async def start(self, tmp: str) -> None:  # the engine and render setups run the servers
        pass

    async def ready(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    async def stream(self, index: int, new_tokens: int) -> AsyncIterator[list[int]]:
        request = engine_pb2.GenerateRequest()
        request.CopyFrom(self.servers.rendered[index])
        request.sampling_params.max_tokens = new_tokens
        async for response in self.servers.stub.Generate(request, timeout=600):
            yield list(response.token_ids)

    async def run(self, prompts, new_tokens, concurrency):
        return await measure(self.stream, prompts, new_tokens, concurrency)


class WholePipeline(EngineOnRendered):
    """The same chats through render -> engine -> derender with AsyncChatPipeline. Derender's
    chunks carry text, not ids: each chunk with text counts as one token when it arrives, and the
    final usage supplies the rest of the completion tokens (so tok/s and TTFT are exact)."""
    name = PIPELINE

    async def ready(self) -> None:
        self.pipeline = AsyncChatPipeline(self.servers.endpoints(), timeout=600)

    async def stop(self) -> None:
        if getattr(self, "pipeline", None) is not None:
            await self.pipeline.close()

    async def stream(self, index: int, new_tokens: int) -> AsyncIterator[list[int]]:
        seen = 0
        async for chunk in self.pipeline.stream_chat(self.servers.chat(index, new_tokens)):
            if chunk.content or chunk.reasoning_content:
                seen += 1
                yield [0]
            if chunk.HasField("usage"):
                yield [0] * (chunk.usage.completion_tokens - seen)


class AsyncLLMWorker(Setup):
    """vLLM's AsyncLLM in a helper process (`--vllm-asyncllm-worker`), kept alive for the whole run."""
    name = ASYNCLLM

    async def start(self, tmp: str) -> None:
        command = [sys.executable, str(Path(__file__).resolve()), "--vllm-asyncllm-worker"]
        self.process = spawn(command, os.path.join(tmp, "asyncllm.log"), stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, env=vllm_env())
        self.process.stdin.write(json.dumps(self.settings.vllm_engine_args()) + "\n")
        self.process.stdin.flush()

    def _reply(self) -> dict:
        line = self.process.stdout.readline()
        if not line:
            self.check_alive()
            raise RuntimeError(f"{self.name}: the worker closed its output")
        return json.loads(line)

    async def ready(self) -> None:
        reply = await asyncio.wait_for(asyncio.to_thread(self._reply), START_TIMEOUT_S)
        assert reply == {"ready": True}, reply

    async def _ask(self, request: dict) -> dict:
        self.process.stdin.write(json.dumps(request) + "\n")
        self.process.stdin.flush()
        return await asyncio.to_thread(self._reply)

    async def run(self, prompts, new_tokens, concurrency):
        return await self._ask({"prompts": prompts, "new_tokens": new_tokens, "concurrency": concurrency})

    async def stall(self, experiment: dict) -> dict:
        return await self._ask({"stall": experiment})

    async def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.stdin.close()  # the worker shuts AsyncLLM down and exits
            try:
                self.process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        await super().stop()


class VllmHttp(Setup):
    """`vllm serve --enable-scale-out` on a local port; streaming POST /inference/v1/generate (SSE).
    `extra_flags`: more `vllm serve` flags (bench/lora.py: --enable-lora and its adapters)."""
    name = VLLM_HTTP
    extra_flags: tuple[str, ...] = ()

    async def start(self, tmp: str) -> None:
        engine_args = self.settings.vllm_engine_args()
        self.url = f"http://127.0.0.1:{free_port()}"
        command = vllm_cli("serve", engine_args.pop("model"), *vllm_cli_flags(engine_args), *self.extra_flags,
                           "--enable-scale-out",
                           "--host", "127.0.0.1", "--port", self.url.rsplit(":", 1)[1],
                           "--disable-uvicorn-access-log", "--uvicorn-log-level", "warning")
        self.process = spawn(command, os.path.join(tmp, "vllm-serve.log"), env=vllm_env())

    async def ready(self) -> None:
        import aiohttp

        self.session = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0),
                                             timeout=aiohttp.ClientTimeout(total=600))
        deadline = time.monotonic() + START_TIMEOUT_S
        while time.monotonic() < deadline:
            self.check_alive()
            try:
                async with self.session.get(f"{self.url}/health") as response:
                    if response.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.5)
        raise RuntimeError(f"{self.name}: vllm serve did not start in time")

    async def stream(self, prompt: list[int], new_tokens: int, model: str | None = None) -> AsyncIterator[list[int]]:
        """`model`: a LoRA adapter `vllm serve --lora-modules` named (None: the base model)."""
        body = {"token_ids": prompt, "stream": True, "sampling_params": {
            "max_tokens": new_tokens, "temperature": 0, "ignore_eos": True, "detokenize": False}}
        if model is not None:
            body["model"] = model
        async with self.session.post(f"{self.url}/inference/v1/generate", json=body) as response:
            if response.status != 200:
                raise RuntimeError(f"{self.name}: HTTP {response.status}: {await response.text()}")
            async for line in response.content:
                if not line.startswith(b"data: ") or line.startswith(b"data: [DONE]"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(f"{self.name}: {chunk['error']}")
                for choice in chunk["choices"]:
                    yield choice.get("token_ids") or []

    async def run(self, prompts, new_tokens, concurrency):
        return await measure(self.stream, prompts, new_tokens, concurrency)

    async def stop(self) -> None:
        if getattr(self, "session", None) is not None:
            await self.session.close()
        await super().stop()


# ------------------------------------------------------------------------------ the AsyncLLM helper

def asyncllm_worker() -> None:
    """`--vllm-asyncllm-worker`: AsyncLLM in this process. stdin: the engine arguments (one JSON
    line), then one request per line; stdout: {"ready": true}, then one `measure` result per line."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # vLLM logs to stdout: keep the reply channel for replies
    asyncio.run(serve_asyncllm(replies))


async def serve_asyncllm(replies) -> None:
    from vllm.engine.arg_utils import AsyncEngineArgs
    from vllm.inputs.engine import tokens_input
    from vllm.sampling_params import RequestOutputKind, SamplingParams
    from vllm.v1.engine.async_llm import AsyncLLM

    engine_args = json.loads(await asyncio.to_thread(sys.stdin.readline))
    llm = AsyncLLM.from_engine_args(AsyncEngineArgs(**engine_args))

    async def stream(prompt: list[int], new_tokens: int) -> AsyncIterator[list[int]]:
        params = SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True, detokenize=False,
                                output_kind=RequestOutputKind.DELTA)
        async for output in llm.generate(tokens_input(prompt), params, uuid.uuid4().hex):
            yield list(output.outputs[0].token_ids)

    try:
        replies.write(json.dumps({"ready": True}) + "\n")
        while line := await asyncio.to_thread(sys.stdin.readline):
            request = json.loads(line)
            if "stall" in request:
                result = await measure_stall(stream, **request["stall"])
            else:
                result = await measure(stream, request["prompts"], request["new_tokens"], request["concurrency"])
            replies.write(json.dumps(result) + "\n")
    finally:
        llm.shutdown()
        llm = None  # dropped now, not at interpreter exit when vLLM's modules are gone


# ------------------------------------------------------------------------------ paired rounds

def concurrency_workloads(prompts, args) -> list[dict]:
    """One workload per --concurrency value, keyed by it: every prompt, --new-tokens each."""
    return [{"key": c, "prompts": prompts, "new_tokens": args.new_tokens, "concurrency": c}
            for c in sorted(args.concurrency)]


async def run_workload(setup: Setup, workload: dict) -> dict:
    if "stall" in workload:
        return await setup.stall(workload["stall"])
    return await setup.run(workload["prompts"], workload["new_tokens"], workload["concurrency"])


async def paired_rounds(setups: list[Setup], workloads: list[dict], repeats: int, pause: float,
                        after_top: Callable[[], dict] | None) -> list[dict]:
    """`repeats` rounds of {workload key: {setup name: result}}; each workload runs every setup
    back to back (order rotating by round), then `after_top()` (stored as HF) after the last one."""
    rounds = []
    for index in range(repeats):
        order = setups[index % len(setups):] + setups[:index % len(setups)]
        results: dict = {}
        for workload in workloads:
            per_setup = results.setdefault(workload["key"], {})
            for setup in order:
                await asyncio.sleep(pause)
                per_setup[setup.name] = await run_workload(setup, workload)
            if after_top is not None and workload is workloads[-1]:
                per_setup[HF] = after_top()
        rounds.append(results)
    return rounds


async def bench(setups: list[Setup], prompts, args, pause: float,
                after_top: Callable[[], dict] | None = None,
                only: list[Setup] | None = None, workloads: list[dict] | None = None) -> list[dict]:
    """Start every setup (all at once), warm each up, run the paired rounds (over `only` when
    given: setups that share another's server), stop them all. The client keeps off the engine
    core's CPUs, except beside the HF baselines (`after_top`), which run in this process."""
    with tempfile.TemporaryDirectory() as tmp:
        try:
            for setup in setups:
                await setup.start(tmp)
            if after_top is None:
                keep_client_off_the_core(setups[0].settings)
            for setup in setups:
                await setup.ready()
            measured = only or setups
            for setup in measured:
                await setup.run(prompts[:8], 8, 8)  # warm up
            rounds = await paired_rounds(measured, workloads or concurrency_workloads(prompts, args), args.repeats,
                                         pause, after_top)
            await asyncio.sleep(pause)
            for setup in setups:
                await setup.check_idle()
            return rounds
        except BaseException:
            for setup in setups:
                print(f"--- {setup.name} log:\n{log_tail(setup.process)}", file=sys.stderr)
            raise
        finally:
            for setup in setups:
                await setup.stop()


# ------------------------------------------------------------------------------ HF baselines

def hf_one_at_a_time(model, prompts, new_tokens: int, device, repeats: int) -> float:
    model.generate(torch.tensor([prompts[0]], device=device), do_sample=False, max_new_tokens=4)  # warm up
    best = 0.0
    for _ in range(repeats):
        began = time.perf_counter()
        tokens = 0
        for prompt in prompts:
            output = model.generate(torch.tensor([prompt], device=device), do_sample=False,
                                    max_new_tokens=new_tokens, min_new_tokens=new_tokens)
            tokens += output.shape[1] - len(prompt)
        best = max(best, tokens / (time.perf_counter() - began))
    return best


def hf_static_batch(model, prompts, new_tokens: int, pad_id: int, device, repeats: int) -> float:
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=device)
    model.generate(ids[:4], attention_mask=mask[:4], do_sample=False, max_new_tokens=4, pad_token_id=pad_id)
    best = 0.0
    for _ in range(repeats):
        began = time.perf_counter()
        output = model.generate(ids, attention_mask=mask, do_sample=False, max_new_tokens=new_tokens,
                                min_new_tokens=new_tokens, pad_token_id=pad_id)
        tokens = (output.shape[1] - width) * len(prompts)
        best = max(best, tokens / (time.perf_counter() - began))
    return best


def best_over_threads(measure_rate) -> tuple[float, int]:
    """Run `measure_rate()` with 1 torch thread and with the default; return the best rate and its threads."""
    default = torch.get_num_threads()
    results = []
    for threads in sorted({1, default}):
        torch.set_num_threads(threads)
        results.append((measure_rate(), threads))
    torch.set_num_threads(default)
    return max(results)


def hf_baselines(args, model_dir, tokenizer, prompts) -> Callable[[], dict]:
    """A callable measuring the two HF baselines (best over torch thread counts) once."""
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device if args.device != "auto" else ("cuda" if torch.cuda.is_available() else "cpu"))
    model = AutoModelForCausalLM.from_pretrained(model_dir).to(device).eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    single_prompts = prompts[:args.hf_single_prompts]

    def baselines() -> dict:
        with torch.inference_mode():
            return {
                "single": best_over_threads(
                    lambda: hf_one_at_a_time(model, single_prompts, args.new_tokens, device, 1)),
                "static": best_over_threads(lambda: hf_static_batch(model, prompts, args.new_tokens, pad_id,
                                                                    device, 1)),
            }

    return baselines


# ------------------------------------------------------------------------------ report

def print_header() -> None:
    print(f"{'setup (best round)':<44}{'tok/s':>10}{'TTFT p50/p90/p99 ms':>26}{'TPOT p50/p90/p99 ms':>26}")


def print_row(label: str, result: dict) -> None:
    ttft = "/".join(f"{percentile(result['ttft'], q):.1f}" for q in (0.5, 0.9, 0.99))
    tpot = "/".join(f"{percentile(result['tpot'], q):.2f}" for q in (0.5, 0.9, 0.99))
    rate = f"{result['tok_s']:.0f}" if result["tok_s"] >= 100 else f"{result['tok_s']:.1f}"
    print(f"{label:<44}{rate:>10}{ttft:>26}{tpot:>26}")


def print_setups(rounds, names: list[str]) -> None:
    for name in names:
        for concurrency in rounds[0]:
            best = max((r[concurrency][name] for r in rounds), key=lambda result: result["tok_s"])
            print_row(f"{name}, concurrency {concurrency}", best)


def paired(rounds, concurrency: int, numerator: str, denominator: str, key: str = "tok_s") -> list[float]:
    return [r[concurrency][numerator][key] / r[concurrency][denominator][key] for r in rounds]


def print_ratio(label: str, ratios: list[float], target: tuple[str, float] | None) -> None:
    text = f"  {label:<56} {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}]"
    if target is not None:
        op, bound = target
        met = statistics.median(ratios) >= bound if op == ">=" else statistics.median(ratios) > bound
        text += f"  (target {op} {bound:.2f}: {'met' if met else 'MISSED'})"
    print(text)


def print_vllm_ratios(rounds, concurrencies: list[int]) -> None:
    top = max(concurrencies)
    print(f"paired rounds, tok/s ratio median [min-max] of {len(rounds)}:")
    for concurrency in concurrencies:
        print_ratio(f"tito vllm backend / vLLM AsyncLLM, concurrency {concurrency}",
                    paired(rounds, concurrency, TITO_VLLM, ASYNCLLM), (">=", 0.90) if concurrency == top else None)
    for concurrency in concurrencies:
        print_ratio(f"tito vllm backend / vLLM HTTP token-in, concurrency {concurrency}",
                    paired(rounds, concurrency, TITO_VLLM, VLLM_HTTP), (">", 1.0))
    for concurrency in concurrencies:
        print_ratio(f"tito native / tito vllm backend, concurrency {concurrency}",
                    paired(rounds, concurrency, TITO_NATIVE, TITO_VLLM), None)
    # The native engine against vLLM itself: at least even at the top concurrency, and well ahead
    # (>= 1.3) at concurrency 1.
    for concurrency in concurrencies:
        bound = 1.3 if concurrency == 1 else 1.0
        print_ratio(f"tito native / vLLM AsyncLLM, concurrency {concurrency}",
                    paired(rounds, concurrency, TITO_NATIVE, ASYNCLLM), (">=", bound))
        print_ratio(f"tito native / vLLM HTTP token-in, concurrency {concurrency}",
                    paired(rounds, concurrency, TITO_NATIVE, VLLM_HTTP), (">=", bound))


def agreement(results: dict[str, dict], names: list[str]) -> str:
    """Whether the setups produced the same greedy tokens for every prompt; if not, who differs."""
    groups: dict[str, list[str]] = {}
    for name in names:
        groups.setdefault(json.dumps(results[name]["outputs"]), []).append(name)
    if len(groups) == 1:
        return f"all {len(names)} setups agree on every prompt"
    reference = json.loads(next(iter(groups)))
    parts = []
    for key, members in groups.items():
        outputs = json.loads(key)
        differ = [i for i, (a, b) in enumerate(zip(outputs, reference)) if a != b]
        parts.append(" = ".join(members) + (f" (differ from the first group on {len(differ)} of {len(outputs)} "
                                            f"prompts, e.g. prompt {differ[0]})" if differ else ""))
    return "DIFFER: " + " | ".join(parts)


def print_agreement(first_round: dict[int, dict[str, dict]], names: list[str]) -> None:
    for key, results in first_round.items():
        label = key if isinstance(key, str) else f"concurrency {key}"
        print(f"greedy tokens, round 1, {label}: {agreement(results, names)}")


def print_default_report(rounds, batch: int) -> None:
    """`batch`: the prompts HF's static batch holds (all of them)."""
    top = max(rounds[0])
    every = [r[top][HF] for r in rounds]
    single, single_threads = max(b["single"] for b in every)
    static, static_threads = max(b["static"] for b in every)
    print()
    print_header()
    print(f"{f'HF generate, one at a time ({single_threads} thr)':<44}{single:>10.0f}")
    print(f"{f'HF generate, static batch of {batch} ({static_threads} thr)':<44}{static:>10.0f}")
    for concurrency in rounds[0]:
        best = max((r[concurrency][TITO_NATIVE] for r in rounds), key=lambda result: result["tok_s"])
        print_row(f"tito engine over gRPC, concurrency {concurrency}", best)
    vs_static = [r[top][TITO_NATIVE]["tok_s"] / r[top][HF]["static"][0] for r in rounds]
    vs_single = [r[top][TITO_NATIVE]["tok_s"] / r[top][HF]["single"][0] for r in rounds]
    print()
    print(f"at concurrency {top}, paired rounds (median [min-max] of {len(vs_static)}):")
    print(f"  vs HF static batch:   {statistics.median(vs_static):.2f}x [{min(vs_static):.2f}-{max(vs_static):.2f}]"
          f"  (target >= 0.8)")
    print(f"  vs HF one at a time:  {statistics.median(vs_single):.1f}x [{min(vs_single):.1f}-{max(vs_single):.1f}]"
          f"  (target >= 8)")


def print_constrained_report(rounds, names: list[str]) -> None:
    print()
    print_header()
    print_setups(rounds, names)
    print()
    print(f"paired rounds, tok/s ratio to {UNCONSTRAINED} on the same engine, median [min-max] of {len(rounds)}:")
    for concurrency in rounds[0]:
        for name in names[1:]:
            target = (">=", 0.75) if name == names[-1] and concurrency == max(rounds[0]) else None
            print_ratio(f"{name} / {UNCONSTRAINED}, concurrency {concurrency}",
                        paired(rounds, concurrency, name, UNCONSTRAINED), target)
    print(f"paired rounds, tokens per engine CPU second (server + core process), ratio to {UNCONSTRAINED}:")
    for concurrency in rounds[0]:
        for name in names[1:]:
            target = (">=", 0.75) if name == names[-1] and concurrency == max(rounds[0]) else None
            print_ratio(f"{name} / {UNCONSTRAINED}, concurrency {concurrency}",
                        paired(rounds, concurrency, name, UNCONSTRAINED, "tokens_per_cpu_s"), target)


def print_pipeline_report(rounds, concurrencies: list[int]) -> None:
    print()
    print_header()
    print_setups(rounds, [ENGINE_ALONE, PIPELINE])
    print()
    print(f"paired rounds, tok/s ratio median [min-max] of {len(rounds)}:")
    for concurrency in concurrencies:
        print_ratio(f"pipeline / engine alone, concurrency {concurrency}",
                    paired(rounds, concurrency, PIPELINE, ENGINE_ALONE),
                    (">=", 0.90) if concurrency == max(concurrencies) else None)


def print_vllm_report(rounds, concurrencies: list[int], names: list[str]) -> None:
    """`names`: the setups measured (all four, or tito native alone with --smoke)."""
    print()
    print_header()
    print_setups(rounds, names)
    if len(names) > 1:
        print()
        print_vllm_ratios(rounds, concurrencies)
    print()
    print_agreement(rounds[0], names)


# ------------------------------------------------------------------------------ --shape: a real model's size

SHAPE_KV_CACHE_BYTES = 1 << 30  # both sides; vLLM reserves most of the machine without one
SHAPE_MAX_MODEL_LEN = 4096
LONG_PROMPT_TOKENS = 1024
CHECKPOINTS = ("float32", "bfloat16")


def prompts_for(prompts: list[list[int]], concurrency: int) -> list[list[int]]:
    """The prompts a concurrency runs in --shape mode: four waves of it (at most all): at one token
    per ~0.1-0.3 s a real-size model would spend minutes on 32 prompts one at a time."""
    return prompts[:min(len(prompts), 4 * concurrency)]


def long_prompts(tokenizer, count: int, length: int) -> list[list[int]]:
    """`count` different prompts of exactly `length` tokens."""
    text = " ".join(WORDS[(j * 5 + j // 7) % len(WORDS)] for j in range(length * 2))
    ids = tokenizer(text)["input_ids"]
    return [(ids[i * 3:] + ids)[:length] for i in range(count)]


def shape_workloads(prompts, long, args, with_long: bool) -> list[dict]:
    workloads = [{"key": f"c={c}", "prompts": prompts_for(prompts, c), "new_tokens": args.new_tokens,
                  "concurrency": c} for c in sorted(args.concurrency)]
    if with_long:
        for c in (1, max(args.concurrency)):
            workloads.append({"key": f"1k prompts c={c}", "prompts": prompts_for(long, c),
                              "new_tokens": args.new_tokens, "concurrency": c})
        workloads.append({"key": "decode stall", "stall": {
            "running": prompts[:8], "running_tokens": 128, "long_prompts": long[:4], "long_tokens": 4}})
    return workloads


def print_shape_report(checkpoint: str, rounds: list[dict], names: list[str], concurrencies: list[int]) -> None:
    dtype = SHAPE_DTYPES[checkpoint]
    computed = "each side's default dtype" if dtype is None else f"{dtype} on both sides"
    print(f"\n=== {checkpoint} checkpoint, {computed}; best round of {len(rounds)} ===")
    print_header()
    for key, results in rounds[0].items():
        if key == "decode stall":
            continue
        for name in names:
            best = max((r[key][name] for r in rounds), key=lambda result: result["tok_s"])
            print_row(f"{name}, {key}", best)
    top = max(concurrencies)
    if ASYNCLLM in names:
        print(f"paired rounds, median [min-max] of {len(rounds)} (tito native / {ASYNCLLM}):")
    for key in rounds[0]:
        if key == "decode stall" or ASYNCLLM not in names:
            continue
        short_bound = 1.2 if key == f"c={top}" else 1.0 if key == "c=1" or key.startswith("1k") else None
        print_ratio(f"tok/s, {key}", paired(rounds, key, TITO_NATIVE, ASYNCLLM),
                    (">=", short_bound) if short_bound else None)
        if key == f"c={top}" or key.startswith("1k"):
            for metric, label in (("ttft", "TTFT p50"), ("tpot", "TPOT p50")):
                ratios = [percentile(r[key][TITO_NATIVE][metric], 0.5) / percentile(r[key][ASYNCLLM][metric], 0.5)
                          for r in rounds]
                # "<= vLLM's": the inverse ratio at least 1.
                print_ratio(f"{label} vLLM / tito, {key}", [1 / x for x in ratios], (">=", 1.0))
        if VLLM_HTTP in rounds[0][key]:
            print_ratio(f"tok/s vs {VLLM_HTTP}, {key}", paired(rounds, key, TITO_NATIVE, VLLM_HTTP), None)
    if "decode stall" in rounds[0]:
        print("decode TPOT of 8 running requests (128 tokens each) while 4 prompts of "
              f"{LONG_PROMPT_TOKENS} tokens prefill, median of rounds:")
        for name in names:
            if name not in rounds[0]["decode stall"]:
                continue
            stalls = [r["decode stall"][name] for r in rounds]
            pick = {k: statistics.median(x[k] for x in stalls) for k in ("tpot_before", "tpot_during", "max_gap")}
            ttft = statistics.median(percentile(x["long_ttft"], 0.5) for x in stalls)
            print(f"  {name:<40} TPOT before {pick['tpot_before']:.1f} ms, "
                  f"during prefill {pick['tpot_during']:.1f} ms, "
                  f"longest gap {pick['max_gap']:.0f} ms; long prompts' TTFT p50 {ttft:.0f} ms")
    print_agreement({key: value for key, value in rounds[0].items() if key != "decode stall"}, names)


#: What each checkpoint computes in, per side (None: each side's default, auto). A float32 checkpoint
#: is compared in float32 on both: vLLM's auto casts it to bfloat16 on a CPU with bf16 instructions.
SHAPE_DTYPES = {"float32": "float32", "bfloat16": None}


def run_shape(args) -> None:
    """--shape: the issue's table, one checkpoint dtype at a time (both would not fit in memory
    beside each other on a small machine), each side at its default CPU placement (dtypes: SHAPE_DTYPES)."""
    from transformers import AutoTokenizer

    from tito_models.real_shape import ensure_shaped_model, shaped_model_name

    for checkpoint in args.checkpoints:
        name = shaped_model_name(args.shape, checkpoint)
        model_dir = resolve_model(BENCH_TEXT_MODEL) if args.smoke else ensure_shaped_model(args.shape, checkpoint)
        tokenizer = AutoTokenizer.from_pretrained(model_dir)
        prompts = make_prompts(tokenizer, args.prompts)
        long = long_prompts(tokenizer, args.prompts, LONG_PROMPT_TOKENS)
        lengths = [len(p) for p in prompts]
        print(f"\n{name}: {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens, {args.new_tokens} new "
              f"tokens, greedy, prefix caching {'on' if args.prefix_caching else 'off'}, "
              f"{SHAPE_KV_CACHE_BYTES >> 20} MiB KV cache on every side", flush=True)
        settings = Settings(str(model_dir) if args.smoke else name, str(model_dir), args.device, args.prefix_caching,
                            max_running=max(VLLM_MAX_NUM_SEQS, *args.concurrency),
                            max_model_len=model_max_len(model_dir) if args.smoke else SHAPE_MAX_MODEL_LEN,
                            kv_cache_bytes=KV_CACHE_BYTES if args.smoke else SHAPE_KV_CACHE_BYTES,
                            dtype=SHAPE_DTYPES[checkpoint], engine_process=not args.smoke)
        setups = [TitoEngine(settings, "native")]
        if not args.smoke:
            setups.append(AsyncLLMWorker(settings))
        if not args.smoke and not args.no_vllm_serve:
            setups.append(VllmHttp(settings))
        with_long = checkpoint == args.checkpoints[-1] and not args.no_long_prompts
        rounds = asyncio.run(bench(setups, prompts, args, pause=VLLM_IDLE_S,
                                   workloads=shape_workloads(prompts, long, args, with_long)))
        print_shape_report(checkpoint, rounds, [setup.name for setup in setups], args.concurrency)


# ------------------------------------------------------------------------------ main

def running_sequences(concurrency: list[int]) -> int:
    """The engine's --max-running-sequences for these concurrencies: the top one, but at least
    the engine's default largest n per request, which may not exceed it."""
    default_n = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "max_choices_per_request")
    return max(default_n, *concurrency)


def model_max_len(model_dir: Path) -> int:
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(model_dir).get_text_config().max_position_embeddings


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None,
                        help="default: tiny-qwen2, or tiny-qwen2-h256 (hidden 256, 4 layers, head_dim 64) with --vllm "
                             "or --pipeline")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--repeats", type=int, default=5, help="paired rounds per concurrency")
    parser.add_argument("--prefix-caching", action="store_true",
                        help="leave the engines' prefix cache on (rounds after the first then reuse the prompts)")
    parser.add_argument("--hf-single-prompts", type=int, default=8,
                        help="prompts for the one-at-a-time HF baseline (a subset; its rate is per token)")
    parser.add_argument("--vllm", action="store_true",
                        help="compare tito (native and vllm backend) with vLLM's AsyncLLM and HTTP token-in "
                             "instead of HF generate")
    parser.add_argument("--constrained", action="store_true",
                        help="the native engine with no, half and every row under a JSON schema constraint "
                             "(structured outputs): tok/s ratios to unconstrained decoding")
    parser.add_argument("--pipeline", action="store_true",
                        help="the same chats through render -> engine -> derender and through the engine "
                             "alone: tok/s ratio pipeline / engine")
    parser.add_argument("--shape", default=None,
                        help="a real model's shape with random weights (tito_models.real_shape, e.g. qwen2.5-0.5b): "
                             "tito native against vLLM AsyncLLM and vllm serve, per checkpoint dtype, each side's "
                             "default dtype and CPU placement, plus 1k-token prompts and the decode stall")
    parser.add_argument("--checkpoints", nargs="+", choices=CHECKPOINTS, default=list(CHECKPOINTS),
                        help="--shape: the checkpoint dtypes measured (the last also runs the long prompts)")
    parser.add_argument("--no-vllm-serve", action="store_true", help="--shape: leave vllm serve out")
    parser.add_argument("--no-long-prompts", action="store_true", help="--shape: leave the 1k-token rows out")
    parser.add_argument("--prompts", type=int, default=NUM_PROMPTS, help="how many prompts each workload sends")
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run of the mode, tito's side alone: checks that it runs (see above)")
    parser.add_argument("--vllm-asyncllm-worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.smoke:
        args.prompts, args.new_tokens, args.concurrency, args.repeats = 4, 4, [2], 1
        args.hf_single_prompts, args.checkpoints = 1, args.checkpoints[-1:]
    if args.vllm_asyncllm_worker:
        asyncllm_worker()
        return
    if args.shape:
        if args.repeats == parser.get_default("repeats") and not args.smoke:
            args.repeats = 2  # a round of the whole table takes ~10 minutes on 2 cores
        run_shape(args)
        return
    args.model = args.model or (BENCH_TEXT_MODEL if args.vllm or args.pipeline else "tiny-qwen2")

    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()
    model_dir = resolve_model(args.model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = make_prompts(tokenizer, args.prompts)
    lengths = [len(p) for p in prompts]
    print(f"model {args.model} on {args.device}; {len(prompts)} prompts of {min(lengths)}-{max(lengths)} tokens "
          f"(mean {statistics.mean(lengths):.0f}), {args.new_tokens} new tokens each, greedy, ignore_eos; "
          f"{'every setup' if args.vllm else 'engine'} prefix cache {'on' if args.prefix_caching else 'off'}",
          flush=True)

    if args.pipeline:
        settings = Settings(args.model, str(model_dir), args.device, args.prefix_caching,
                            max_running=running_sequences(args.concurrency), engine_process=not args.smoke)
        servers = ServeAll(settings, [tokenizer.decode(prompt) for prompt in prompts])
        measured = [EngineOnRendered(servers), WholePipeline(servers)]
        rounds = asyncio.run(bench([servers, *measured], list(range(len(prompts))), args, pause=0.0, only=measured))
        print_pipeline_report(rounds, args.concurrency)
    elif args.constrained:
        settings = Settings(args.model, str(model_dir), args.device, args.prefix_caching,
                            max_running=running_sequences(args.concurrency), engine_process=not args.smoke)
        base = TitoEngine(settings)
        setups = [ConstrainedShare(base, 0, UNCONSTRAINED), ConstrainedShare(base, 2, "half the rows constrained"),
                  ConstrainedShare(base, 1, "every row constrained")]
        rounds = asyncio.run(bench([base, *setups], prompts, args, pause=0.0, only=setups))
        print_constrained_report(rounds, [setup.name for setup in setups])
    elif args.vllm:
        # One value for every setting the four setups share (the default run keeps tito's defaults).
        settings = Settings(args.model, str(model_dir), args.device, args.prefix_caching,
                            max_running=max(VLLM_MAX_NUM_SEQS, *args.concurrency),
                            max_model_len=model_max_len(model_dir), kv_cache_bytes=KV_CACHE_BYTES,
                            engine_process=not args.smoke)
        setups = [TitoEngine(settings, "native")]
        if not args.smoke:
            setups += [TitoEngine(settings, "vllm"), AsyncLLMWorker(settings), VllmHttp(settings)]
        rounds = asyncio.run(bench(setups, prompts, args, pause=0.0 if args.smoke else VLLM_IDLE_S))
        print_vllm_report(rounds, args.concurrency, [setup.name for setup in setups])
    else:
        # Prefix caching off by default: every round sends the same prompts, and HF recomputes them.
        settings = Settings(args.model, str(model_dir), args.device, args.prefix_caching,
                            max_running=running_sequences(args.concurrency), engine_process=not args.smoke)
        baselines = hf_baselines(args, model_dir, tokenizer, prompts)
        rounds = asyncio.run(bench([TitoEngine(settings)], prompts, args, pause=0.0, after_top=baselines))
        print_default_report(rounds, len(prompts))


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    main()
