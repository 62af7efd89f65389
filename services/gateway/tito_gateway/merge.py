"""A completion request with several prompts: each prompt is its own request through the services
(as vLLM schedules one engine request per prompt), and their chunk streams are merged into one
that reads like a single request's.

Domain code: no HTTP here. Choice `i` of prompt `p` becomes choice `p * n + i` (vLLM's numbering:
prompt 0's n choices, then prompt 1's, ...); each chunk's usage stays its prompt's, and
openai_out.UsageTracker adds the prompts up (it finds a choice's prompt as index // n).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from tito.v1 import derender_pb2

#: Chunks read ahead of the client per request; past that each prompt's stream waits (backpressure).
QUEUE_CHUNKS = 256


def renumber(chunk: derender_pb2.ChatChunk, prompt: int, n: int) -> derender_pb2.ChatChunk:
    """`chunk` of prompt `prompt`'s stream as a chunk of the merged one."""
    chunk.index += prompt * n
    return chunk


def merged(streams: list[AsyncIterator[derender_pb2.ChatChunk]], n: int) -> AsyncIterator[derender_pb2.ChatChunk]:
    """The chunks of all `streams` as they arrive, renumbered. The first error of any stream ends
    the merged one with that error; closing it early (an error, the client gone) cancels every
    stream, and with it every engine request. One stream is returned as it is."""
    return streams[0] if len(streams) == 1 else _merged(streams, n)


async def _merged(streams: list[AsyncIterator[derender_pb2.ChatChunk]], n: int
                  ) -> AsyncIterator[derender_pb2.ChatChunk]:
    queue: asyncio.Queue = asyncio.Queue(QUEUE_CHUNKS)
    pumps = [asyncio.ensure_future(_pump(prompt, stream, queue)) for prompt, stream in enumerate(streams)]
    try:
        running = len(streams)
        while running:
            prompt, chunk, error = await queue.get()
            if error is not None:
                raise error
            if chunk is None:
                running -= 1
                continue
            yield renumber(chunk, prompt, n)
    finally:
        for pump in pumps:
            pump.cancel()
        await asyncio.gather(*pumps, return_exceptions=True)


async def _pump(prompt: int, stream: AsyncIterator[derender_pb2.ChatChunk], queue: asyncio.Queue) -> None:
    """Move one stream's chunks to the queue as (prompt, chunk, None), then (prompt, None, error)
    at its end (error None when it ended well). Cancelled, it closes the stream."""
    try:
        async for chunk in stream:
            await queue.put((prompt, chunk, None))
    except Exception as exc:  # noqa: BLE001 - handed to the merged stream, which raises it
        await queue.put((prompt, None, exc))
        return
    finally:
        await stream.aclose()
    await queue.put((prompt, None, None))
