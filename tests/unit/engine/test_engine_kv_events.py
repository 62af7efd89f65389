"""KV cache events of the native engine, checked against the engine's own prefix cache: every
stored, evicted and cleared block reported once, in order, with its tokens and keys; a late
subscriber replays to the same view; the bounded log says how to resync."""

from __future__ import annotations

import asyncio

import pytest

from tito.errors import OutOfRange
from tito_engine.core.engine import Engine
from tito_engine.kv_events import (AllBlocksCleared, BlockKeys, BlockRemoved, BlockStored, KvEventLog, MediaKey)
from tito_engine.limits import SchedulerLimits
from tito_engine.model.runner import KVCacheSpec, ModelRunner
from tito_engine.request import GenerateInput, RawSamplingParams
from tito_engine.scheduling.blocks import BlockMedia, block_extra_keys, prefix_block_hashes
from tito_engine.backend.admission import Admission
from tito_render.convert import chat_response

BLOCK = 4


class CacheView:
    """What a router knows of one engine after applying its events in order."""

    def __init__(self):
        self.blocks: dict[bytes, tuple[tuple[int, ...], BlockKeys | None, bytes | None]] = {}
        self.next_sequence = 0

    def apply(self, batch) -> None:
        assert batch.sequence == self.next_sequence, "batches arrive in order, none missing"
        self.next_sequence += 1
        for event in batch.events:
            if isinstance(event, BlockStored):
                assert event.block_size == BLOCK and event.medium == "CPU"
                assert len(event.token_ids) == BLOCK * len(event.block_hashes)
                parent = event.parent_block_hash
                assert parent is None or parent in self.blocks, "a stored run continues a block still held"
                keys = event.extra_keys or (None,) * len(event.block_hashes)
                for index, digest in enumerate(event.block_hashes):
                    assert digest not in self.blocks, "a block is reported stored once"
                    self.blocks[digest] = (tuple(event.token_ids[index * BLOCK:(index + 1) * BLOCK]), keys[index],
                                           parent)
                    parent = digest
            elif isinstance(event, BlockRemoved):
                for digest in event.block_hashes:
                    assert digest in self.blocks, "only a stored block is removed, once"
                    del self.blocks[digest]
            else:
                assert isinstance(event, AllBlocksCleared)
                self.blocks.clear()


@pytest.fixture(scope="module")
def runner(tiny_text_model):
    # 12 blocks of 4 tokens: a handful of prompts evict each other's cached blocks.
    return ModelRunner(tiny_text_model, model_id="tiny", device="cpu", kv_cache=KVCacheSpec(block_size=BLOCK,
                                                                                            num_blocks=12))


async def generate(engine, prompt, salt=""):
    generate_input = GenerateInput("", prompt, RawSamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True),
                                   cache_salt=salt)
    cached = 0
    async for output in engine.generate(Admission.for_backend(engine).admit(generate_input)):
        if output.usage is not None:
            cached = output.usage.cached_tokens
    return cached


def allocator_of(engine):
    return engine._core.core.scheduler.kv.allocator


async def drain(iterator, view, until):
    while view.next_sequence < until:
        view.apply(await asyncio.wait_for(iterator.__anext__(), 10))


