"""The router's side of prefill/decode: the two parts of a request, the handle read from the
prefill stream, and a migrated continuation that never reuses a spent handle."""

from __future__ import annotations

import asyncio
import contextlib

import grpc
import pytest

from tito.v1 import engine_pb2, sampling_pb2
from tito_client.disaggregation import decode_request, handle_of, place, place_blocking, prefill_request
from tito_client.migration import RequestProgress
from tito_client.routing import Choice


def original() -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(request_id="chat-1", token_ids=[5, 6, 7], cache_salt="t",
                                      sampling_params=sampling_pb2.SamplingParams(max_tokens=9))


def test_the_prefill_part_asks_for_a_pin_under_its_own_id_and_the_decode_part_carries_the_handle():
    request = original()
    prefill = prefill_request(request)
    assert prefill.kv_transfer.WhichOneof("role") == "prefill" and prefill.request_id == "chat-1~prefill"
    assert list(prefill.token_ids) == [5, 6, 7] and not request.HasField("kv_transfer")  # the original is untouched
    handle = engine_pb2.KvTransferHandle(transfer_id="ab" * 16, block_count=1)
    decode = decode_request(request, handle, "10.0.0.1:50052")
    assert decode.request_id == "chat-1" and decode.cache_salt == "t"
    assert decode.kv_transfer.decode.handle == handle and decode.kv_transfer.decode.source_address == "10.0.0.1:50052"


def test_the_handle_is_read_from_the_prefill_stream_and_its_absence_is_an_error():
    handle = engine_pb2.KvTransferHandle(transfer_id="cd" * 16)
    assert handle_of([engine_pb2.GenerateResponse(token_ids=[3]),
                      engine_pb2.GenerateResponse(kv_transfer_handle=handle)]) == handle
    with pytest.raises(RuntimeError, match="without a KV transfer handle"):
        handle_of([engine_pb2.GenerateResponse(token_ids=[3])])


def test_a_continuation_of_a_decode_part_prefills_on_its_new_engine():
    decode = decode_request(original(), engine_pb2.KvTransferHandle(transfer_id="ef" * 16), "10.0.0.1:50052")
    progress = RequestProgress(decode)
    progress.record(engine_pb2.GenerateResponse(token_ids=[11, 12]))
    continuation, _ = progress.next_call()
    assert not continuation.HasField("kv_transfer")  # the handle was spent by the engine that died
    assert list(continuation.token_ids) == [5, 6, 7, 11, 12]


class RecordingRouter:
    """The router's calls `place` makes, recorded; every prompt is long enough to split."""

    def __init__(self):
        self.picks: list[str] = []

    def pick(self, request, avoid=None, role="decode"):
        self.picks.append(role)
        return Choice(f"{role}-engine:1", 0, "least_load")

    def disaggregates(self, request, decode=None):
        return True

    @contextlib.contextmanager
    def track(self, address):
        yield


def test_place_prefills_then_decodes_and_leaves_a_part_the_caller_split_as_it_is():
    router = RecordingRouter()
    handle = engine_pb2.KvTransferHandle(transfer_id="12" * 16)
    sent = []

    async def prefill(address, request):
        sent.append((address, request.kv_transfer.WhichOneof("role")))
        return handle

    address, decode = asyncio.run(place(router, original(), prefill))
    assert sent == [("prefill-engine:1", "prefill")] and address == "decode-engine:1"
    assert decode.kv_transfer.decode.handle == handle and decode.kv_transfer.decode.source_address == "prefill-engine:1"
    router.picks.clear()
    for part, role in ((prefill_request(original()), "prefill"), (decode, "decode")):
        assert asyncio.run(place(router, part, prefill)) == (f"{role}-engine:1", part)  # not split again
    assert router.picks == ["prefill", "decode"] and len(sent) == 1
    assert place_blocking(router, decode, lambda address, request: handle) == ("decode-engine:1", decode)


class Refusal(grpc.RpcError):
    def __init__(self, code):
        self._code = code

    def code(self):
        return self._code

    def details(self):
        return "refused"

    def trailing_metadata(self):
        return ()


def test_a_prefill_engine_that_is_gone_leaves_the_prefill_to_the_decode_engine_and_a_refusal_is_raised():
    def prefill_with(code):
        def prefill(address, request):
            raise Refusal(code)
        return prefill

    request = original()
    assert place_blocking(RecordingRouter(), request, prefill_with(grpc.StatusCode.UNAVAILABLE)) == \
        ("decode-engine:1", request)  # unchanged: the decode engine computes the whole prompt
    with pytest.raises(grpc.RpcError):
        place_blocking(RecordingRouter(), request, prefill_with(grpc.StatusCode.INVALID_ARGUMENT))

