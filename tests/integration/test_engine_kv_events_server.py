"""EngineService.SubscribeKvEvents and ResetPrefixCache over real gRPC (port 0): the stream follows
the prefix cache live, replays from a sequence number, and refuses a dropped one with the way to
resync."""

from __future__ import annotations

import grpc
import pytest

from tito.grpc_errors import error_details
from tito.v1 import engine_pb2, engine_pb2_grpc
from tito_engine.config import EngineConfig
from tito_engine.server import create_server

from engine_calls import collect, request

TIMEOUT = 30
BLOCK = 4


@pytest.fixture
def engine(aio_server, tiny_text_model):
    def start(**overrides):
        config = EngineConfig(model=str(tiny_text_model), device="cpu", engine_process=False, max_model_len=64,
                              block_size=BLOCK, kv_blocks=12, **overrides)
        server = aio_server(lambda: create_server(config))
        return engine_pb2_grpc.EngineServiceStub(server.channel())
    return start


def subscribe(stub, start=None):
    message = engine_pb2.SubscribeKvEventsRequest()
    if start is not None:
        message.start_sequence = start
    return stub.SubscribeKvEvents(message, timeout=TIMEOUT)


def apply(view: dict, batch: engine_pb2.SubscribeKvEventsResponse) -> None:
    for event in batch.events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            stored = event.block_stored
            for index, digest in enumerate(stored.block_hashes):
                assert digest not in view
                view[digest] = (tuple(stored.token_ids[index * BLOCK:(index + 1) * BLOCK]),
                                stored.extra_keys[index].cache_salt if stored.extra_keys else "")
        elif kind == "block_removed":
            for digest in event.block_removed.block_hashes:
                del view[digest]
        else:
            assert kind == "all_blocks_cleared"
            view.clear()


def test_a_live_stream_and_a_late_replay_see_the_same_cache(engine):
    stub = engine()
    live = subscribe(stub, start=0)
    prompts = [[(13 * i + j) % 997 for j in range(10)] for i in range(5)]
    for index, prompt in enumerate(prompts):
        tokens, _ = collect(stub.Generate(request(prompt, max_tokens=3, ignore_eos=True), timeout=TIMEOUT))
        assert len(tokens[0]) == 3
    salted = request(prompts[0], max_tokens=3, ignore_eos=True)
    salted.cache_salt = "tenant-b"
    collect(stub.Generate(salted, timeout=TIMEOUT))
    stub.ResetPrefixCache(engine_pb2.ResetPrefixCacheRequest(), timeout=TIMEOUT)
    collect(stub.Generate(request(prompts[1], max_tokens=3, ignore_eos=True), timeout=TIMEOUT))

    # Each prompt stored 2 full blocks (the block with its last token is never cached) ...
    view, sequences, kinds = {}, [], []
    while True:
        batch = next(live)
        sequences.append(batch.sequence)
        kinds.extend(event.WhichOneof("event") for event in batch.events)
        apply(view, batch)
        if "all_blocks_cleared" in kinds and len(view) == 2:
            break
    assert sequences == list(range(len(sequences)))
    assert batch.timestamp > 1.7e9
    assert kinds.count("block_removed") >= 1 and kinds.count("all_blocks_cleared") == 1
    first = next(event.block_stored for event in next(subscribe(stub, start=0)).events)
    assert first.block_size == BLOCK and first.medium == "CPU" and not first.HasField("parent_block_hash")
    assert list(first.token_ids) == prompts[0][:2 * BLOCK]
    assert sorted(tokens for tokens, _ in view.values()) == sorted(
        [tuple(prompts[1][:BLOCK]), tuple(prompts[1][BLOCK:2 * BLOCK])])

    # A subscriber that joins later replays from any buffered sequence to the same view.
    late, replay = {}, subscribe(stub, start=0)
    for _ in sequences:
        apply(late, next(replay))
    assert late == view
    live.cancel()
    replay.cancel()


def test_a_dropped_sequence_is_refused_with_how_to_resync(engine):
    stub = engine(kv_events_buffer=2)
    for index in range(4):  # at least one stored batch each: 4 batches, the first 2 dropped
        collect(stub.Generate(request([index + 5] * 9, max_tokens=1), timeout=TIMEOUT))
    with pytest.raises(grpc.RpcError) as exc:
        next(subscribe(stub, start=0))
    details = error_details(exc.value)
    assert (details["code"], details["reason"]) == (grpc.StatusCode.OUT_OF_RANGE, "KV_EVENTS_SEQUENCE_DROPPED")
    assert "resync" in details["message"]
    oldest = int(details["metadata"]["oldest_sequence"])
    assert oldest == 2 and details["metadata"]["next_sequence"] == "4"
    assert next(subscribe(stub, start=oldest)).sequence == oldest
    with pytest.raises(grpc.RpcError) as exc:
        next(subscribe(stub, start=1000))
    assert error_details(exc.value)["reason"] == "KV_EVENTS_SEQUENCE_AHEAD"
