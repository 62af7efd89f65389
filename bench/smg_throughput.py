"""bench/smg.py --throughput: SMG in front of a tito engine against tito's own gateway over the same
engine (and, with --vllm, SMG in front of `vllm serve --grpc`), driven by `vllm bench serve`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from gateway import (KV_CACHE_BYTES, MAX_RUNNING, VLLM_IDLE_S, bench_serve, free_port, gateway_chats, num_prompts,
                     print_best_rounds, random_chats, ratio_line, smoke_chats, wait_healthy)
from processes import spawn, stop_process, vllm_cli, wait_vllm_engine_healthy

SMG_TITO, SMG_VLLM, TITO = "smg -> tito engine", "smg -> vllm serve --grpc", "tito gateway -> 3 services"
VLLM_START_S = 600
#: --shape: KV cache bytes on both sides (c=32 x 192 tokens of Qwen2.5-0.5B in float32 need ~150 MiB)
#: and the context both serve (vLLM refuses a max_model_len its KV cache cannot hold).
SHAPE_KV_CACHE_BYTES = 512 << 20
SHAPE_MAX_MODEL_LEN = 4096


@dataclass(frozen=True)
class Sizes:
    """What both sides are given: their KV cache and, for a real shape, the context they serve."""

    kv_cache_bytes: int = KV_CACHE_BYTES
    max_model_len: int | None = None  # None: the model's own


def model_and_sizes(args) -> tuple[str, Sizes]:
    """The checkpoint measured: --shape's real shape in float32 (the tiny model under --smoke, so the
    smoke run stays seconds), else --model."""
    from tito_models.paths import resolve_model
    from tito_models.real_shape import shaped_model_name

    if args.shape and not args.smoke:
        return (str(resolve_model(shaped_model_name(args.shape, "float32"))),
                Sizes(SHAPE_KV_CACHE_BYTES, SHAPE_MAX_MODEL_LEN))
    return str(resolve_model(args.model)), Sizes()


def start_tito(model: str, tmp: Path, sizes: Sizes) -> tuple[subprocess.Popen, str, str]:
    """`tito serve all` with its engine on TCP (SMG dials it there) and its gateway: the process,
    the engine's host:port and the gateway's URL. Settings as bench/gateway.py's."""
    engine = f"127.0.0.1:{free_port()}"
    gateway = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "TITO_DTYPE": "float32", "TITO_PREFIX_CACHING": "false",
           "TITO_KV_CACHE_BYTES": str(sizes.kv_cache_bytes), "TITO_MAX_RUNNING_SEQUENCES": str(MAX_RUNNING)}
    if sizes.max_model_len is not None:
        env["TITO_MAX_MODEL_LEN"] = str(sizes.max_model_len)
    process = spawn([sys.executable, "-m", "tito_cli", "serve", "all", "--model", model, "--log-level", "warning",
                     "--render-address", f"unix:{tmp / 'render.sock'}", "--engine-address", engine,
                     "--derender-address", f"unix:{tmp / 'derender.sock'}", "--gateway-address", gateway],
                    tmp / "tito.log", env=env)
    return process, engine, f"http://{gateway}"


def start_vllm_grpc(model: str, tmp: Path, sizes: Sizes):
    """`vllm serve --grpc` (SMG's servicer over vLLM), settings as bench/gateway.py's vllm serve."""
    port = free_port()
    context = ["--max-model-len", str(sizes.max_model_len)] if sizes.max_model_len is not None else []
    process = spawn(vllm_cli("serve", model, "--grpc", "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--no-enable-prefix-caching", "--enforce-eager",
                             "--max-num-seqs", str(MAX_RUNNING), "--kv-cache-memory-bytes",
                             str(sizes.kv_cache_bytes), "--generation-config", "vllm", *context),
                    tmp / "vllm.log", env={**os.environ, "VLLM_LOGGING_LEVEL": "WARNING"})
    return process, f"127.0.0.1:{port}"


def start_smg_over(address: str, model: str, tmp: Path, name: str):
    port = free_port()
    smg = str(Path(sys.executable).parent / "smg")
    process = spawn([smg, "launch", "--backend", "vllm", "--worker-urls", f"grpc://{address}", "--host", "127.0.0.1",
                     "--port", str(port), "--prometheus-port", str(free_port()), "--policy", "round_robin",
                     "--model-path", model, "--reasoning-parser", "passthrough", "--log-level", "warn"],
                    tmp / f"{name}.log", cwd=tmp)
    return process, f"http://127.0.0.1:{port}"


def throughput(args) -> None:
    from tito_client.pipeline import wait_until_serving

    model, sizes = model_and_sizes(args)
    tmp = Path(tempfile.mkdtemp(prefix="tito-smg-bench-"))
    setups = [SMG_TITO, TITO] + ([SMG_VLLM] if args.vllm else [])
    processes, urls = [], {}
    try:
        tito, engine, urls[TITO] = start_tito(model, tmp, sizes)
        processes.append(tito)
        if args.vllm:
            vllm, vllm_address = start_vllm_grpc(model, tmp, sizes)
            processes.append(vllm)
        wait_healthy(urls[TITO], tito, TITO)
        wait_until_serving(engine, timeout=60)
        smg, urls[SMG_TITO] = start_smg_over(engine, model, tmp, "smg-tito")
        processes.append(smg)
        wait_healthy(urls[SMG_TITO], smg, SMG_TITO)
        if args.vllm:
            wait_vllm_engine_healthy(vllm_address, vllm, "vllm serve --grpc", VLLM_START_S)
            smg_vllm, urls[SMG_VLLM] = start_smg_over(vllm_address, model, tmp, "smg-vllm")
            processes.append(smg_vllm)
            wait_healthy(urls[SMG_VLLM], smg_vllm, SMG_VLLM)
        pause = VLLM_IDLE_S if args.vllm else 0.2
        chats = {c: smoke_chats(num_prompts(c, args)) if args.smoke else random_chats(model, num_prompts(c, args), args)
                 for c in args.concurrency}
        results: dict[tuple[str, int], list[dict]] = {}
        for round_index in range(args.rounds):
            for concurrency in args.concurrency:
                # Paired rounds: the order rotates from round to round.
                order = setups[round_index % len(setups):] + setups[:round_index % len(setups)]
                for name in order:
                    time.sleep(pause)
                    results.setdefault((name, concurrency), []).append(
                        asyncio.run(gateway_chats(urls[name], model, chats[concurrency], concurrency, args.output_len))
                        if args.smoke else
                        bench_serve(urls[name], model, concurrency, args, tmp,
                                    f"{round_index}-{concurrency}-{setups.index(name)}"))
                print(f"round {round_index + 1}/{args.rounds} c={concurrency}: " + ", ".join(
                    f"{name} {results[(name, concurrency)][-1]['tok/s']:.0f} tok/s" for name in setups), flush=True)
    finally:
        for process in reversed(processes):
            stop_process(process)
    print_best_rounds(results, setups, args)
    for concurrency in args.concurrency:
        ours = results[(SMG_TITO, concurrency)]
        for other in setups[1:]:
            theirs = results[(other, concurrency)]
            print(ratio_line(f"c={concurrency} {SMG_TITO} / {other}",
                             [a["tok/s"] / b["tok/s"] for a, b in zip(ours, theirs)]))
            print(ratio_line(f"c={concurrency} TTFT p50 {SMG_TITO} / {other}",
                             [a["ttft p50"] / b["ttft p50"] for a, b in zip(ours, theirs)]))
