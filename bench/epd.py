"""Encode on one engine, generate on another: end-to-end time and bytes on the wire.

    .venv/bin/python bench/epd.py [--rounds 3] [--max-tokens 8] [--size 112]
    .venv/bin/python bench/epd.py --smoke   # one round, 56x56 images, 2 new tokens: checks that it runs

One run, three native engines of the tiny Qwen2-VL (`tiny-qwen2-vl`) served over gRPC on
loopback from this process (each engine core in its own child process): `single` (no shared
store), and `A` / `B` sharing one encoder-store directory (--encoder-store-dir). Render runs
in this process (tito_render's Renderer: the same code as the render service; its response
bytes are what the RenderChat RPC would carry). For 1 and 4 images per chat, three ways:

* `tensors`: render with mm_payload TENSORS, Generate on `single` (the engine encodes).
* `metadata+hit`: the same images were sent with tensors to `single` before (untimed); render
  with METADATA, Generate on `single` (an encoder-cache hit by hash).
* `metadata+descriptors`: render with TENSORS, Encode on `A` (outputs to the shared directory),
  then Generate on `B` with the items' kwargs removed and A's descriptors attached (what a
  router does); B loads the outputs and never runs its encoder.

Every round uses new images (no cache helps where it should not), greedy, `--max-tokens` new
tokens. Bytes are serialized message sizes: the render response, and the requests to and
answers from each engine (Generate's responses are the same in every mode and left out). Time
is end to end, render included, per chat; the ratio is each mode's time over `tensors` in the
same round (median over rounds). Outputs are checked equal to `tensors`' tokens.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import statistics
import sys
import tempfile
import time

import grpc
import numpy as np
from PIL import Image

from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, multimodal_pb2, render_pb2
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_models.paths import resolve_model
from tito_models.tiny import VL_MODEL
from tito_render.config import RenderConfig
from tito_render.model import load_render_model
from tito_render.renderer import Renderer
from tito_render.convert import chat_response

TENSORS, METADATA = multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA
MODES = ("tensors", "metadata+hit", "metadata+descriptors")


def png(size: int, seed: int) -> bytes:
    pixels = np.random.RandomState(seed).randint(0, 256, size=(size, size, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, "PNG")
    return buffer.getvalue()


def chat_request(images: int, seed: int, size: int, payload: int, max_tokens: int) -> render_pb2.RenderChatRequest:
    parts = [chat_pb2.ContentPart(text="Compare these pictures:")]
    for k in range(images):
        parts.append(chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=png(size, seed * 10 + k))))
    parts.append(chat_pb2.ContentPart(text="Which is brighter?"))
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content_parts=parts)],
                                        mm_payload=payload,
                                        sampling=render_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0))


async def generate(stub, request) -> list[int]:
    return [token async for response in stub.Generate(request) for token in response.token_ids]


class Bench:
    def __init__(self, renderer: Renderer, stubs: dict, args):
        self.renderer, self.stubs, self.args = renderer, stubs, args

    def render(self, images: int, seed: int, payload: int) -> render_pb2.RenderChatResponse:
        return chat_response(self.renderer, chat_request(images, seed, self.args.size, payload, self.args.max_tokens))

    async def tensors(self, images: int, seed: int) -> tuple[float, dict, list[int]]:
        start = time.perf_counter()
        rendered = self.render(images, seed, TENSORS)
        tokens = await generate(self.stubs["single"], rendered.generate_request)
        elapsed = time.perf_counter() - start
        return elapsed, {"render response": rendered.ByteSize(),
                         "to the engine": rendered.generate_request.ByteSize()}, tokens

    async def metadata_hit(self, images: int, seed: int) -> tuple[float, dict, list[int]]:
        warm = self.render(images, seed, TENSORS)
        await generate(self.stubs["single"], warm.generate_request)  # untimed: the cache now holds them
        start = time.perf_counter()
        rendered = self.render(images, seed, METADATA)
        tokens = await generate(self.stubs["single"], rendered.generate_request)
        elapsed = time.perf_counter() - start
        return elapsed, {"render response": rendered.ByteSize(),
                         "to the engine": rendered.generate_request.ByteSize()}, tokens

    async def descriptors(self, images: int, seed: int) -> tuple[float, dict, list[int]]:
        start = time.perf_counter()
        rendered = self.render(images, seed, TENSORS)
        encode_request = engine_pb2.EncodeRequest(mm_features=rendered.generate_request.mm_features)
        encoded = await self.stubs["A"].Encode(encode_request)
        request = engine_pb2.GenerateRequest()
        request.CopyFrom(rendered.generate_request)
        for item, descriptor in zip(request.mm_features.items, encoded.descriptors):
            item.ClearField("kwargs")
            item.ec_descriptor.CopyFrom(descriptor)
        tokens = await generate(self.stubs["B"], request)
        elapsed = time.perf_counter() - start
        return elapsed, {"render response": rendered.ByteSize(),
                         "to the encoding engine": encode_request.ByteSize() + encoded.ByteSize(),
                         "to the engine": request.ByteSize()}, tokens


async def main(args) -> int:
    model = resolve_model(VL_MODEL)
    renderer = Renderer(load_render_model(RenderConfig(model=str(model))))
    servers, stubs, channels = [], {}, []
    with tempfile.TemporaryDirectory(prefix="tito-ec-") as store_dir:
        try:
            for name, extra in (("single", {}), ("A", {"encoder_store_dir": store_dir}),
                                ("B", {"encoder_store_dir": store_dir})):
                config = EngineConfig(model=str(model), device="cpu", address="127.0.0.1:0", kv_blocks=512,
                                      core_cpus="none", engine_process=not args.smoke, **extra)
                running = await create_server(config)
                servers.append(running)
                channel = grpc.aio.insecure_channel(running.address)
                channels.append(channel)
                stubs[name] = engine_pb2_grpc.EngineServiceStub(channel)
            bench = Bench(renderer, stubs, args)
            for images in (1, 4):  # one untimed round: first calls pay one-off costs
                await bench.tensors(images, 1)
                await bench.descriptors(images, 2)
            results = {(images, mode): [] for images in (1, 4) for mode in MODES}
            ok = True
            for round_index in range(args.rounds):
                for images in (1, 4):
                    seed = 1000 + 100 * round_index + images
                    base = await bench.tensors(images, seed)
                    hit = await bench.metadata_hit(images, seed + 30)
                    across = await bench.descriptors(images, seed)  # the same images as `tensors`
                    if across[2] != base[2]:
                        print(f"MISMATCH: {images} image(s), round {round_index}: descriptors gave other tokens")
                        ok = False
                    for mode, result in zip(MODES, (base, hit, across)):
                        results[(images, mode)].append((result[0], result[0] / base[0], result[1]))
            b_load = await stubs["B"].GetLoad(engine_pb2.GetLoadRequest())
        finally:
            for channel in channels:
                await channel.close()
            for running in servers:
                await running.stop(0)
    print(f"tiny-qwen2-vl, {args.size}x{args.size} images, {args.max_tokens} new tokens, {args.rounds} rounds "
          f"(median end-to-end ms [range]; ratio to tensors in the same round)")
    print(f"{'images':>6} {'mode':<22} {'e2e ms':>20} {'vs tensors':>10}  bytes on the wire")
    for (images, mode), rows in results.items():
        times = [row[0] * 1000 for row in rows]
        ratio = statistics.median(row[1] for row in rows)
        wire = ", ".join(f"{k} {v:,}" for k, v in rows[-1][2].items())
        print(f"{images:>6} {mode:<22} {statistics.median(times):>8.1f} [{min(times):.1f}-{max(times):.1f}] "
              f"{ratio:>9.2f}x  {wire}")
    print(f"engine B: encoded_items {b_load.encoded_items}, encoder_store_loads {b_load.encoder_store_loads}")
    return 0 if ok and b_load.encoded_items == 0 else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--size", type=int, default=112, help="image width and height in pixels")
    parser.add_argument("--smoke", action="store_true", help="the smallest run: checks that it runs")
    arguments = parser.parse_args()
    if arguments.smoke:
        arguments.rounds, arguments.max_tokens, arguments.size = 1, 2, 56
    sys.exit(asyncio.run(main(arguments)))
