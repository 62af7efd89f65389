"""DerenderBatch over real gRPC (port 0): many streams in one call, each giving exactly the chunks
its own Derender call gives; one stream's error ends only it; closes and dropped calls release
the streams' state."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from google.rpc import error_details_pb2

from tito.v1 import derender_pb2, derender_pb2_grpc, engine_pb2, sampling_pb2
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server

DEADLINE = 20


@pytest.fixture
def server(aio_server, tiny_text_model):
    return aio_server(lambda: create_server(DerenderConfig(address="127.0.0.1:0", model=str(tiny_text_model))))


@pytest.fixture
def stub(server):
    channel = server.channel()
    yield derender_pb2_grpc.DerenderServiceStub(channel)
    channel.close()


def response(**fields) -> engine_pb2.GenerateResponse:
    return engine_pb2.GenerateResponse(**fields)


def scripts(hf_tokenizer) -> dict[int, tuple[derender_pb2.DerenderContext, list[engine_pb2.GenerateResponse]]]:
    """Three requests' contexts and engine responses: plain text, two choices, and a stop string
    that derender matches itself (it then asks for the generation to be cancelled)."""
    plain = hf_tokenizer.encode(" Hello 日本, café 🎉!", add_special_tokens=False)
    first, second = (hf_tokenizer.encode(t, add_special_tokens=False) for t in ("one 日本", "two café"))
    stopped = hf_tokenizer.encode("keep this STOP not this", add_special_tokens=False)
    return {
        11: (derender_pb2.DerenderContext(request_id="plain", prompt_tokens=5),
             [response(index=0, token_ids=[t]) for t in plain[:-1]]
             + [response(index=0, token_ids=plain[-1:], finish_reason=engine_pb2.FINISH_REASON_LENGTH,
                         usage=engine_pb2.Usage(prompt_tokens=5, completion_tokens=len(plain)))]),
        7: (derender_pb2.DerenderContext(request_id="two", n=2, prompt_tokens=3),
            [response(index=i % 2, token_ids=[(first, second)[i % 2][i // 2]])
             for i in range(2 * min(len(first), len(second)))]
            + [response(index=0, finish_reason=engine_pb2.FINISH_REASON_STOP),
               response(index=1, finish_reason=engine_pb2.FINISH_REASON_STOP)]),
        2**40: (derender_pb2.DerenderContext(request_id="stop", text_options=sampling_pb2.OutputTextOptions(
                    stop=["STOP"])),
                [response(index=0, token_ids=[t]) for t in stopped]),
    }


def own_calls(stub, script) -> list[derender_pb2.ChatChunk]:
    context, responses = script
    requests = [derender_pb2.DerenderRequest(context=context),
                *(derender_pb2.DerenderRequest(generate_response=r) for r in responses)]
    return [reply.chunk for reply in stub.Derender(iter(requests), timeout=DEADLINE)]


def batch_call(stub, messages: list[list[derender_pb2.DerenderBatchEntry]]) -> list[derender_pb2.DerenderBatchResult]:
    requests = (derender_pb2.DerenderBatchRequest(entries=entries) for entries in messages)
    return [result for reply in stub.DerenderBatch(requests, timeout=DEADLINE) for result in reply.results]


def test_each_stream_gets_the_chunks_of_its_own_derender_call(stub, hf_tokenizer):
    requests = scripts(hf_tokenizer)
    # One message per "engine step": every stream's next response, as a router batches them.
    messages = [[derender_pb2.DerenderBatchEntry(stream_id=sid, context=context)
                 for sid, (context, _) in requests.items()]]
    for step in range(max(len(responses) for _, responses in requests.values())):
        messages.append([derender_pb2.DerenderBatchEntry(stream_id=sid, generate_response=responses[step])
                         for sid, (_, responses) in requests.items() if step < len(responses)])
    results = batch_call(stub, messages)
    assert not [r for r in results if r.HasField("error")]
    for sid, script in requests.items():
        expected = own_calls(stub, script)
        mine = [r for r in results if r.stream_id == sid]
        assert [r.chunk for r in mine[:-1]] == expected
        assert mine[-1].WhichOneof("kind") == "ended"  # after the chunk that finished its last choice
    stop_chunks = [r.chunk for r in results if r.stream_id == 2**40 and r.HasField("chunk")]
    assert "".join(c.content for c in stop_chunks) == "keep this " and stop_chunks[-1].cancel_generation


def error_of(result: derender_pb2.DerenderBatchResult) -> tuple[int, str]:
    info = error_details_pb2.ErrorInfo()
    assert result.error.details[0].Unpack(info)
    return result.error.code, info.reason


def test_an_error_ends_its_stream_only_and_its_later_entries_are_ignored(server, stub, hf_tokenizer):
    ids = hf_tokenizer.encode("still fine", add_special_tokens=False)
    entry = derender_pb2.DerenderBatchEntry
    results = batch_call(stub, [
        [entry(stream_id=1, context=derender_pb2.DerenderContext(n=1)),
         entry(stream_id=2, context=derender_pb2.DerenderContext(n=1))],
        [entry(stream_id=1, generate_response=response(index=1, token_ids=[5])),  # no choice 1: refused
         entry(stream_id=2, generate_response=response(index=0, token_ids=ids[:1]))],
        [entry(stream_id=1, generate_response=response(index=0, token_ids=[5])),  # sent before the error was read
         entry(stream_id=2, generate_response=response(index=0, token_ids=ids[1:],
                                                       finish_reason=engine_pb2.FINISH_REASON_STOP))],
        [entry(stream_id=3, generate_response=response(index=0, token_ids=[5])),  # never opened
         entry(stream_id=4),  # sets nothing
         entry(stream_id=5, context=derender_pb2.DerenderContext(n=1, tool_parser="no-such-parser"))],
    ])
    errors = {r.stream_id: error_of(r) for r in results if r.HasField("error")}
    invalid = 3  # google.rpc.Code INVALID_ARGUMENT
    assert errors == {1: (invalid, "CHOICE_INDEX_OUT_OF_RANGE"), 3: (invalid, "CONTEXT_REQUIRED"),
                      4: (invalid, "EMPTY_MESSAGE"), 5: (invalid, "UNKNOWN_PARSER")}
    assert [r.stream_id for r in results].count(1) == 1  # the error, and nothing for the entry after it
    assert "".join(r.chunk.content for r in results if r.stream_id == 2) == "still fine"
    assert [r.WhichOneof("kind") for r in results if r.stream_id == 2][-1] == "ended"
    assert server.running.derender_servicer.live_streams == 0


def test_a_second_context_for_an_open_stream_ends_it_with_an_error(stub):
    entry = derender_pb2.DerenderBatchEntry
    results = batch_call(stub, [[entry(stream_id=9, context=derender_pb2.DerenderContext(n=1)),
                                 entry(stream_id=9, context=derender_pb2.DerenderContext(n=1))],
                                [entry(stream_id=9, generate_response=response(index=0, token_ids=[5]))]])
    assert [(r.stream_id, error_of(r)) for r in results] == [(9, (3, "STREAM_ALREADY_OPEN"))]


def wait_for(condition, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.02)
    return condition()


def test_closed_streams_and_a_dropped_call_release_their_state(server, stub, hf_tokenizer):
    servicer = server.running.derender_servicer
    outgoing: queue.Queue = queue.Queue()

    def requests():
        while (item := outgoing.get()) is not None:
            yield derender_pb2.DerenderBatchRequest(entries=item)

    entry = derender_pb2.DerenderBatchEntry
    call = stub.DerenderBatch(requests(), timeout=DEADLINE)
    partial = hf_tokenizer.encode("partial", add_special_tokens=False)
    outgoing.put([entry(stream_id=sid, context=derender_pb2.DerenderContext()) for sid in (1, 2, 3)]
                 + [entry(stream_id=1, generate_response=response(index=0, token_ids=partial))])
    assert [(r.stream_id, r.chunk.content) for r in next(call).results] == [(1, "partial")]
    assert servicer.live_streams == 3
    outgoing.put([entry(stream_id=2, close=derender_pb2.DerenderBatchClose()),
                  entry(stream_id=2, generate_response=response(index=0, token_ids=partial))])  # ignored
    assert [(r.stream_id, r.WhichOneof("kind")) for r in next(call).results] == [(2, "ended")]
    outgoing.put([entry(stream_id=3, generate_response=response(index=0, token_ids=partial))])
    assert [(r.stream_id, r.chunk.content) for r in next(call).results] == [(3, "partial")]
    assert servicer.live_streams == 2
    call.cancel()
    outgoing.put(None)
    assert wait_for(lambda: servicer.live_streams == 0)


def test_shutdown_ends_an_idle_batch_call_at_once_and_a_busy_one_when_its_streams_end(server, stub, hf_tokenizer):
    """A DerenderBatch call does not hold derender's grace period: an idle one ends as shutdown
    begins; on a busy one new streams are refused (SHUTTING_DOWN), the open stream finishes, and
    then the call ends."""
    entry = derender_pb2.DerenderBatchEntry

    def calls_fed_by(outgoing: queue.Queue):
        def requests():
            while (item := outgoing.get()) is not None:
                yield derender_pb2.DerenderBatchRequest(entries=item)
        return stub.DerenderBatch(requests(), timeout=DEADLINE)

    idle_feed, busy_feed = queue.Queue(), queue.Queue()
    idle, busy = calls_fed_by(idle_feed), calls_fed_by(busy_feed)
    ids = hf_tokenizer.encode("finish me", add_special_tokens=False)
    busy_feed.put([entry(stream_id=1, context=derender_pb2.DerenderContext()),
                   entry(stream_id=1, generate_response=response(index=0, token_ids=ids[:1]))])
    assert next(busy).results[0].chunk.content
    idle_feed.put([entry(stream_id=5, context=derender_pb2.DerenderContext()),
                   entry(stream_id=5, close=derender_pb2.DerenderBatchClose())])
    assert [r.WhichOneof("kind") for r in next(idle).results] == ["ended"]  # open, with no streams
    stopped = threading.Event()
    started = time.monotonic()
    threading.Thread(target=lambda: (server.call(lambda: server.running.stop(15.0), timeout=60), stopped.set()),
                     daemon=True).start()
    assert wait_for(lambda: server.running.derender_servicer.draining)
    assert list(idle) == []  # the idle call has ended
    busy_feed.put([entry(stream_id=2, context=derender_pb2.DerenderContext())])
    [refused] = next(busy).results
    assert (refused.stream_id, error_of(refused)) == (2, (14, "SHUTTING_DOWN"))  # UNAVAILABLE
    assert not stopped.is_set()  # stream 1 is still open: the call goes on
    busy_feed.put([entry(stream_id=1, generate_response=response(index=0, token_ids=ids[1:],
                                                                  finish_reason=engine_pb2.FINISH_REASON_STOP))])
    rest = [result for reply in busy for result in reply.results]  # the call ends after the stream's end
    assert [r.WhichOneof("kind") for r in rest][-1] == "ended" and rest[0].chunk.content
    assert stopped.wait(10) and time.monotonic() - started < 10  # well inside the 15 s grace
    idle_feed.put(None)
    busy_feed.put(None)
