"""DerenderService over real gRPC (port 0): streams, n=2, errors that leave the server working."""

from __future__ import annotations

import queue
import random
import time

import grpc
import pytest

from tito.grpc_errors import error_details
from tito.v1 import derender_pb2, derender_pb2_grpc, engine_pb2, sampling_pb2
from tito_derender.config import DerenderConfig
from tito_derender.server import create_server

from parser_streams import random_pieces

DEADLINE = 20


@pytest.fixture
def server(aio_server, tiny_text_model):
    return aio_server(lambda: create_server(DerenderConfig(address="127.0.0.1:0", model=str(tiny_text_model))))


@pytest.fixture
def stub(server):
    channel = server.channel()
    yield derender_pb2_grpc.DerenderServiceStub(channel)
    channel.close()


def context_message(**fields) -> derender_pb2.DerenderRequest:
    return derender_pb2.DerenderRequest(context=derender_pb2.DerenderContext(**fields))


def engine_message(**fields) -> derender_pb2.DerenderRequest:
    return derender_pb2.DerenderRequest(generate_response=engine_pb2.GenerateResponse(**fields))


def test_stream_content_equals_decode_with_finish_and_usage(stub, hf_tokenizer):
    prompt_ids = hf_tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False)
    ids = hf_tokenizer.encode(" Hello 日本, café 🎉!", add_special_tokens=False)
    im_end = hf_tokenizer.convert_tokens_to_ids("<|im_end|>")
    requests = [context_message(request_id="it-1", prompt_tail_token_ids=prompt_ids[-3:], prompt_tokens=7)]
    requests += [engine_message(index=0, token_ids=piece) for piece in random_pieces(ids, random.Random(5), 4)]
    requests.append(engine_message(index=0, token_ids=[im_end], finish_reason=engine_pb2.FINISH_REASON_STOP,
                                   matched_stop_token_id=im_end,
                                   usage=engine_pb2.Usage(prompt_tokens=7, completion_tokens=len(ids) + 1)))
    chunks = [r.chunk for r in stub.Derender(iter(requests), timeout=DEADLINE)]
    assert "".join(c.content for c in chunks) == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert chunks[0].role == "assistant" and all(c.role == "" for c in chunks[1:])
    assert all(c.content for c in chunks[:-1])
    last = chunks[-1]
    assert last.finish_reason == engine_pb2.FINISH_REASON_STOP and last.matched_stop == "<|im_end|>"
    assert last.HasField("usage") and (last.usage.prompt_tokens, last.usage.completion_tokens) == (7, len(ids) + 1)
    assert not any(c.HasField("usage") for c in chunks[:-1])


def test_special_tokens_kept_when_asked(stub, hf_tokenizer):
    ids = hf_tokenizer.encode("a<|im_end|><|im_start|>b", add_special_tokens=False)
    options = sampling_pb2.OutputTextOptions(skip_special_tokens=False, spaces_between_special_tokens=False)
    requests = [context_message(text_options=options),
                *[engine_message(index=0, token_ids=[i]) for i in ids],
                engine_message(index=0, finish_reason=engine_pb2.FINISH_REASON_LENGTH)]
    chunks = [r.chunk for r in stub.Derender(iter(requests), timeout=DEADLINE)]
    assert "".join(c.content for c in chunks) == hf_tokenizer.decode(ids, skip_special_tokens=False)
    assert chunks[-1].finish_reason == engine_pb2.FINISH_REASON_LENGTH


def test_two_choices_multiplexed(stub, hf_tokenizer):
    texts = ["first 日本", "second 🎉 café"]
    ids = [hf_tokenizer.encode(t, add_special_tokens=False) for t in texts]
    requests = [context_message(n=2, prompt_tokens=3)]
    for step in range(max(map(len, ids))):
        for index in (1, 0):
            if step < len(ids[index]):
                requests.append(engine_message(index=index, token_ids=[ids[index][step]]))
    requests.append(engine_message(index=0, finish_reason=engine_pb2.FINISH_REASON_STOP))
    requests.append(engine_message(index=1, finish_reason=engine_pb2.FINISH_REASON_STOP))
    chunks = [r.chunk for r in stub.Derender(iter(requests), timeout=DEADLINE)]
    for index, text in enumerate(texts):
        mine = [c for c in chunks if c.index == index]
        assert "".join(c.content for c in mine) == text
        assert mine[0].role == "assistant" and mine[-1].finish_reason == engine_pb2.FINISH_REASON_STOP
    assert chunks[-1].usage.completion_tokens == len(ids[0]) + len(ids[1])


def assert_invalid(error: grpc.RpcError, field: str) -> None:
    details = error_details(error)
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT, details
    assert field in details["fields"], details


def test_errors_name_the_field_and_the_next_stream_works(stub, hf_tokenizer):
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Derender(iter([engine_message(index=0, token_ids=[1])]), timeout=DEADLINE))
    assert_invalid(error.value, "context")
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Derender(iter([context_message(), context_message()]), timeout=DEADLINE))
    assert_invalid(error.value, "context")
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Derender(iter([context_message(), engine_message(index=0, token_ids=[5, 10**6])]),
                           timeout=DEADLINE))
    assert_invalid(error.value, "generate_response.token_ids[1]")
    with pytest.raises(grpc.RpcError) as error:
        list(stub.Derender(iter([context_message(n=1), engine_message(index=1, token_ids=[5])]), timeout=DEADLINE))
    assert_invalid(error.value, "generate_response.index")
    # The server is unharmed: a good stream right after.
    ids = hf_tokenizer.encode("still fine", add_special_tokens=False)
    chunks = [r.chunk for r in stub.Derender(iter([
        context_message(), engine_message(index=0, token_ids=ids, finish_reason=engine_pb2.FINISH_REASON_STOP)]),
        timeout=DEADLINE)]
    assert [c.content for c in chunks] == ["still fine"]


