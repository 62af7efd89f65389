"""AsyncChatPipeline against the real render, engine and derender servers: the same chunks as the
synchronous ChatPipeline, many chats from one event loop, the engine slot freed when derender ends
a choice at a stop string, and an engine error surfacing with the engine's status."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from tito.grpc_errors import error_details
from tito_client.pipeline import AsyncChatPipeline, ChatPipeline, Endpoints
from tito.v1 import chat_pb2, derender_pb2, engine_pb2, engine_pb2_grpc, render_pb2
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server as create_derender
from tito_engine.config import EngineConfig
from tito_engine.server import create_server as create_engine
from tito_render.config import RenderConfig
from tito_render.server import create_server as create_render

TIMEOUT = 120


@pytest.fixture(scope="module")
def endpoints(tiny_text_model, module_aio_server) -> Endpoints:
    model = str(tiny_text_model)
    render = module_aio_server(lambda: create_render(RenderConfig(address="127.0.0.1:0", model=model)))
    engine = module_aio_server(lambda: create_engine(EngineConfig(address="127.0.0.1:0", model=model, device="cpu",
                                                                  max_model_len=1024)))
    derender = module_aio_server(lambda: create_derender(DerenderConfig(address="127.0.0.1:0", model=model)))
    return Endpoints(render.address, engine.address, derender.address)


def chat(text: str, **sampling) -> render_pb2.RenderChatRequest:
    sampling.setdefault("max_tokens", 12)
    sampling.setdefault("temperature", 0.0)
    return render_pb2.RenderChatRequest(messages=[chat_pb2.ChatMessage(role="user", content=text)],
                                        sampling=render_pb2.SamplingOptions(**sampling))


def answer(chunks: list[derender_pb2.ChatChunk]) -> tuple[str, str, list[int], int]:
    """What a client reads from a chat: its text (reasoning and content), finish reason, usage."""
    final = [chunk for chunk in chunks if chunk.finish_reason]
    usage = [chunk.usage for chunk in chunks if chunk.HasField("usage")]
    return ("".join(c.reasoning_content for c in chunks) + "|" + "".join(c.content for c in chunks),
            engine_pb2.FinishReason.Name(final[-1].finish_reason),
            [u.completion_tokens for u in usage], len(final))


async def collect(pipeline: AsyncChatPipeline, request: render_pb2.RenderChatRequest) -> list:
    return [chunk async for chunk in pipeline.stream_chat(request)]


def test_the_same_chunks_as_the_synchronous_pipeline_and_many_chats_at_once(endpoints):
    questions = [f"Question number {k}: what is {k} plus {k}?" for k in range(8)]
    with ChatPipeline(endpoints, timeout=TIMEOUT) as pipeline:
        expected = [answer(list(pipeline.stream_chat(chat(q)))) for q in questions]

    async def main():
        async with AsyncChatPipeline(endpoints, timeout=TIMEOUT) as pipeline:
            one = answer(await collect(pipeline, chat(questions[0])))
            together = await asyncio.gather(*(collect(pipeline, chat(q)) for q in questions))
            return one, [answer(chunks) for chunks in together]

    one, together = asyncio.run(main())
    assert one == expected[0]
    assert together == expected
    assert all(usage == [12] and finish == "FINISH_REASON_LENGTH" for _, finish, usage, _ in together)


def test_a_stop_string_ends_the_chat_and_frees_the_engine_slot(endpoints):
    with ChatPipeline(endpoints, timeout=TIMEOUT) as pipeline:
        text = "".join(c.reasoning_content + c.content for c in pipeline.stream_chat(chat("Hello", max_tokens=40)))
    stop = text[len(text) // 2:len(text) // 2 + 2]  # a piece of the greedy answer: derender stops there
    assert stop.strip(), text

    async def main():
        async with AsyncChatPipeline(endpoints, timeout=TIMEOUT) as pipeline:
            chunks = await collect(pipeline, chat("Hello", max_tokens=1000, stop=[stop]))
        async with grpc.aio.insecure_channel(endpoints.engine) as channel:
            stub = engine_pb2_grpc.EngineServiceStub(channel)
            for _ in range(100):  # the cancellation reaches the engine a moment after the chat ends
                load = await stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=10)
                if load.running_requests == 0:
                    break
                await asyncio.sleep(0.05)
        return chunks, load

    chunks, load = asyncio.run(main())
    final = [chunk for chunk in chunks if chunk.finish_reason]
    assert final[-1].matched_stop == stop and final[-1].cancel_generation
    assert engine_pb2.FinishReason.Name(final[-1].finish_reason) == "FINISH_REASON_STOP"
    assert load.running_requests == 0 and load.kv_blocks_used == 0


def test_an_engine_refusal_reaches_the_caller_with_the_engine_status(endpoints):
    # Render allows the model's own context; this engine serves only 1024 tokens of it.
    request = chat("the sea " * 700, max_tokens=4)

    async def main():
        async with AsyncChatPipeline(endpoints, timeout=TIMEOUT) as pipeline:
            with pytest.raises(grpc.RpcError) as refused:
                await collect(pipeline, request)
            after = answer(await collect(pipeline, chat("Hello", max_tokens=3)))  # the pipeline still works
        return refused.value, after

    error, after = asyncio.run(main())
    details = error_details(error)
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT, details
    assert details["reason"] == "PROMPT_TOO_LONG", details
    assert after[2] == [3]


@pytest.mark.parametrize("batch_derender", [False, True])
def test_on_generating_is_called_once_when_the_engine_answers_before_any_chunk(endpoints, batch_derender):
    events: list[str] = []

    async def main():
        async with AsyncChatPipeline(endpoints, timeout=TIMEOUT, batch_derender=batch_derender) as pipeline:
            async for _ in pipeline.stream_chat(chat("Hello", max_tokens=5),
                                                on_generating=lambda: events.append("engine")):
                events.append("chunk")
            # An engine refusal: no response ever came, so there was nothing to announce.
            with pytest.raises(grpc.RpcError):
                async for _ in pipeline.stream_chat(chat("the sea " * 700, max_tokens=4),
                                                    on_generating=lambda: events.append("refused")):
                    pass

    asyncio.run(main())
    assert events[0] == "engine" and events.count("engine") == 1 and "refused" not in events
    assert events.count("chunk") >= 2  # the first text, then the final chunk