def test_events_mirror_the_prefix_cache_and_a_late_subscriber_replays_to_the_same_view(runner):
    engine = Engine(runner, limits=SchedulerLimits(max_running_sequences=4))
    engine.start()
    prompts = [[(13 * i + j) % 997 for j in range(10)] for i in range(5)]

    async def main():
        live = CacheView()
        stream = engine.kv_events.subscribe(0)
        cached_again = []
        for prompt in prompts:
            await generate(engine, prompt)
        cached_again.append(await generate(engine, prompts[-1]))  # still cached: a hit
        await generate(engine, prompts[0], salt="tenant-b")
        await drain(stream, live, engine.kv_events.next_sequence)
        allocator = allocator_of(engine)
        # The view built from the events is exactly the engine's prefix cache, tokens included.
        assert set(live.blocks) == set(allocator._by_hash)
        for prompt, salt in [(prompts[-1], ""), (prompts[0], "tenant-b")]:
            hashes = prefix_block_hashes(prompt, BLOCK, salt)
            for index, digest in enumerate(hashes[:2]):
                tokens, keys, parent = live.blocks[digest]
                assert tokens == tuple(prompt[index * BLOCK:(index + 1) * BLOCK])
                assert parent == (hashes[index - 1] if index else None)
                assert keys == (BlockKeys((), salt) if index == 0 and salt else None)
        events = [event for batch in engine.kv_events.since(0) for event in batch.events]
        assert any(isinstance(event, BlockRemoved) for event in events), "the test must force evictions"

        # A subscriber that joins late replays from 0 and reaches the same view; one that saw the
        # first half resumes from its next sequence and reaches it too.
        late, halfway = CacheView(), CacheView()
        await drain(engine.kv_events.subscribe(0), late, live.next_sequence)
        middle = live.next_sequence // 2
        for batch in engine.kv_events.since(0)[:middle]:
            halfway.apply(batch)
        await drain(engine.kv_events.subscribe(middle), halfway, live.next_sequence)
        assert late.blocks == halfway.blocks == live.blocks

        await engine.reset_prefix_cache()
        await drain(stream, live, engine.kv_events.next_sequence)
        assert live.blocks == {} and allocator._by_hash == {}
        assert isinstance(engine.kv_events.since(0)[-1].events[-1], AllBlocksCleared)
        assert await generate(engine, prompts[-1]) == 0  # nothing left to hit
        await drain(stream, live, engine.kv_events.next_sequence)
        assert set(live.blocks) == set(allocator._by_hash) and live.blocks
        await stream.aclose()
        return cached_again

    try:
        assert asyncio.run(main()) == [8]
    finally:
        engine.stop()


def test_the_log_is_bounded_and_says_how_to_resync():
    log = KvEventLog(capacity=3)
    for _ in range(5):
        log.append([AllBlocksCleared()])
    assert [batch.sequence for batch in log.since(2)] == [2, 3, 4] and log.since(5) == []
    with pytest.raises(OutOfRange) as dropped:
        log.since(1)
    assert dropped.value.reason == "KV_EVENTS_SEQUENCE_DROPPED"
    assert dropped.value.metadata == {"oldest_sequence": "2", "next_sequence": "5"}
    assert "resync" in dropped.value.message
    with pytest.raises(OutOfRange) as ahead:
        log.since(6)
    assert ahead.value.reason == "KV_EVENTS_SEQUENCE_AHEAD"
    assert log.append([]) is None and log.next_sequence == 5  # an empty batch is not a batch

    async def subscribe(start):
        async for batch in log.subscribe(start):
            return batch

    with pytest.raises(OutOfRange):
        asyncio.run(subscribe(0))
    assert asyncio.run(subscribe(4)).sequence == 4


def test_a_subscriber_that_falls_behind_the_buffer_is_told_to_resync():
    log = KvEventLog(capacity=2)
    log.append([AllBlocksCleared()])

    async def main():
        stream = log.subscribe(0)
        first = await stream.__anext__()
        for _ in range(3):  # batch 1 is dropped before the subscriber asks for it
            log.append([AllBlocksCleared()])
        with pytest.raises(OutOfRange) as info:
            await stream.__anext__()
        return first.sequence, info.value.reason

    assert asyncio.run(main()) == (0, "KV_EVENTS_SEQUENCE_DROPPED")


def test_media_keys_cover_the_blocks_an_item_overlaps_and_change_the_digest():
    tokens = list(range(100, 116))  # 4 blocks of 4
    image = BlockMedia(offset=3, length=6, content_id="c" * 16, mm_hash="a" * 16)  # blocks 0..2
    keys = block_extra_keys(4, BLOCK, "salt", [image])
    assert keys == [BlockKeys((MediaKey("a" * 16, 3),), "salt"), BlockKeys((MediaKey("a" * 16, -1),)),
                    BlockKeys((MediaKey("a" * 16, -5),)), BlockKeys()]
    plain = prefix_block_hashes(tokens, BLOCK, "salt")
    with_image = prefix_block_hashes(tokens, BLOCK, "salt", [image])
    other_image = prefix_block_hashes(tokens, BLOCK, "salt", [BlockMedia(3, 6, "d" * 16, "a" * 16)])
    # Same tokens, other pixels: no block from the first image on may match (the digest chains).
    assert all(a != b for a, b in zip(plain, with_image)) and all(a != b for a, b in zip(with_image, other_image))
    # The published mm_hash is not what the digest trusts: the content id is.
    assert prefix_block_hashes(tokens, BLOCK, "salt", [BlockMedia(3, 6, "c" * 16, "b" * 16)]) == with_image


