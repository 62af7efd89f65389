"""Derender throughput: is the cost per token O(1) in the output length?

Run: .venv/bin/python bench/derender.py   (about a minute on 2 cores; --smoke: a few seconds, a short
and a longer output, checks that it runs)

For outputs of 128 and 8192 tokens (prose, then a Hermes tool call whose arguments hold more
prose; tool parser "hermes" on, tools offered), one token per engine message, it measures:

- tito, in-process: the domain pipeline (DerenderStream.feed per message), no gRPC;
- tito, gRPC: a real DerenderService on a Unix socket, one bidirectional stream per request
  driven by a synchronous client (the figure includes protobuf and transport costs on both
  sides); once with the server in its own process (as deployed), once on an event loop thread
  of the bench process (client and server then share one GIL);
- baseline: a stateless derender that re-decodes the whole output on every token and sends
  the new suffix (what the reference implementations do), in-process.

It prints tokens/s at each length and the per-token cost ratio 8192 / 128 (target <= 1.3).
Short outputs are repeated so each measurement runs long enough to time.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import grpc

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tito_models.tiny import TEXT_MODEL, ensure_model  # noqa: E402
from tito.v1 import chat_pb2, derender_pb2, derender_pb2_grpc, engine_pb2  # noqa: E402
from tito_derender.config import DerenderConfig  # noqa: E402
from tito_derender.convert import context_from_proto, output_from_proto  # noqa: E402
from tito_derender.server import create_server  # noqa: E402
from tito_derender.tokenizer import TextTokenizer  # noqa: E402
from tito_derender.stream import DerenderStream  # noqa: E402

LENGTHS = (128, 8192)
PROSE = ("The quick brown fox jumps over the lazy dog while café owners in Zürich count 日本 tokens; "
         "streams keep their state so each token costs the same, however long the answer grows. ")
TOOL = chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(name="write_file"))


def encode(tokenizer: TextTokenizer, text: str) -> list[int]:
    """`text`'s ids (derender's tokenizer only decodes: its `tokenizers` backend encodes)."""
    return tokenizer.backend.encode(text, add_special_tokens=False).ids


def output_ids(tokenizer: TextTokenizer, length: int) -> list[int]:
    """`length` ids: prose, then a tool call carrying prose in its arguments (about half each)."""
    prose_ids = encode(tokenizer, PROSE * (length // 8 + 2))
    argument = tokenizer.decode(prose_ids[: max(1, length // 2 - 30)])
    call = '\n<tool_call>\n' + json.dumps({"name": "write_file", "arguments": {"path": "notes.txt",
                                                                              "content": argument}}) + '\n</tool_call>'
    call_ids = encode(tokenizer, call)
    return prose_ids[:max(0, length - len(call_ids))] + call_ids


def context_proto(tokenizer: TextTokenizer) -> derender_pb2.DerenderContext:
    return derender_pb2.DerenderContext(
        request_id="bench", prompt_tail_token_ids=encode(tokenizer, "<|im_start|>assistant\n"),
        prompt_tokens=64, tool_parser="hermes", tools=[TOOL],
        tool_choice=chat_pb2.ToolChoice(mode=chat_pb2.TOOL_CHOICE_MODE_AUTO))


def engine_responses(ids: list[int]) -> list[engine_pb2.GenerateResponse]:
    responses = [engine_pb2.GenerateResponse(index=0, token_ids=[i]) for i in ids]
    responses.append(engine_pb2.GenerateResponse(index=0, finish_reason=engine_pb2.FINISH_REASON_STOP))
    return responses


#: Tokens each measurement covers at least (short outputs are repeated); --smoke: one pass.
BUDGET_TOKENS = {"in-process": 24_000, "grpc": 16_000, "baseline": 2_000}


def repeats(length: int, budget_tokens: int) -> int:
    return max(1, budget_tokens // length)


def check_result(tool_call_deltas: int) -> None:
    if tool_call_deltas == 0:
        raise RuntimeError("the bench output should contain a parsed tool call")


# ----------------------------------------------------------------------------- measurements
def bench_in_process(tokenizer: TextTokenizer, ids: list[int], budget: int) -> float:
    """Seconds per token through DerenderStream (engine messages already converted)."""
    context = context_from_proto(context_proto(tokenizer))
    outputs = [output_from_proto(r) for r in engine_responses(ids)]
    rounds = repeats(len(ids), budget)
    start = time.perf_counter()
    for _ in range(rounds):
        stream = DerenderStream(tokenizer, context)
        calls = 0
        for output in outputs:
            for chunk in stream.feed(output):
                calls += len(chunk.tool_calls)
    elapsed = time.perf_counter() - start
    check_result(calls)
    return elapsed / (rounds * len(ids))


def bench_baseline(tokenizer: TextTokenizer, ids: list[int], budget: int) -> float:
    """Seconds per token for the stateless approach: decode the whole output at every token."""
    rounds = repeats(len(ids), budget) if len(ids) <= 1024 else 1
    decode = tokenizer.decode
    start = time.perf_counter()
    for _ in range(rounds):
        previous, sent = "", []
        for end in range(1, len(ids) + 1):
            text = decode(ids[:end])
            if not text.endswith("\ufffd"):
                sent.append(text[len(previous):])
                previous = text
    elapsed = time.perf_counter() - start
    return elapsed / (rounds * len(ids))


class ServerThread:
    """A real DerenderService on a Unix socket, on its own event loop thread."""

    def __init__(self, model: Path) -> None:
        self._socket_dir = tempfile.mkdtemp(prefix="tito-bench-")
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        config = DerenderConfig(address=f"unix:{self._socket_dir}/derender.sock", model=str(model))
        self.running = asyncio.run_coroutine_threadsafe(create_server(config), self._loop).result(120)

    def stop(self) -> None:
        asyncio.run_coroutine_threadsafe(self.running.stop(0), self._loop).result(30)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)


class ServerProcess:
    """The derender server as its own process (`python -m tito_derender.server`) on a Unix
    socket, so the client's Python does not share a GIL with it (a router would not)."""

    def __init__(self, model: Path) -> None:
        import subprocess

        self._socket_dir = tempfile.mkdtemp(prefix="tito-bench-")
        self.address = f"unix:{self._socket_dir}/derender.sock"
        self._process = subprocess.Popen(
            [sys.executable, "-m", "tito_cli", "serve", "derender", "--address", self.address, "--model", str(model),
             "--log-level", "warning"], cwd=str(ROOT), stdout=subprocess.DEVNULL)
        from grpc_health.v1 import health_pb2, health_pb2_grpc
        deadline = time.monotonic() + 120
        with grpc.insecure_channel(self.address) as channel:
            health = health_pb2_grpc.HealthStub(channel)
            while True:
                try:
                    status = health.Check(health_pb2.HealthCheckRequest(service="tito.v1.DerenderService"),
                                          timeout=2).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        break
                except grpc.RpcError:
                    pass
                if time.monotonic() > deadline or self._process.poll() is not None:
                    raise RuntimeError("the derender server process did not become ready")
                time.sleep(0.2)

    def stop(self) -> None:
        self._process.terminate()
        self._process.wait(30)


