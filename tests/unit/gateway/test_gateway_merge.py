"""Several prompts of one completion request: their streams merged as one request's."""

from __future__ import annotations

import asyncio

import pytest

from tito.v1 import derender_pb2, engine_pb2
from tito_gateway.merge import merged

STOP = engine_pb2.FINISH_REASON_STOP


def final(index: int, prompt_tokens: int, completion_tokens: int) -> derender_pb2.ChatChunk:
    """A final chunk: its usage counts its stream's choices finished so far, as derender's do."""
    return derender_pb2.ChatChunk(index=index, finish_reason=STOP, usage=engine_pb2.Usage(
        prompt_tokens=prompt_tokens, completion_tokens=completion_tokens, cached_tokens=1))


class Stream:
    """A prompt's chunk stream that records whether it was closed (its engine request cancelled)."""

    def __init__(self, chunks, fail: Exception | None = None, hang: bool = False):
        self.chunks, self.fail, self.hang = chunks, fail, hang
        self.closed = False

    async def run(self):
        try:
            for chunk in self.chunks:
                await asyncio.sleep(0)
                yield chunk
            if self.fail is not None:
                raise self.fail
            if self.hang:
                await asyncio.Event().wait()
        finally:
            self.closed = True


async def collect(streams, n):
    return [chunk async for chunk in merged([stream.run() for stream in streams], n)]


def test_choices_are_numbered_prompt_by_prompt():
    first = Stream([derender_pb2.ChatChunk(index=1, content="b"), final(1, 3, 2),
                    derender_pb2.ChatChunk(index=0, content="a"), final(0, 3, 5)])
    second = Stream([derender_pb2.ChatChunk(index=0, content="c"), final(0, 4, 1), final(1, 4, 3)])
    chunks = asyncio.run(collect([first, second], n=2))
    by_choice: dict[int, str] = {}
    for chunk in chunks:
        by_choice[chunk.index] = by_choice.get(chunk.index, "") + chunk.content
    assert by_choice == {0: "a", 1: "b", 2: "c", 3: ""}  # vLLM's numbering: prompt * n + choice
    assert sorted(chunk.index for chunk in chunks if chunk.finish_reason) == [0, 1, 2, 3]


def test_one_stream_is_passed_through_as_it_is():
    stream = Stream([]).run()
    assert merged([stream], 3) is stream


def test_an_error_in_one_prompt_ends_the_request_and_cancels_the_others():
    failing = Stream([derender_pb2.ChatChunk(index=0, content="x")], fail=RuntimeError("engine refused"))
    waiting = Stream([derender_pb2.ChatChunk(index=0, content="y")], hang=True)
    with pytest.raises(RuntimeError, match="engine refused"):
        asyncio.run(collect([failing, waiting], n=1))
    assert failing.closed and waiting.closed


def test_closing_the_merged_stream_early_closes_every_prompts_stream():
    streams = [Stream([derender_pb2.ChatChunk(index=0, content="x")], hang=True) for _ in range(3)]

    async def read_one_and_go():
        chunks = merged([stream.run() for stream in streams], 1)
        await anext(chunks)
        await chunks.aclose()

    asyncio.run(read_one_and_go())
    assert all(stream.closed for stream in streams)