# ------------------------------------------------------------------------------ media requests

def test_media_requests_share_cached_blocks_by_content_and_events_carry_their_keys(tiny_vl_model, renderer):
    from tito.v1 import chat_pb2, render_pb2
    from tito_engine.service.convert import generate_input_from_proto

    from images import noise_png

    def render(seed, salt=""):
        request = render_pb2.RenderChatRequest(
            messages=[chat_pb2.ChatMessage(role="user", content_parts=[
                chat_pb2.ContentPart(text="A long shared preamble before the picture, then the picture"),
                chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=noise_png(56, 56, seed))),
                chat_pb2.ContentPart(text="and a question after it")])],
            sampling=render_pb2.SamplingOptions(max_tokens=4, temperature=0.0, ignore_eos=True))
        generate_request = chat_response(renderer, request).generate_request
        generate_request.cache_salt = salt
        return generate_request

    runner = ModelRunner(tiny_vl_model, model_id="vl", device="cpu", kv_cache=KVCacheSpec(block_size=BLOCK,
                                                                                         num_blocks=64))
    engine = Engine(runner, encoder_cache_bytes=1 << 22)
    engine.start()

    async def run(request):
        tokens, cached = [], 0
        async for output in engine.generate(Admission.for_backend(engine).admit(generate_input_from_proto(request))):
            tokens.extend(output.token_ids)
            if output.usage is not None:
                cached = output.usage.cached_tokens
        return tokens, cached

    async def main():
        view = CacheView()
        stream = engine.kv_events.subscribe(0)
        first = render(seed=1)
        item = first.mm_features.items[0]
        start, length = item.placeholder.offset, item.placeholder.length
        tokens, cached = await run(first)
        assert cached == 0
        again_tokens, again_cached = await run(render(seed=1))
        other_tokens, other_cached = await run(render(seed=2))  # same token ids, other pixels
        await drain(stream, view, engine.kv_events.next_sequence)
        await stream.aclose()
        prompt_len = len(first.token_ids)
        assert again_tokens == tokens and again_cached == (prompt_len - 1) // BLOCK * BLOCK
        # The other image shares only the blocks that end before it starts.
        assert other_cached == start // BLOCK * BLOCK
        assert set(view.blocks) == set(allocator_of(engine)._by_hash)
        # Each block the item overlaps carries (its mm_hash, its offset in the block); no other does.
        by_start = {}
        for tokens_of_block, keys, parent in view.blocks.values():
            by_start.setdefault(keys, []).append(tokens_of_block)
        expected = {(item.mm_hash, start - first_block * BLOCK)
                    for first_block in range(start // BLOCK, (start + length - 1) // BLOCK + 1)}
        published = {(media.mm_hash, media.offset) for keys in by_start if keys for media in keys.media}
        assert expected <= published
        second_hash = render(seed=2).mm_features.items[0].mm_hash
        assert second_hash != item.mm_hash and any(media.mm_hash == second_hash
                                                   for keys in by_start if keys for media in keys.media)

    try:
        asyncio.run(main())
    finally:
        engine.stop()


def test_the_zmq_wire_puts_the_lora_name_first_in_each_blocks_extra_keys_as_vllm_does():
    from tito_engine.kv_events import KvEventBatch
    from tito_engine.kv_publisher import to_wire

    plain = BlockStored((b"a" * 32, b"b" * 32), None, tuple(range(8)), 4, None, "CPU", "sql")
    salted = BlockStored((b"c" * 32,), None, tuple(range(4)), 4, (BlockKeys((MediaKey("m", 1),), "s"),), "CPU", "sql")
    base = BlockStored((b"d" * 32,), None, tuple(range(4)), 4, None, "CPU", None)
    wire = to_wire(KvEventBatch(0, 0.0, (plain, salted, base))).events
    assert [event.extra_keys for event in wire] == [[("sql",), ("sql",)], [("sql", ("m", 1), "s")], None]
    assert [event.lora_name for event in wire] == ["sql", "sql", None]
