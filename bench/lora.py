"""What serving LoRA adapters costs the native engine: four adapters evenly mixed in every batch
against the base model alone, on the same prompts, in paired rounds.

    .venv/bin/python bench/lora.py [--concurrency 32] [--rounds 3] [--rank 16] [--vllm]
    .venv/bin/python bench/lora.py --smoke   # seconds: checks that it runs

Starts one engine (`tito serve engine`, tiny-qwen2-h256, float32, its own default CPU placement,
prefix caching off so neither workload reuses the other's prompts) with four random PEFT-format
adapters of rank `--rank` on every projection (q/k/v/o/gate/up/down), loaded at start
(`--lora-modules`), `--max-loras 4`. Each round sends the 32 prompts of bench/engine.py (greedy,
ignore_eos, 64 new tokens) at `--concurrency` twice, in alternating order: every request on the
base model, and request i on adapter i mod 4 (so every step mixes the four adapters and, while
prompts prefill, several adapters' prefill chunks). Prints both rows and the ratio mixed / base
(median and range over the rounds; the issue's goal: >= 0.8).

    .venv/bin/python bench/lora.py --vllm    # also `vllm serve --enable-lora` with the same adapters

--vllm: both engines serve the model the same way (bench/engine.py's Settings: float32, prefix
caching off, 64 MiB of KV cache, max_num_seqs 64, 2048 prompt tokens per step, --enforce-eager),
and beside tito's engine `vllm serve --enable-lora --max-loras 4 --max-lora-rank RANK
--lora-modules a0=DIR ... --enable-scale-out` on a local port takes the same two workloads through
its token-in `POST /inference/v1/generate` (an adapter named by `model`). Each round measures the
four (tito base, tito mixed, vLLM base, vLLM mixed) in alternating order, each after a 1.5 s pause
(vLLM's engine busy-polls after its last step). Prints the four rows, each engine's mixed / base,
and tito mixed / vLLM mixed (the issue's goal: >= 1.2). With --smoke, tito's side alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
from pathlib import Path

import grpc
import torch
from safetensors.torch import save_file

from engine import KV_CACHE_BYTES, VLLM_IDLE_S, Settings, VllmHttp, make_prompts, measure, percentile
from processes import spawn, stop_process
from tito.v1 import engine_pb2, engine_pb2_grpc, sampling_pb2
from tito_client.pipeline import wait_until_serving
from tito_models.paths import resolve_model
from tito_models.tiny import BENCH_TEXT_MODEL

ADAPTERS = 4
TARGETS = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
           "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}


def write_adapter(directory: Path, config: dict, rank: int, seed: int) -> None:
    """A PEFT-format adapter of `rank` on every projection of the model `config` describes
    (adapter_config.json + adapter_model.safetensors), random and seeded."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv_heads * head_dim, hidden),
              "v_proj": (kv_heads * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden), "down_proj": (hidden, inter)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for module, (out_features, in_features) in shapes.items():
            key = f"base_model.model.model.layers.{layer}.{TARGETS[module]}.{module}.lora_{{}}.weight"
            tensors[key.format("A")] = torch.randn(rank, in_features, generator=generator) * 0.05
            tensors[key.format("B")] = torch.randn(out_features, rank, generator=generator) * 0.05
    directory.mkdir(parents=True)
    (directory / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "target_modules": sorted(TARGETS)}))
    save_file(tensors, str(directory / "adapter_model.safetensors"))


def adapter_stream(stub, names: list[str]):
    """A `measure` stream: prompt i of a workload goes to names[i mod len(names)] ("" = base)."""
    counter = iter(range(1 << 30))

    async def stream(prompt: list[int], new_tokens: int):
        name = names[next(counter) % len(names)]
        sampling = sampling_pb2.SamplingParams(temperature=0.0, max_tokens=new_tokens, ignore_eos=True)
        request = engine_pb2.GenerateRequest(token_ids=prompt, lora_name=name, sampling_params=sampling)
        async for response in stub.Generate(request):
            yield list(response.token_ids)

    return stream


TITO_BASE, TITO_MIXED = "tito base model only", f"tito {ADAPTERS} adapters mixed"
VLLM_BASE, VLLM_MIXED = "vLLM base model only", f"vLLM {ADAPTERS} adapters mixed"
MIXED = [f"a{i}" for i in range(ADAPTERS)]


class VllmLora(VllmHttp):
    """`vllm serve --enable-lora` with the bench's adapters (bench/engine.py's VllmHttp)."""

    name = "vllm serve --enable-lora"

    def __init__(self, settings: Settings, root: Path, rank: int):
        super().__init__(settings)
        self.extra_flags = ("--enable-lora", "--max-loras", str(ADAPTERS), "--max-lora-rank", str(rank),
                            "--lora-modules", *(f"{name}={root / name}" for name in MIXED))

    def adapter_stream(self, names: list[str]):
        """A `measure` stream: prompt i of a workload goes to names[i mod len(names)] ("" = base)."""
        counter = iter(range(1 << 30))

        def stream(prompt: list[int], new_tokens: int):
            name = names[next(counter) % len(names)]
            return self.stream(prompt, new_tokens, model=name or None)

        return stream


