"""A c=1 decode step against the machine's memory bandwidth: the bytes of weights the native
engine's forward reads per second, as a ratio to what this machine reads, in one run.

    .venv/bin/python bench/decode_bandwidth.py [--model tiny-qwen2-h256] [--quantization none int8]
    .venv/bin/python bench/decode_bandwidth.py --shape qwen2.5-0.5b [--checkpoint float32] [--quantization none int8]
                                               [--threads 1]
    .venv/bin/python bench/decode_bandwidth.py --smoke   # seconds: a small buffer, the tiny model, a few steps

A one-row decode step reads every weight once (each layer's projections and the output layer;
a short context's K/V is small beside them), so its speed limit is the memory's: weight bytes per
token / step time against the machine's bandwidth measured here, in the same run:
  - read: `sum()` over a buffer far larger than the caches (default 1 GiB), bytes read per second;
  - copy: `copy_()` of one such buffer into another, bytes read plus written per second;
each with one torch thread and with all of them (best of --repeats). The engine's step is the
ModelRunner's forward on one row (what the engine core runs per step at c=1, sampling aside),
with the threads the engine's CPU plan gives the model (cpu_runtime.plan_cpus), or --threads; its
ratios are against the read and the copy bandwidth at that thread count (copy, bytes read plus
written per second, is the usual figure of a machine's bandwidth; on a machine other work keeps busy, one
thread gives steadier figures: a step on two threads waits for whichever is descheduled). Weight
bytes are what the linears hold as they are read: float32 / bfloat16 as loaded, int8 values and
their scales under --quantization int8, int4 values and scales for an int4 checkpoint (--model).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
from pathlib import Path

# As the engine core runs when its threads share the CPUs (cpu_runtime.core_omp_environment): set
# before torch loads OpenMP, which reads it once. OMP_WAIT_POLICY=ACTIVE measures the spinning wait.
if not any(name in os.environ for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")):
    os.environ["OMP_WAIT_POLICY"] = "PASSIVE"

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tito_models.paths import resolve_model  # noqa: E402
from tito_models.tiny import BENCH_TEXT_MODEL  # noqa: E402
from tito_engine.model.families import linears_of  # noqa: E402
from tito_engine.model.runner import KVCacheSpec, ModelRunner  # noqa: E402
from tito_engine.scheduling.plan import RowInput  # noqa: E402

PROMPT_TOKENS = 16


def best_seconds(work, repeats: int) -> float:
    work()  # first touch: page faults and thread start-up are not bandwidth
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        work()
        best = min(best, time.perf_counter() - start)
    return best


def memory_bandwidth(buffer_bytes: int, threads: int, repeats: int) -> dict[str, float]:
    """{read, copy}: bytes per second with `threads` torch threads."""
    usual = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        source = torch.ones(buffer_bytes // 4, dtype=torch.float32)
        target = torch.empty_like(source)
        read = best_seconds(lambda: source.sum(), repeats)
        copy = best_seconds(lambda: target.copy_(source), repeats)
    finally:
        torch.set_num_threads(usual)
    return {"read": buffer_bytes / read, "copy": 2 * buffer_bytes / copy}


def weight_bytes(runner: ModelRunner) -> int:
    """Bytes of weights one token's forward reads: every linear the family runs (linears_of, plus a
    tied float output layer, which it leaves out of packing but still reads)."""
    family = runner.decoder.family
    linears = {id(linear): linear for linear in linears_of(family)}
    linears[id(family.lm_head)] = family.lm_head
    return sum(linear.weight_bytes for linear in linears.values())


def decode_step_seconds(runner: ModelRunner, steps: int) -> float:
    """Median seconds of a one-row decode step after a short prompt."""
    block = runner.cache.block_size
    table = runner.cache.allocator.allocate(-(-(PROMPT_TOKENS + steps) // block))
    prompt = [(7 * i) % 200 + 5 for i in range(PROMPT_TOKENS)]
    token = int(runner.execute([RowInput(prompt, 0, table, True)]).argmax(-1)[0])
    times = []
    for step in range(steps):
        start = time.perf_counter()
        token = int(runner.execute([RowInput([token], PROMPT_TOKENS + step, table, True)]).argmax(-1)[0])
        times.append(time.perf_counter() - start)
    runner.cache.allocator.release(table)
    return statistics.median(times[1:] if len(times) > 1 else times)


def engine_row(model_dir: Path, name: str, quantization: str, steps: int, threads: int | None) -> dict:
    runner = ModelRunner(model_dir, model_id=name, device="cpu", quantization=quantization, cpu_threads=threads,
                         kv_cache=KVCacheSpec(num_blocks=-(-(PROMPT_TOKENS + steps + 1) // 16) + 1))
    row = {"quantization": quantization, "dtype": runner.info.dtype, "threads": torch.get_num_threads(),
           "bytes": weight_bytes(runner), "step": decode_step_seconds(runner, steps)}
    del runner
    gc.collect()
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=BENCH_TEXT_MODEL)
    parser.add_argument("--shape", default=None, help="a real model's shape with random weights (e.g. qwen2.5-0.5b)")
    parser.add_argument("--checkpoint", default="float32", choices=("float32", "bfloat16"),
                        help="--shape: the checkpoint's dtype")
    parser.add_argument("--quantization", nargs="+", default=["none", "int8"])
    parser.add_argument("--threads", type=int, default=None, help="torch threads of the forward (default: the "
                                                                      "engine's CPU plan for the model)")
    parser.add_argument("--steps", type=int, default=32, help="decode steps timed per row (their median)")
    parser.add_argument("--buffer-mib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--smoke", action="store_true", help="a 64 MiB buffer, the tiny model, 3 steps")
    args = parser.parse_args()
    if args.smoke:
        args.shape, args.steps, args.buffer_mib, args.repeats = None, 3, 64, 1
    if args.shape:
        from tito_models.real_shape import ensure_shaped_model, shaped_model_name

        name, model_dir = shaped_model_name(args.shape, args.checkpoint), ensure_shaped_model(args.shape,
                                                                                               args.checkpoint)
    else:
        name, model_dir = args.model, resolve_model(args.model)
    every = torch.get_num_threads()
    bandwidth = {threads: memory_bandwidth(args.buffer_mib << 20, threads, args.repeats)
                 for threads in sorted({1, every})}
    print(f"memory ({args.buffer_mib} MiB buffer, best of {args.repeats}):")
    for threads, rates in bandwidth.items():
        print(f"  {threads} thread(s): read {rates['read'] / 1e9:6.1f} GB/s, copy {rates['copy'] / 1e9:6.1f} GB/s")
    wait = " ".join(f"{var}={os.environ[var]}" for var in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT") if var in os.environ)
    print(f"\nc=1 decode step, {name} ({args.steps} steps after a {PROMPT_TOKENS}-token prompt, median; {wait}):")
    print(f"{'quantization':>12} {'dtype':>9} {'threads':>7} {'weights MB':>10} {'step ms':>8} {'GB/s':>6} "
          f"{'/ read bw':>9} {'/ copy bw':>9}")
    for quantization in args.quantization:
        row = engine_row(model_dir, name, quantization, args.steps, args.threads)
        rate = row["bytes"] / row["step"]
        reference = bandwidth.get(row["threads"]) or memory_bandwidth(args.buffer_mib << 20, row["threads"], 1)
        print(f"{quantization:>12} {row['dtype']:>9} {row['threads']:>7} {row['bytes'] / 1e6:>10.1f} "
              f"{row['step'] * 1e3:>8.2f} {rate / 1e9:>6.1f} {rate / reference['read']:>8.2f}x "
              f"{rate / reference['copy']:>8.2f}x")


if __name__ == "__main__":
    main()
