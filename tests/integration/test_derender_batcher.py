"""tito_client's DerenderBatcher against a real derender (port 0): concurrent chats over one
DerenderBatch call each get their own chunks; a chat's error arrives as the rich status its own
Derender call would have ended with, while the others go on; a derender that goes away fails the
open chats with UNAVAILABLE and the next chat starts a new call; a chat that gets no end meets its
deadline; a chat that stops reading releases derender's state; closing fails what is open."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from tito.grpc_errors import error_details
from tito.v1 import derender_pb2, derender_pb2_grpc, engine_pb2
from tito_client.derender_batch import DerenderBatcher
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server

TIMEOUT = 20.0


@pytest.fixture
def server(aio_server, tiny_text_model):
    return aio_server(lambda: create_server(DerenderConfig(address="127.0.0.1:0", model=str(tiny_text_model))))


def run(coroutine_factory):
    return asyncio.run(coroutine_factory())


async def chat(batcher: DerenderBatcher, context, responses, pause: float = 0.0) -> list[derender_pb2.ChatChunk]:
    stream = batcher.open(context, TIMEOUT)

    async def forward():
        for response in responses:
            stream.send(response)
            await asyncio.sleep(pause)
        stream.close()

    forwarding = asyncio.ensure_future(forward())
    try:
        return [chunk async for chunk in stream.chunks()]
    finally:
        forwarding.cancel()


def words(hf_tokenizer, text: str, finish=engine_pb2.FINISH_REASON_LENGTH) -> list[engine_pb2.GenerateResponse]:
    ids = hf_tokenizer.encode(text, add_special_tokens=False)
    return [engine_pb2.GenerateResponse(index=0, token_ids=[t]) for t in ids[:-1]] + [
        engine_pb2.GenerateResponse(index=0, token_ids=ids[-1:], finish_reason=finish)]


def test_concurrent_chats_each_get_their_own_chunks_over_one_call(server, hf_tokenizer):
    texts = [f"chat {i}: café 日本 {i * 7}" for i in range(12)]

    async def main():
        async with grpc.aio.insecure_channel(server.address) as channel:
            batcher = DerenderBatcher(derender_pb2_grpc.DerenderServiceStub(channel))
            results = await asyncio.gather(*(
                chat(batcher, derender_pb2.DerenderContext(request_id=f"c{i}"), words(hf_tokenizer, text), 0.001)
                for i, text in enumerate(texts)))
            open_after = batcher.open_streams
            await batcher.close()
            return results, open_after

    results, open_after = run(main)
    for text, chunks in zip(texts, results):
        assert "".join(c.content for c in chunks) == text
        assert chunks[0].role == "assistant" and chunks[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert open_after == 0
    assert server.running.derender_servicer.live_streams == 0


def test_a_chats_error_is_its_own_rich_status_and_the_others_go_on(server, hf_tokenizer):
    async def main():
        async with grpc.aio.insecure_channel(server.address) as channel:
            batcher = DerenderBatcher(derender_pb2_grpc.DerenderServiceStub(channel))
            bad = chat(batcher, derender_pb2.DerenderContext(n=1),
                       [engine_pb2.GenerateResponse(index=3, token_ids=[5])])  # no choice 3
            good = chat(batcher, derender_pb2.DerenderContext(n=1), words(hf_tokenizer, "still fine"), 0.005)
            outcome = await asyncio.gather(bad, good, return_exceptions=True)
            await batcher.close()
            return outcome

    error, chunks = run(main)
    assert isinstance(error, grpc.RpcError) and error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert error_details(error)["reason"] == "CHOICE_INDEX_OUT_OF_RANGE"
    assert "".join(c.content for c in chunks) == "still fine"


def test_a_lost_derender_fails_the_open_chats_and_the_next_chat_starts_a_new_call(aio_server, tiny_text_model,
                                                                                 hf_tokenizer):
    first = aio_server(lambda: create_server(DerenderConfig(address="127.0.0.1:0", model=str(tiny_text_model))))
    address = first.address

    async def main():
        async with grpc.aio.insecure_channel(address) as channel:
            batcher = DerenderBatcher(derender_pb2_grpc.DerenderServiceStub(channel))
            stream = batcher.open(derender_pb2.DerenderContext(), TIMEOUT)
            stream.send(words(hf_tokenizer, "partial answer")[0])
            chunks = stream.chunks()
            assert (await anext(chunks)).content
            await asyncio.to_thread(first.call, lambda: first.running.stop(0.0))  # the fixture ends it later
            with pytest.raises(grpc.RpcError) as lost:
                async for _ in chunks:
                    pass
            assert lost.value.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED)
            assert batcher.open_streams == 0
            # A derender on the same port again: the next chat opens a new batch call.
            host, port = address.rsplit(":", 1)
            again = await asyncio.to_thread(aio_server, lambda: create_server(DerenderConfig(
                address=f"{host}:{port}", model=str(tiny_text_model))))
            assert again.address == address
            deadline = time.monotonic() + 10
            while True:  # until the channel has reconnected
                try:
                    chunks = await chat(batcher, derender_pb2.DerenderContext(), words(hf_tokenizer, "back again"))
                    await batcher.close()
                    return chunks
                except grpc.RpcError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.1)

    chunks = run(main)
    assert "".join(c.content for c in chunks) == "back again"


def test_a_chat_that_gets_no_end_meets_its_deadline(server):
    async def main():
        async with grpc.aio.insecure_channel(server.address) as channel:
            batcher = DerenderBatcher(derender_pb2_grpc.DerenderServiceStub(channel))
            stream = batcher.open(derender_pb2.DerenderContext(), 0.3)  # the engine never sends anything
            started = time.monotonic()
            with pytest.raises(grpc.RpcError) as late:
                async for _ in stream.chunks():
                    pass
            waited = time.monotonic() - started
            deadline = time.monotonic() + 10
            while server.running.derender_servicer.live_streams and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            live = server.running.derender_servicer.live_streams  # with the call still open
            await batcher.close()
            return late.value, waited, live

    error, waited, live = run(main)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and 0.2 < waited < 5
    assert live == 0  # derender was told to drop it


def test_a_chat_that_stops_reading_releases_its_state_and_closing_fails_the_open_ones(server, hf_tokenizer):
    servicer = server.running.derender_servicer

    async def main():
        async with grpc.aio.insecure_channel(server.address) as channel:
            batcher = DerenderBatcher(derender_pb2_grpc.DerenderServiceStub(channel))
            left = batcher.open(derender_pb2.DerenderContext(), TIMEOUT)
            left.send(words(hf_tokenizer, "partial answer")[0])
            chunks = left.chunks()
            await anext(chunks)
            await chunks.aclose()  # the chat's client went away
            deadline = time.monotonic() + 10
            while servicer.live_streams and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            released = servicer.live_streams
            waiting = batcher.open(derender_pb2.DerenderContext(), TIMEOUT)
            reader = asyncio.ensure_future(anext(waiting.chunks()))
            await asyncio.sleep(0.1)
            await batcher.close()
            with pytest.raises(grpc.RpcError) as closed:
                await reader
            return released, closed.value

    released, error = run(main)
    assert released == 0
    assert error.code() == grpc.StatusCode.CANCELLED