def test_dropped_stream_releases_its_state(server, stub, hf_tokenizer):
    servicer = server.running.derender_servicer
    outgoing: queue.Queue = queue.Queue()

    def requests():
        while (item := outgoing.get()) is not None:
            yield item

    call = stub.Derender(requests(), timeout=DEADLINE)
    outgoing.put(context_message(request_id="dropped"))
    outgoing.put(engine_message(index=0, token_ids=hf_tokenizer.encode("partial", add_special_tokens=False)))
    assert next(call).chunk.content == "partial"
    assert servicer.live_streams == 1
    call.cancel()
    outgoing.put(None)
    deadline = time.monotonic() + 10
    while servicer.live_streams and time.monotonic() < deadline:
        time.sleep(0.02)
    assert servicer.live_streams == 0


def test_derender_full(stub, hf_tokenizer):
    ids = hf_tokenizer.encode("complete answer 日本", add_special_tokens=False)
    request = derender_pb2.DerenderFullRequest(
        context=derender_pb2.DerenderContext(prompt_tokens=6, n=1),
        responses=[engine_pb2.GenerateResponse(index=0, token_ids=ids[:2]),
                   engine_pb2.GenerateResponse(index=0, token_ids=ids[2:],
                                               finish_reason=engine_pb2.FINISH_REASON_LENGTH)])
    response = stub.DerenderFull(request, timeout=DEADLINE)
    [choice] = response.choices
    assert choice.message.role == "assistant" and choice.message.content == "complete answer 日本"
    assert choice.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    assert (response.usage.prompt_tokens, response.usage.completion_tokens) == (6, len(ids))
    with pytest.raises(grpc.RpcError) as error:
        stub.DerenderFull(derender_pb2.DerenderFullRequest(
            responses=[engine_pb2.GenerateResponse(index=0, token_ids=[10**6])]), timeout=DEADLINE)
    assert_invalid(error.value, "responses[0].token_ids[0]")


def test_detokenize_bad_id_then_good_call(stub, hf_tokenizer):
    with pytest.raises(grpc.RpcError) as error:
        stub.Detokenize(derender_pb2.DetokenizeRequest(token_ids=[1, 2, 5000]), timeout=DEADLINE)
    assert_invalid(error.value, "token_ids[2]")
    ids = hf_tokenizer.encode("x<|im_end|> 日本", add_special_tokens=False)
    skipped = stub.Detokenize(derender_pb2.DetokenizeRequest(token_ids=ids), timeout=DEADLINE)
    assert skipped.text == hf_tokenizer.decode(ids, skip_special_tokens=True)
    kept = stub.Detokenize(derender_pb2.DetokenizeRequest(token_ids=ids, skip_special_tokens=False),
                           timeout=DEADLINE)
    assert kept.text == hf_tokenizer.decode(ids, skip_special_tokens=False)


def test_health_is_serving_once_created(server):
    from grpc_health.v1 import health_pb2, health_pb2_grpc
    with server.channel() as channel:
        health = health_pb2_grpc.HealthStub(channel)
        status = health.Check(health_pb2.HealthCheckRequest(service="tito.v1.DerenderService"), timeout=DEADLINE)
    assert status.status == health_pb2.HealthCheckResponse.SERVING


def test_a_stream_resumes_from_the_state_it_returned(stub, hf_tokenizer):
    """return_state ends the stream with its sealed state; resume_state continues it, so one
    stream per chunk gives one stream's text, and a changed state is INVALID_ARGUMENT."""
    ids = hf_tokenizer.encode(" Hello 日本, café 🎉!", add_special_tokens=False)
    state, text = b"", ""
    for position, token in enumerate(ids):
        last = position == len(ids) - 1
        context = (derender_pb2.DerenderContext(resume_state=state, return_state=True) if state
                   else derender_pb2.DerenderContext(prompt_tokens=3, return_state=True))
        replies = list(stub.Derender(iter([derender_pb2.DerenderRequest(context=context), engine_message(
            index=0, token_ids=[token], finish_reason=engine_pb2.FINISH_REASON_LENGTH if last else 0)]),
            timeout=DEADLINE))
        assert replies[-1].stream_state and not replies[-1].HasField("chunk")
        state = replies[-1].stream_state
        text += "".join(reply.chunk.content for reply in replies[:-1])
    assert text == hf_tokenizer.decode(ids, skip_special_tokens=True)
    assert replies[-2].chunk.finish_reason == engine_pb2.FINISH_REASON_LENGTH
    changed = state[:-1] + bytes([state[-1] ^ 1])
    with pytest.raises(grpc.RpcError) as refused:
        list(stub.Derender(iter([context_message(resume_state=changed)]), timeout=DEADLINE))
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    details = error_details(refused.value)
    assert details["fields"] == ["context.resume_state"] and details["reason"] == "STREAM_STATE_INVALID"
