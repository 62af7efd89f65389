"""bench/smg.py --throughput: SMG in front of a tito engine against tito's own gateway over the same
engine (and, with --vllm, SMG in front of `vllm serve --grpc`), driven by `vllm bench serve`."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gateway import (KV_CACHE_BYTES, MAX_RUNNING, VLLM_IDLE_S, bench_serve, free_port, gateway_chats, num_prompts,
                     print_best_rounds, random_chats, ratio_line, smoke_chats, wait_healthy)
from processes import spawn, stop_process, vllm_cli, wait_vllm_engine_healthy

SMG_TITO, SMG_VLLM, TITO = "smg -> tito engine", "smg -> vllm serve --grpc", "tito gateway -> 3 services"
VLLM_START_S = 600


def start_tito(model: str, tmp: Path) -> tuple[subprocess.Popen, str, str]:
    """`tito serve all` with its engine on TCP (SMG dials it there) and its gateway: the process,
    the engine's host:port and the gateway's URL. Settings as bench/gateway.py's."""
    engine = f"127.0.0.1:{free_port()}"
    gateway = f"127.0.0.1:{free_port()}"
    env = {**os.environ, "TITO_DTYPE": "float32", "TITO_PREFIX_CACHING": "false",
           "TITO_KV_CACHE_BYTES": str(KV_CACHE_BYTES), "TITO_MAX_RUNNING_SEQUENCES": str(MAX_RUNNING)}
    process = spawn([sys.executable, "-m", "tito_cli", "serve", "all", "--model", model, "--log-level", "warning",
                     "--render-address", f"unix:{tmp / 'render.sock'}", "--engine-address", engine,
                     "--derender-address", f"unix:{tmp / 'derender.sock'}", "--gateway-address", gateway],
                    tmp / "tito.log", env=env)
    return process, engine, f"http://{gateway}"


def start_vllm_grpc(model: str, tmp: Path):
    """`vllm serve --grpc` (SMG's servicer over vLLM), settings as bench/gateway.py's vllm serve."""
    port = free_port()
    process = spawn(vllm_cli("serve", model, "--grpc", "--host", "127.0.0.1", "--port", str(port),
                             "--dtype", "float32", "--no-enable-prefix-caching", "--enforce-eager",
                             "--max-num-seqs", str(MAX_RUNNING), "--kv-cache-memory-bytes", str(KV_CACHE_BYTES),
                             "--generation-config", "vllm"),
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
    from tito_models.paths import resolve_model

    model = str(resolve_model(args.model))
    tmp = Path(tempfile.mkdtemp(prefix="tito-smg-bench-"))
    setups = [SMG_TITO, TITO] + ([SMG_VLLM] if args.vllm else [])
    processes, urls = [], {}
    try:
        tito, engine, urls[TITO] = start_tito(model, tmp)
        processes.append(tito)
        if args.vllm:
            vllm, vllm_address = start_vllm_grpc(model, tmp)
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
