"""What serving LoRA adapters costs the native engine: four adapters evenly mixed in every batch
against the base model alone, on the same prompts, in paired rounds.

    .venv/bin/python bench/lora.py [--concurrency 32] [--rounds 3] [--rank 16]
    .venv/bin/python bench/lora.py --smoke   # seconds: checks that it runs

Starts one engine (`tito serve engine`, tiny-qwen2-h256, float32, its own default CPU placement,
prefix caching off so neither workload reuses the other's prompts) with four random PEFT-format
adapters of rank `--rank` on every projection (q/k/v/o/gate/up/down), loaded at start
(`--lora-modules`), `--max-loras 4`. Each round sends the 32 prompts of bench/engine.py (greedy,
ignore_eos, 64 new tokens) at `--concurrency` twice, in alternating order: every request on the
base model, and request i on adapter i mod 4 (so every step mixes the four adapters and, while
prompts prefill, several adapters' prefill chunks). Prints both rows and the ratio mixed / base
(median and range over the rounds; the issue's goal: >= 0.8).
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

from engine import make_prompts, measure, percentile
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


async def rounds(address: str, prompts, args) -> dict[str, list[dict]]:
    workloads = {"base model only": [""], f"{ADAPTERS} adapters mixed": [f"a{i}" for i in range(ADAPTERS)]}
    results: dict[str, list[dict]] = {name: [] for name in workloads}
    async with grpc.aio.insecure_channel(address) as channel:
        stub = engine_pb2_grpc.EngineServiceStub(channel)
        await measure(adapter_stream(stub, [""]), prompts[:2], 2, 2)  # warm the connection and the engine
        for number in range(args.rounds):
            order = list(workloads) if number % 2 == 0 else list(reversed(workloads))
            for name in order:
                results[name].append(await measure(adapter_stream(stub, workloads[name]), prompts, args.new_tokens,
                                                   args.concurrency))
    return results


def report(results: dict[str, list[dict]], args) -> None:
    print(f"\nconcurrency {args.concurrency}, {args.new_tokens} new tokens x {args.prompts} prompts, "
          f"{ADAPTERS} adapters of rank {args.rank}, {args.rounds} paired rounds")
    print(f"{'workload':28} {'tok/s (median)':>15} {'TTFT p50 ms':>12} {'TPOT p50 ms':>12}")
    for name, runs in results.items():
        print(f"{name:28} {statistics.median(r['tok_s'] for r in runs):15.1f} "
              f"{statistics.median(percentile(r['ttft'], 0.5) for r in runs):12.1f} "
              f"{statistics.median(percentile(r['tpot'], 0.5) for r in runs):12.2f}")
    base, mixed = results.values()
    ratios = [m["tok_s"] / b["tok_s"] for m, b in zip(mixed, base)]
    print(f"mixed adapters / base model: {statistics.median(ratios):.2f}x [{min(ratios):.2f}-{max(ratios):.2f}] "
          f"(goal >= 0.8)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--smoke", action="store_true", help="a few prompts, one round: checks that it runs")
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
        engine = spawn([sys.executable, "-m", "tito_cli", "serve", "engine", "--model", str(model_dir), "--address",
                        address, "--no-prefix-caching", "--lora-dir", str(root), "--max-loras", str(ADAPTERS),
                        "--max-lora-rank", str(args.rank), "--lora-modules",
                        *(f"a{index}=a{index}" for index in range(ADAPTERS)), "--log-level", "warning"],
                       Path(work) / "engine.log")
        try:
            wait_until_serving(address, timeout=600)
            results = asyncio.run(rounds(address, prompts, args))
        finally:
            stop_process(engine)
    report(results, args)


if __name__ == "__main__":
    main()
