"""The engine's KV events on vLLM's ZMQ wire (--kv-events-endpoint): the frames are decoded by the
installed vLLM's own KVEventBatch decoder (not a copy) and equal the SubscribeKvEvents stream;
the replay endpoint answers vLLM's replay protocol."""

from __future__ import annotations

import pytest
import zmq

from tito.v1 import engine_pb2, engine_pb2_grpc
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_engine.kv_publisher import bind_address

from engine_calls import collect, request

pytestmark = pytest.mark.vllm

TIMEOUT = 30
BLOCK = 4
TOPIC = b"kv@tito"
MASK = (1 << 64) - 1


@pytest.fixture
def engine(aio_server, tiny_text_model):
    config = EngineConfig(model=str(tiny_text_model), device="cpu", engine_process=False, max_model_len=64,
                          block_size=BLOCK, kv_blocks=12, kv_events_endpoint="tcp://*:0",
                          kv_events_replay_endpoint="tcp://*:0", kv_events_topic=TOPIC.decode())
    server = aio_server(lambda: create_server(config))
    return engine_pb2_grpc.EngineServiceStub(server.channel()), server.running.endpoints


def _hash(digest: bytes) -> int:
    return int.from_bytes(digest, "big") & MASK


def as_vllm(batch: engine_pb2.SubscribeKvEventsResponse):
    """The gRPC batch as vLLM's structs, by the documented mapping (ids as 64-bit ints)."""
    from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

    events = []
    for event in batch.events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            stored = event.block_stored
            extra = None
            lora = [stored.lora_name] if stored.lora_name else []
            if stored.extra_keys or lora:
                entries = stored.extra_keys or [engine_pb2.BlockExtraKeys()] * len(stored.block_hashes)
                extra = [tuple([*lora, *([key.mm_hash, key.offset] for key in keys.media),
                                *([keys.cache_salt] if keys.cache_salt else [])]) or None
                         for keys in entries]
            events.append(BlockStored(
                block_hashes=[_hash(h) for h in stored.block_hashes],
                parent_block_hash=_hash(stored.parent_block_hash) if stored.HasField("parent_block_hash") else None,
                token_ids=list(stored.token_ids), block_size=stored.block_size, lora_id=None,
                medium=stored.medium or None, lora_name=stored.lora_name or None, extra_keys=extra))
        elif kind == "block_removed":
            events.append(BlockRemoved(block_hashes=[_hash(h) for h in event.block_removed.block_hashes],
                                       medium=event.block_removed.medium or None))
        else:
            events.append(AllBlocksCleared())
    return KVEventBatch(ts=batch.timestamp, events=events)


def test_zmq_frames_decode_with_vllms_decoder_and_equal_the_grpc_stream(engine):
    import msgspec
    from vllm.distributed.kv_events import BlockStored, KVEventBatch

    stub, endpoints = engine
    assert endpoints["kv_events"].startswith("tcp://127.0.0.1:")  # tcp://* binds loopback unless told
    context = zmq.Context.instance()
    sub = context.socket(zmq.SUB)
    sub.connect(endpoints["kv_events"])
    sub.setsockopt(zmq.SUBSCRIBE, TOPIC)
    # A SUB socket joins asynchronously: publish until it hears something, then start counting.
    grpc_stream = stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(start_sequence=0), timeout=TIMEOUT)
    decoder = msgspec.msgpack.Decoder(type=KVEventBatch)
    salted = request([(7 * j) % 997 for j in range(10)], max_tokens=2, ignore_eos=True)
    salted.cache_salt = "tenant-a"
    prompts = [request([(13 * i + j) % 997 for j in range(10)], max_tokens=2, ignore_eos=True) for i in range(6)]
    received = {}
    for generate in [salted, *prompts]:
        collect(stub.Generate(generate, timeout=TIMEOUT))
        while sub.poll(2000):
            topic, sequence, payload = sub.recv_multipart()
            assert topic == TOPIC and len(sequence) == 8
            received[int.from_bytes(sequence, "big")] = decoder.decode(payload)
    stub.ResetPrefixCache(engine_pb2.ResetPrefixCacheRequest(), timeout=TIMEOUT)
    assert sub.poll(5000)
    topic, sequence, payload = sub.recv_multipart()
    received[int.from_bytes(sequence, "big")] = decoder.decode(payload)
    assert received, "the subscriber heard nothing"

    grpc_batches = {}
    while len(grpc_batches) <= max(received):
        batch = next(grpc_stream)
        grpc_batches[batch.sequence] = batch
    grpc_stream.cancel()
    for sequence, decoded in received.items():
        assert decoded == as_vllm(grpc_batches[sequence]), sequence
    stored = [event for batch in received.values() for event in batch.events if isinstance(event, BlockStored)]
    assert any(event.extra_keys == [("tenant-a",), None] for event in stored)
    kinds = {type(event).__name__ for batch in received.values() for event in batch.events}
    assert kinds == {"BlockStored", "BlockRemoved", "AllBlocksCleared"}

    # Replay, vLLM's protocol: a DEALER sends (b"", start) and gets every buffered batch, then END.
    dealer = context.socket(zmq.DEALER)
    dealer.connect(endpoints["kv_events_replay"])
    dealer.send_multipart((b"", (0).to_bytes(8, "big")))
    replayed = []
    while True:
        assert dealer.poll(5000)
        _, topic, sequence, payload = dealer.recv_multipart()
        if int.from_bytes(sequence, "big", signed=True) == -1:
            break
        assert topic == TOPIC
        replayed.append((int.from_bytes(sequence, "big"), decoder.decode(payload)))
    assert [sequence for sequence, _ in replayed] == sorted(grpc_batches)
    for sequence, decoded in replayed:
        assert decoded == as_vllm(grpc_batches[sequence])
    sub.close(0)
    dealer.close(0)


def test_wildcard_binds_loopback_unless_public():
    assert bind_address("tcp://*:5557", public=False) == "tcp://127.0.0.1:5557"
    assert bind_address("tcp://*:5557", public=True) == "tcp://*:5557"
    assert bind_address("tcp://10.0.0.5:5557", public=False) == "tcp://10.0.0.5:5557"