def bench_grpc(stub, tokenizer: TextTokenizer, ids: list[int], budget: int) -> float:
    """Seconds per token over a real gRPC Derender stream (one per request)."""
    requests = [derender_pb2.DerenderRequest(context=context_proto(tokenizer))]
    requests += [derender_pb2.DerenderRequest(generate_response=r) for r in engine_responses(ids)]
    rounds = repeats(len(ids), budget)
    start = time.perf_counter()
    for _ in range(rounds):
        calls = sum(len(response.chunk.tool_calls) for response in stub.Derender(iter(requests), timeout=600))
    elapsed = time.perf_counter() - start
    check_result(calls)
    return elapsed / (rounds * len(ids))


# ----------------------------------------------------------------------------- report
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="the smallest run (outputs of 32 and 256 tokens, one pass each): checks that it runs")
    args = parser.parse_args()
    started = time.perf_counter()
    short, long = (32, 256) if args.smoke else LENGTHS
    budget = {name: 1 if args.smoke else tokens for name, tokens in BUDGET_TOKENS.items()}
    model = ensure_model(TEXT_MODEL, None)
    tokenizer = TextTokenizer.load(model)
    sequences = {length: output_ids(tokenizer, length) for length in (short, long)}
    results = {"tito in-process (DerenderStream)": {n: bench_in_process(tokenizer, sequences[n], budget["in-process"])
                                                    for n in sequences}}
    for name, server_class in (("tito gRPC, server in own process", ServerProcess),
                               ("tito gRPC, server in client process", ServerThread)):
        server = server_class(model)
        try:
            address = server.address if isinstance(server, ServerProcess) else server.running.address
            with grpc.insecure_channel(address) as channel:
                stub = derender_pb2_grpc.DerenderServiceStub(channel)
                bench_grpc(stub, tokenizer, sequences[short], budget["grpc"])  # warm-up: connection, first stream
                results[name] = {n: bench_grpc(stub, tokenizer, sequences[n], budget["grpc"]) for n in sequences}
        finally:
            server.stop()
    results["baseline: re-decode all per token"] = {n: bench_baseline(tokenizer, sequences[n], budget["baseline"])
                                                    for n in sequences}

    print(f"\nderender throughput, one token per engine message, hermes tool parser on "
          f"(tiny-qwen2 tokenizer; actual lengths {', '.join(str(len(ids)) for ids in sequences.values())}; "
          f"{os.cpu_count()} CPUs)\n")
    header = (f"{'pipeline':40} {f'tok/s @{short}':>12} {f'tok/s @{long}':>12} "
              f"{f'cost ratio {long}/{short}':>20}  verdict")
    print(header)
    print("-" * len(header))
    for name, per_token in results.items():
        ratio = per_token[long] / per_token[short]
        verdict = "O(1) per token (<= 1.3)" if ratio <= 1.3 else "grows with length"
        print(f"{name:40} {1 / per_token[short]:12,.0f} {1 / per_token[long]:12,.0f} {ratio:20.2f}  {verdict}")
    print(f"\n(cost ratio = seconds per token at {long} / seconds per token at {short}; total run "
          f"{time.perf_counter() - started:.0f} s)")


if __name__ == "__main__":
    main()