async def rounds(address: str, prompts, args, vllm: VllmLora | None) -> dict[str, list[dict]]:
    results: dict[str, list[dict]] = {}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        workloads = {TITO_BASE: adapter_stream(stub, [""]), TITO_MIXED: adapter_stream(stub, MIXED)}
        if vllm is not None:
            await vllm.ready()
            workloads |= {VLLM_BASE: vllm.adapter_stream([""]), VLLM_MIXED: vllm.adapter_stream(MIXED)}
        for stream in workloads.values():  # warm the connections and the engines
            await measure(stream, prompts[:2], 2, 2)
        for number in range(args.rounds):
            order = list(workloads) if number % 2 == 0 else list(reversed(workloads))
            for name in order:
                if vllm is not None:
                    await asyncio.sleep(VLLM_IDLE_S)
                results.setdefault(name, []).append(await measure(workloads[name], prompts, args.new_tokens,
                                                                  args.concurrency))
    return {name: results[name] for name in workloads}


def report(results: dict[str, list[dict]], args) -> None:
    print(f"\nconcurrency {args.concurrency}, {args.new_tokens} new tokens x {args.prompts} prompts, "
          f"{ADAPTERS} adapters of rank {args.rank}, {args.rounds} paired rounds")
    print(f"{'workload':32} {'tok/s (median)':>15} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12}")
    for name, runs in results.items():
        print(f"{name:32} {statistics.median(r['tok_s'] for r in runs):15.1f} "
              f"{statistics.median(percentile(r['ttft'], 0.5) for r in runs):12.1f} "
              f"{statistics.median(percentile(r['tpot'], 0.5) for r in runs):12.2f}")
    print_ratio("tito mixed adapters / base model", results[TITO_MIXED], results[TITO_BASE], "goal >= 0.8")
    if VLLM_MIXED in results:
        print_ratio("vLLM mixed adapters / base model", results[VLLM_MIXED], results[VLLM_BASE], "vLLM's own cost")
        print_ratio("tito mixed / vLLM mixed", results[TITO_MIXED], results[VLLM_MIXED], "goal >= 1.2")


def print_ratio(what: str, numerator: list[dict], denominator: list[dict], goal: str) -> None:
    """The round-by-round ratio of two workloads' tok/s: median [range]."""
    ratios = [n["tok_s"] / d["tok_s"] for n, d in zip(numerator, denominator)]
    print(f"{what}: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] ({goal})")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--vllm", action="store_true", help="also `vllm serve --enable-lora` with the same adapters")
    parser.add_argument("--smoke", action="store_true", help="a few prompts, one round: checks that it runs "
                                                             "(tito's side alone)")
    args = parser.parse_args()
    if args.smoke:
        args.concurrency, args.rounds, args.new_tokens, args.prompts = 4, 1, 4, 4
    model_dir = resolve_model(BENCH_TEXT_MODEL)
    config = json.loads((model_dir / "config.json").read_text())
    from transformers import AutoTokenizer

    prompts = make_prompts(AutoTokenizer.from_pretrained(model_dir), args.prompts)
    with tempfile.TemporaryDirectory(prefix="tito-bench-lora-") as work:
        root = Path(work) / "adapters"
        for index in range(ADAPTERS):
            write_adapter(root / f"a{index}", config, args.rank, seed=index)
        address = f"unix:{work}/engine.sock"
        settings = Settings(str(model_dir), str(model_dir), "cpu", prefix_caching=False, max_running=64,
                            kv_cache_bytes=KV_CACHE_BYTES)
        engine = spawn([sys.executable, "-m", "tito_cli", "serve", "engine", *settings.tito_flags("native"),
                        "--address", address, "--lora-dir", str(root), "--max-loras", str(ADAPTERS),
                        "--max-lora-rank", str(args.rank), "--lora-modules", *(f"{name}={name}" for name in MIXED),
                        "--log-level", "warning"], Path(work) / "engine.log")
        vllm = VllmLora(settings, root, args.rank) if args.vllm and not args.smoke else None
        try:
            results = asyncio.run(serve_and_measure(address, work, prompts, args, vllm))
        finally:
            stop_process(engine)
    report(results, args)


async def serve_and_measure(address: str, work: str, prompts, args, vllm: VllmLora | None) -> dict[str, list[dict]]:
    """Start vLLM (when asked) beside tito's engine at `address`, wait for both, measure, stop vLLM."""
    try:
        if vllm is not None:
            await vllm.start(work)
        await asyncio.to_thread(wait_until_serving, address, timeout=600)
        return await rounds(address, prompts, args, vllm)
    finally:
        if vllm is not None:
            await vllm.stop()


if __name__ == "__main__":
    main()
