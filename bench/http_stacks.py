"""Which HTTP stack the gateway stands on: Starlette on uvicorn (httptools) against aiohttp's web
server, on the gateway's own workload shape, in one run.

    .venv/bin/python bench/http_stacks.py [--requests 256] [--concurrency 32] [--events 64] [--rounds 3]
    .venv/bin/python bench/http_stacks.py --smoke   # 4 requests of 4 events, one round: checks that it runs

Each server (a subprocess, one event loop, as the gateway runs) answers POST /v1/chat/completions
with a JSON body parsed and `--events` SSE events of an OpenAI chunk's size, then `[DONE]`; an
aiohttp client streams `--requests` of them `--concurrency` at a time. Rounds alternate the order;
prints each stack's best requests/s and events/s and the median paired ratio
starlette+uvicorn / aiohttp. Nothing else of tito runs: this is the HTTP layer's own cost per
streamed token.
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
import time

CHUNK = json.dumps({"id": "chatcmpl-0123456789abcdef", "object": "chat.completion.chunk", "created": 1,
                    "model": "m", "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None,
                                               "finish_reason": None}]}).encode()

STARLETTE = """
import asyncio, json, sys
import uvicorn
from starlette.applications import Starlette
from starlette.responses import StreamingResponse
from starlette.routing import Route
CHUNK, EVENTS = sys.argv[2].encode(), int(sys.argv[3])
async def chat(request):
    json.loads(await request.body())
    async def events():
        for _ in range(EVENTS):
            await asyncio.sleep(0)
            yield b"data: " + CHUNK + b"\\n\\n"
        yield b"data: [DONE]\\n\\n"
    return StreamingResponse(events(), media_type="text/event-stream")
app = Starlette(routes=[Route("/v1/chat/completions", chat, methods=["POST"])])
uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), http="httptools", loop="asyncio", log_level="warning",
            access_log=False)
"""

AIOHTTP = """
import asyncio, json, sys
from aiohttp import web
CHUNK, EVENTS = sys.argv[2].encode(), int(sys.argv[3])
async def chat(request):
    json.loads(await request.read())
    response = web.StreamResponse(headers={"content-type": "text/event-stream"})
    await response.prepare(request)
    for _ in range(EVENTS):
        await asyncio.sleep(0)
        await response.write(b"data: " + CHUNK + b"\\n\\n")
    await response.write(b"data: [DONE]\\n\\n")
    await response.write_eof()
    return response
app = web.Application()
app.router.add_post("/v1/chat/completions", chat)
web.run_app(app, host="127.0.0.1", port=int(sys.argv[1]), print=None, access_log=None)
"""


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def drive(url: str, requests: int, concurrency: int) -> tuple[float, int]:
    import aiohttp

    body = {"model": "m", "messages": [{"role": "user", "content": "hello " * 64}], "stream": True}
    events = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as session:
        for _ in range(3):  # warm-up
            async with session.post(url, json=body) as reply:
                await reply.read()
        remaining = requests

        async def worker():
            nonlocal remaining, events
            while remaining > 0:
                remaining -= 1
                async with session.post(url, json=body) as reply:
                    async for line in reply.content:
                        events += line.startswith(b"data: ")
        started = time.perf_counter()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        return time.perf_counter() - started, events


def wait_listening(port: int, process: subprocess.Popen) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"server exited with {process.returncode}")
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.1)
    raise RuntimeError("server did not listen")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--events", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--smoke", action="store_true", help="the smallest run: checks that it runs")
    args = parser.parse_args()
    if args.smoke:
        args.requests, args.concurrency, args.events, args.rounds = 4, 2, 4, 1
    stacks = {"starlette+uvicorn": STARLETTE, "aiohttp": AIOHTTP}
    servers, ports = {}, {}
    try:
        for name, source in stacks.items():
            ports[name] = free_port()
            servers[name] = subprocess.Popen([sys.executable, "-c", source, str(ports[name]), CHUNK.decode(),
                                              str(args.events)], env=os.environ)
        for name in stacks:
            wait_listening(ports[name], servers[name])
        results: dict[str, list[tuple[float, int]]] = {name: [] for name in stacks}
        for round_index in range(args.rounds):
            order = list(stacks) if round_index % 2 == 0 else list(reversed(stacks))
            for name in order:
                url = f"http://127.0.0.1:{ports[name]}/v1/chat/completions"
                results[name].append(asyncio.run(drive(url, args.requests, args.concurrency)))
    finally:
        for process in servers.values():
            process.terminate()
            process.wait()
    print(f"{args.requests} streamed requests of {args.events} events, concurrency {args.concurrency}, "
          f"{args.rounds} rounds (best shown):")
    for name, runs in results.items():
        elapsed, events = min(runs)
        print(f"  {name:<18} {args.requests / elapsed:8.1f} req/s {events / elapsed:10.0f} events/s")
    ratios = [b[0] / a[0] for a, b in zip(results["starlette+uvicorn"], results["aiohttp"])]
    print(f"starlette+uvicorn / aiohttp throughput {statistics.median(ratios):.2f}x "
          f"[{min(ratios):.2f}-{max(ratios):.2f}]")
    return 0


if __name__ == "__main__":
    sys.exit(main())
