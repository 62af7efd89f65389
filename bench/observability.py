"""What metrics and tracing cost: render and engine calls with them off, with --metrics-port, and
with --metrics-port --otel (every trace kept, and 1% kept), in one run.

    .venv/bin/python bench/observability.py [--service render|engine|both] [--calls 300] [--rounds 5]
    .venv/bin/python bench/observability.py --smoke   # one traced server per service, 2 calls: checks that it runs

render: four `tito serve render` processes on the tiny text model (Unix sockets): one plain, one with
/metrics, one with /metrics and tracing of every call, one with /metrics and tracing keeping one
trace in a hundred (OTEL_TRACES_SAMPLER=parentbased_traceidratio, OTEL_TRACES_SAMPLER_ARG=0.01).
Spans are exported over OTLP/gRPC to a do-nothing collector in this process, so export costs what
it would in production minus the network. A synchronous
client sends the same small text chat to each in turn, `--calls` calls per round, rounds
interleaved so that noise from other work on the machine falls on all of them alike. A small chat
renders in well under a millisecond, so this is where a per-call cost would show most.

engine: the same four configurations of `tito serve engine --no-engine-process` (model and
scheduler in the server process, so the process's CPU time is all of it), one Generate at a time
of 32 greedy tokens from a 16-token prompt (`--calls / 10` calls per round): the per-request
observer, the extra step per streamed message, the engine spans. A request takes tens of
milliseconds of CPU there, so the difference is far below what a shared machine's noise lets the
servers' CPU times show; the bench therefore also times the engine's request observer in process
(the whole per-request cost of the engine's metrics) on a stream of 32 messages, against the bare
stream.

Prints, per configuration, the server's CPU time per call (its process's user + system time over
all rounds, from /proc: what the observability adds to the server's own work, and much less
sensitive than wall time to other load on a shared machine) and calls/s (median over rounds),
each with its ratio to the plain server.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent import futures
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tito_client.pipeline import wait_until_serving  # noqa: E402
from tito_models.tiny import TEXT_MODEL, ensure_model  # noqa: E402
from tito.v1 import (chat_pb2, engine_pb2, engine_pb2_grpc, render_pb2, render_pb2_grpc,  # noqa: E402
                     sampling_pb2)

CONFIGS = {"off": [], "metrics": ["--metrics-port", "0"], "metrics+tracing": ["--metrics-port", "0", "--otel"],
           "metrics+tracing 1%": ["--metrics-port", "0", "--otel"]}
#: The last configuration keeps one trace in a hundred (the standard sampler variables).
SAMPLED = {"OTEL_TRACES_SAMPLER": "parentbased_traceidratio", "OTEL_TRACES_SAMPLER_ARG": "0.01"}
REQUEST = render_pb2.RenderChatRequest(
    messages=[chat_pb2.ChatMessage(role="system", content="You are a helpful assistant."),
              chat_pb2.ChatMessage(role="user", content="What is the capital of France? Answer in one word.")],
    sampling=render_pb2.SamplingOptions(max_tokens=16, temperature=0.0))


def start_collector() -> tuple[grpc.Server, int]:
    """An OTLP/gRPC trace endpoint that accepts and drops everything."""
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Sink(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request, context):
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Sink(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    return server, port


ENGINE_REQUEST = engine_pb2.GenerateRequest(token_ids=list(range(5, 21)), sampling_params=sampling_pb2.SamplingParams(
    max_tokens=32, min_tokens=32, temperature=0.0))


def start_service(service: str, model: str, address: str, extra: list[str], collector_port: int,
                  environ: dict[str, str]) -> subprocess.Popen:
    environ = dict(os.environ, PYTHONPATH=str(ROOT), OTEL_EXPORTER_OTLP_ENDPOINT=f"http://127.0.0.1:{collector_port}",
                   OTEL_EXPORTER_OTLP_INSECURE="true", **environ)
    if "--otel" not in extra:  # the endpoint variable alone would turn tracing on
        del environ["OTEL_EXPORTER_OTLP_ENDPOINT"]
    own = ["--no-engine-process", "--device", "cpu", "--cpu-threads", "1"] if service == "engine" else []
    command = [sys.executable, "-m", "tito_cli", "serve", service, "--address", address, "--model", model,
               "--log-level", "warning", *own, *extra]
    return subprocess.Popen(command, env=environ, stdout=subprocess.DEVNULL)


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far (Linux /proc)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def render_call(channel: grpc.Channel):
    stub = render_pb2_grpc.RenderServiceStub(channel)
    return lambda: stub.RenderChat(REQUEST, timeout=30)


def engine_call(channel: grpc.Channel):
    stub = engine_pb2_grpc.EngineServiceStub(channel)
    return lambda: list(stub.Generate(ENGINE_REQUEST, timeout=60))


def calls_per_second(call, calls: int) -> float:
    started = time.perf_counter()
    for _ in range(calls):
        call()
    return calls / (time.perf_counter() - started)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--service", choices=("render", "engine", "both"), default="both")
    parser.add_argument("--calls", type=int, default=300)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run (one server per service, metrics and sampled tracing on, 2 calls): "
                             "checks that it runs")
    args = parser.parse_args()
    configs = {name: CONFIGS[name] for name in ("metrics+tracing 1%",)} if args.smoke else CONFIGS
    if args.smoke:
        args.calls, args.rounds = 2, 1
    model = str(ensure_model(TEXT_MODEL))
    collector, collector_port = start_collector()
    try:
        if args.service in ("render", "both"):
            measure("render", "RenderChat, small text chat", render_call, model, args.calls, args.rounds,
                    collector_port, configs)
        if args.service in ("engine", "both"):
            asyncio.run(observer_cost(repeats=30 if args.smoke else 3000))
            measure("engine", "Generate, 16 prompt + 32 new tokens", engine_call, model, max(1, args.calls // 10),
                    args.rounds, collector_port, configs)
    finally:
        collector.stop(0)
    return 0


async def observer_cost(messages: int = 32, repeats: int = 3000) -> None:
    """The engine's RequestObserver (metrics on) around a stream of `messages` outputs, in process."""
    from tito.metrics import ServiceMetrics
    from tito_engine.backend.observe import EngineMetrics, RequestObserver
    from tito_engine.request import ChoiceOutput, FinishReason, RequestTimings, Usage

    observer = RequestObserver(EngineMetrics(ServiceMetrics("engine"), lambda: None))
    last = ChoiceOutput(0, (5,), FinishReason.LENGTH, usage=Usage(16, messages), timings=RequestTimings(1, 2, 3, 4))
    outputs = [ChoiceOutput(0, (5,)) for _ in range(messages - 1)] + [last]

    async def stream():
        for output in outputs:
            yield output

    async def per_request(observed: bool) -> float:
        started = time.perf_counter()
        for _ in range(repeats):
            async for _output in (observer.observe(stream()) if observed else stream()):
                pass
        return (time.perf_counter() - started) / repeats

    bare = min([await per_request(False) for _ in range(3)])
    observed = min([await per_request(True) for _ in range(3)])
    print(f"engine request observer, in process, {messages} messages per request: bare stream {bare * 1e6:.0f} us, "
          f"observed {observed * 1e6:.0f} us: {(observed - bare) * 1e6:.0f} us per request "
          f"({(observed - bare) / messages * 1e6:.2f} us per message)")


