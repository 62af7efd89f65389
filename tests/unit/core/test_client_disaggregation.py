"""The router's side of prefill/decode: the two parts of a request, the handle read from the
prefill stream, and a migrated continuation that never reuses a spent handle."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging

import grpc
import pytest

from tito.kv_params import REMOTE_DECODE
from tito.v1 import engine_pb2, sampling_pb2
from tito_client.disaggregation import place, place_blocking
from tito_client.kv_protocols import (VllmConnectorTransfer, connector_prefill_request, decode_request, handle_of,
                                      prefill_request)
from tito_client.migration import RequestProgress
from tito_client.routing import Choice, NoEngineAvailable


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

    def __init__(self, kv_protocol=engine_pb2.KV_TRANSFER_PROTOCOL_TITO, prefill_protocol=None):
        self.picks: list[str] = []
        self.protocols = {"decode": kv_protocol,
                          "prefill": kv_protocol if prefill_protocol is None else prefill_protocol}
        self.seen: set[str] = set()

    def pick(self, request, avoid=None, role="decode", pair_with=None):
        self.picks.append(role)
        choice = Choice(f"{role}-engine:1", 0, "least_load", kv_protocol=self.protocols[role])
        if pair_with is not None and choice.kv_protocol != pair_with.kv_protocol:
            raise NoEngineAvailable("none speaks it")
        return choice

    def disaggregates(self, request, decode=None):
        return True

    def first_time(self, key):
        new = key not in self.seen
        self.seen.add(key)
        return new

    @contextlib.contextmanager
    def track(self, address):
        yield


def test_place_prefills_then_decodes_and_leaves_a_part_the_caller_split_as_it_is():
    router = RecordingRouter()
    handle = engine_pb2.KvTransferHandle(transfer_id="12" * 16)
    sent = []

    async def prefill(address, request):
        sent.append((address, request.kv_transfer.WhichOneof("role")))
        return [engine_pb2.GenerateResponse(kv_transfer_handle=handle)]

    address, decode = asyncio.run(place(router, original(), prefill))
    assert sent == [("prefill-engine:1", "prefill")] and address == "decode-engine:1"
    assert decode.kv_transfer.decode.handle == handle and decode.kv_transfer.decode.source_address == "prefill-engine:1"
    router.picks.clear()
    for part, role in ((prefill_request(original()), "prefill"), (decode, "decode")):
        assert asyncio.run(place(router, part, prefill)) == (f"{role}-engine:1", part)  # not split again
    assert router.picks == ["prefill", "decode"] and len(sent) == 1
    assert place_blocking(router, decode, lambda address, request: []) == ("decode-engine:1", decode)


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



# ------------------------------------------------------------------------------ vLLM's connector protocol

def test_vllms_prefill_part_asks_for_a_remote_decode_of_one_token_and_the_decode_part_carries_the_answer():
    request = original()
    request.sampling_params.min_tokens, request.sampling_params.n = 4, 2
    prefill = connector_prefill_request(request)
    assert json.loads(prefill.kv_transfer.connector_params_json) == REMOTE_DECODE
    assert prefill.kv_transfer.WhichOneof("role") is None and prefill.request_id == "chat-1~prefill"
    sampling = prefill.sampling_params
    assert (sampling.max_tokens, sampling.n, sampling.min_tokens) == (1, 1, 0)
    answer = '{"do_remote_prefill":true,"remote_block_ids":[[4,5]],"remote_engine_id":"p"}'
    decode = VllmConnectorTransfer.decode_request(request, [engine_pb2.GenerateResponse(token_ids=[3]),
                                                            engine_pb2.GenerateResponse(kv_connector_params_json=answer)],
                                                  "p:1")
    assert decode.kv_transfer.connector_params_json == answer  # byte for byte: the connector reads it, not tito
    assert decode.sampling_params == request.sampling_params and decode.request_id == "chat-1"
    # A prefill whose connector gave no answer: the decode engine gets the request as it is.
    assert VllmConnectorTransfer.decode_request(request, [engine_pb2.GenerateResponse(token_ids=[3])], "p:1") == request


def test_place_drives_a_vllm_pair_through_the_connectors_params():
    router = RecordingRouter(engine_pb2.KV_TRANSFER_PROTOCOL_VLLM_CONNECTOR)
    sent = []

    async def prefill(address, request):
        sent.append((address, json.loads(request.kv_transfer.connector_params_json)))
        return [engine_pb2.GenerateResponse(kv_connector_params_json='{"remote_engine_id":"p"}')]

    address, decode = asyncio.run(place(router, original(), prefill))
    assert sent == [("prefill-engine:1", REMOTE_DECODE)] and address == "decode-engine:1"
    assert decode.kv_transfer.connector_params_json == '{"remote_engine_id":"p"}'


@pytest.mark.parametrize("decode_protocol, prefill_protocol, warned", [
    (engine_pb2.KV_TRANSFER_PROTOCOL_VLLM_CONNECTOR, engine_pb2.KV_TRANSFER_PROTOCOL_TITO, True),
    (engine_pb2.KV_TRANSFER_PROTOCOL_TITO, engine_pb2.KV_TRANSFER_PROTOCOL_VLLM_CONNECTOR, True),
    (engine_pb2.KV_TRANSFER_PROTOCOL_NONE, engine_pb2.KV_TRANSFER_PROTOCOL_NONE, False),  # takes no part
])
def test_a_decode_engine_without_a_prefill_engine_of_its_protocol_prefills_itself(decode_protocol, prefill_protocol,
                                                                                   warned, caplog):
    router = RecordingRouter(decode_protocol, prefill_protocol)

    def prefill(address, request):
        raise AssertionError("no prefill engine pairs with the decode engine")

    request = original()
    with caplog.at_level(logging.WARNING, logger="tito_client.disaggregation"):
        for _ in range(2):
            assert place_blocking(router, request, prefill) == ("decode-engine:1", request)
    warnings = [r.getMessage() for r in caplog.records if r.name == "tito_client.disaggregation"]
    assert [w.startswith("no prefill engine pairs with decode engine decode-engine:1") for w in warnings] == \
        ([True] if warned else [])  # once, not per request
