"""--backend vllm relays vLLM's own KV events through SubscribeKvEvents: every stored block once, with
its tokens and salt, in order; what vLLM's prefix cache then serves (usage.cached_tokens) is what
the events said it holds; a reset arrives as AllBlocksCleared; a late subscriber replays to the
same view."""

from __future__ import annotations

import pytest

from tito.v1 import engine_pb2, engine_pb2_grpc
from tito_engine.config import EngineConfig
from tito_engine.server import create_server

from engine_calls import collect, request

pytestmark = pytest.mark.vllm

TIMEOUT = 120
BLOCK = 32  # vLLM's CPU attention wants a multiple of 32
VLLM_ARGS = ("--dtype", "float32", "--enforce-eager", "--gpu-memory-utilization", "0.05")


@pytest.fixture(scope="module")
def stub(module_aio_server, tiny_text_model_d64):
    config = EngineConfig(backend="vllm", model=str(tiny_text_model_d64), max_model_len=256, block_size=BLOCK,
                          kv_cache_bytes=32 << 20, vllm_args=VLLM_ARGS)
    return engine_pb2_grpc.EngineServiceStub(module_aio_server(lambda: create_server(config)).channel())


def apply(view: dict, batch) -> None:
    for event in batch.events:
        kind = event.WhichOneof("event")
        if kind == "block_stored":
            stored = event.block_stored
            assert stored.block_size == BLOCK
            parent = stored.parent_block_hash if stored.HasField("parent_block_hash") else None
            for index, digest in enumerate(stored.block_hashes):
                assert digest not in view, "a block is reported stored once"
                salt = stored.extra_keys[index].cache_salt if stored.extra_keys else ""
                view[digest] = (tuple(stored.token_ids[index * BLOCK:(index + 1) * BLOCK]), salt, parent)
                parent = digest
        elif kind == "block_removed":
            for digest in event.block_removed.block_hashes:
                assert digest in view, "only a stored block is removed"
                del view[digest]
        else:
            view.clear()


def chain(view: dict, prompt: list[int], salt: str = "") -> int:
    """Full blocks of `prompt` the view holds, as a router matches them: from the first block on,
    by tokens, salt and parent."""
    parent, found = None, 0
    for index in range(len(prompt) // BLOCK):
        tokens = tuple(prompt[index * BLOCK:(index + 1) * BLOCK])
        match = [digest for digest, (t, s, p) in view.items()
                 if t == tokens and p == parent and s == (salt if index == 0 else "")]
        if not match:
            break
        parent, found = match[0], found + 1
    return found


def cached_tokens(stub, prompt, salt=""):
    message = request(prompt, max_tokens=2, ignore_eos=True)
    message.cache_salt = salt
    _, finals = collect(stub.Generate(message, timeout=TIMEOUT))
    return finals[0].usage.cached_tokens


def drain(stream, view, until_sequence):
    last = -1
    while last < until_sequence:
        batch = next(stream)
        assert batch.sequence == last + 1, "batches arrive in order, none missing"
        last = batch.sequence
        apply(view, batch)
    return last


def test_vllm_events_are_relayed_and_match_what_its_cache_serves(stub):
    live = stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(start_sequence=0), timeout=TIMEOUT)
    system = [(11 * i) % 997 + 3 for i in range(3 * BLOCK)]
    first, second = system + [5, 6, 7], system + [9, 9]
    assert cached_tokens(stub, first) == 0
    assert cached_tokens(stub, first, salt="tenant-b") == 0
    view = {}
    # The three system blocks arrive as stored, once per salt, with their tokens and the salt on block 0.
    while chain(view, first) < 3 or chain(view, first, "tenant-b") < 3:
        apply(view, next(live))
    assert cached_tokens(stub, second) == 3 * BLOCK  # vLLM serves exactly what its events announced

    stub.ResetPrefixCache(engine_pb2.ResetPrefixCacheRequest(), timeout=TIMEOUT)
    cached_tokens(stub, [3, 4, 5])  # vLLM publishes the clear with its next step
    kinds = []
    while "all_blocks_cleared" not in kinds:
        batch = next(live)
        kinds.extend(event.WhichOneof("event") for event in batch.events)
        apply(view, batch)
    assert chain(view, first) == 0 and cached_tokens(stub, second) == 0

    # A late subscriber replays from 0 to the live subscriber's view.
    late = {}
    replay = stub.SubscribeKvEvents(engine_pb2.SubscribeKvEventsRequest(start_sequence=0), timeout=TIMEOUT)
    drain(replay, late, batch.sequence)
    replay.cancel()
    live.cancel()
    assert late == view