def measure(service: str, what: str, make_call, model: str, calls_per_round: int, rounds: int,
            collector_port: int, configs: dict[str, list[str]]) -> None:
    """`configs`: the server configurations compared (CONFIGS, or some of them), each as a ratio to
    the first."""
    directory = tempfile.TemporaryDirectory(prefix="tito-bench-")
    addresses = {name: f"unix:{Path(directory.name) / f'{service}-{i}.sock'}" for i, name in enumerate(configs)}
    # Started last to first: on a shared machine the first process started has run measurably
    # slower here for the whole run, so that bias, if any, falls on the observed servers.
    started = {name: start_service(service, model, addresses[name], configs[name], collector_port,
                                   SAMPLED if name.endswith("%") else {}) for name in reversed(configs)}
    processes = [started[name] for name in configs]
    try:
        for address in addresses.values():
            wait_until_serving(address, timeout=180)
        channels = {name: grpc.insecure_channel(address) for name, address in addresses.items()}
        stubs = {name: make_call(channel) for name, channel in channels.items()}
        for stub in stubs.values():
            # warm-up: connections up, caches warm
            calls_per_second(stub, min(calls_per_round, 5 if service == "engine" else 50))
        pids = dict(zip(configs, (process.pid for process in processes)))
        rates: dict[str, list[float]] = {name: [] for name in configs}
        cpu = dict.fromkeys(configs, 0.0)
        for round_index in range(rounds):
            order = list(configs)[round_index % len(configs):] + list(configs)[:round_index % len(configs)]
            for name in order:
                before = cpu_seconds(pids[name])
                rates[name].append(calls_per_second(stubs[name], calls_per_round))
                cpu[name] += cpu_seconds(pids[name]) - before
        calls = calls_per_round * rounds
        base = next(iter(configs))
        base_cpu, base_rate = cpu[base] / calls, statistics.median(rates[base])
        print(f"{what}, {calls_per_round} calls x {rounds} rounds:")
        print(f"  {'':20s} {'server CPU/call':>16s} {'ratio':>6s} {'calls/s':>9s} {'ratio':>6s}")
        for name in configs:
            per_call, rate = cpu[name] / calls, statistics.median(rates[name])
            cpu_ratio = per_call / base_cpu if base_cpu else float("nan")  # a few calls may not reach a clock tick
            print(f"  {name:20s} {per_call * 1e6:13.0f} us {cpu_ratio:6.3f} {rate:9.0f} {rate / base_rate:6.3f}")
        for channel in channels.values():
            channel.close()
    finally:
        for process in processes:
            process.terminate()
        for process in processes:
            process.wait(30)
        directory.cleanup()


if __name__ == "__main__":
    sys.exit(main())
