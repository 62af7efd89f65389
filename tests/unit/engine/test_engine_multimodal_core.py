"""Media requests in the engine core (thread-hosted): encoding once per item, preemption and
recompute without re-encoding, the two-phase admission split and its errors across the pipe."""

from __future__ import annotations

import asyncio
import pickle
import time

import pytest

from tito.config import ConfigError
from tito.errors import FailedPrecondition, FieldViolation, InvalidArgument
from tito.v1 import chat_pb2, engine_pb2, multimodal_pb2, render_pb2
from tito_engine.config import EngineConfig
from tito_engine.core.engine import Engine
from tito_engine.multimodal.features import FeaturePolicy, resolve_cached, validate_mm_features, validate_structure
from tito_engine.model.runner import KVCacheSpec, ModelRunner
from tito_engine.backend.admission import Admission
from tito_engine.service.convert import generate_input_from_proto, media_from_proto
from tito_render.convert import chat_response

from images import noise_png


def render(renderer, seed: int, words: str, max_tokens: int, payload=multimodal_pb2.MM_PAYLOAD_TENSORS):
    request = render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=[
            chat_pb2.ContentPart(text=words),
            chat_pb2.ContentPart(image=chat_pb2.ImageSource(data=noise_png(56, 56, seed)))])],
        mm_payload=payload,
        sampling=render_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
    return chat_response(renderer, request).generate_request


class CountingRunner(ModelRunner):
    encoded_items = 0
    encoder_calls = 0
    broken_encoder = False

    def encode(self, items):
        if self.broken_encoder:
            raise RuntimeError("encoder exploded")
        self.encoder_calls += 1
        self.encoded_items += len(items)
        return super().encode(items)


@pytest.fixture(scope="module")
def small_runner(tiny_vl_model):
    # 24 blocks of 4 tokens: one request (~30 prompt + 30 new tokens) fits, three do not.
    return CountingRunner(tiny_vl_model, model_id="vl", device="cpu", kv_cache=KVCacheSpec(block_size=4, num_blocks=24))


def admitted(engine: Engine, request: engine_pb2.GenerateRequest):
    return Admission.for_backend(engine).admit(generate_input_from_proto(request))


async def _collect(engine: Engine, request: engine_pb2.GenerateRequest) -> list[int]:
    tokens: list[int] = []
    async for output in engine.generate(admitted(engine, request)):
        tokens.extend(output.token_ids)
    return tokens


def test_preempted_media_requests_recompute_without_re_encoding(small_runner, renderer):
    requests = [render(renderer, seed=k, words=f"Picture number {k}, please describe", max_tokens=30)
                for k in range(3)]
    engine = Engine(small_runner, encoder_cache_bytes=0)  # no encoder cache: only the kept prefill can help
    engine.start()
    try:
        alone = [asyncio.run(_collect(engine, request)) for request in requests]
        calls_before, items_before = small_runner.encoder_calls, small_runner.encoded_items

        async def together():
            return await asyncio.gather(*(_collect(engine, request) for request in requests))

        assert asyncio.run(together()) == alone
        scheduler = engine._core.core.scheduler
        assert scheduler.preemptions > 0, "the test must force preemption to mean anything"
        assert small_runner.encoded_items - items_before == 3  # once per request, never on recompute
        assert small_runner.encoder_calls - calls_before <= 3
        assert all(len(tokens) == 30 for tokens in alone)
    finally:
        engine.stop()


def test_items_arriving_together_are_encoded_in_one_call_and_duplicates_once(small_runner, renderer):
    engine = Engine(small_runner, encoder_cache_bytes=1 << 22)
    same = render(renderer, seed=77, words="Same picture", max_tokens=2)
    other = render(renderer, seed=78, words="Other picture", max_tokens=2)
    outputs: list = []
    # Submit before starting the core, so all three adds arrive in one batch of commands.
    for index, request in enumerate((same, same, other)):
        request.request_id = f"together-{index}"
        engine.submit(admitted(engine, request), outputs.append)
    calls_before, items_before = small_runner.encoder_calls, small_runner.encoded_items
    engine.start()
    try:
        deadline = time.monotonic() + 30
        while sum(1 for o in outputs if getattr(o, "finished", False)) < 3 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert sum(1 for o in outputs if getattr(o, "finished", False)) == 3
        assert small_runner.encoder_calls - calls_before == 1  # one call for the step's new items
        assert small_runner.encoded_items - items_before == 2  # the repeated image once
    finally:
        engine.stop()


def test_cache_dependent_refusal_reaches_the_caller_as_the_same_error(small_runner, renderer):
    engine = Engine(small_runner, encoder_cache_bytes=1 << 22)
    engine.start()
    try:
        metadata_only = render(renderer, seed=99, words="Never encoded", max_tokens=2,
                               payload=multimodal_pb2.MM_PAYLOAD_METADATA)
        with pytest.raises(FailedPrecondition) as info:
            asyncio.run(_collect(engine, metadata_only))
        assert info.value.reason == "MM_TENSORS_REQUIRED" and info.value.field == "mm_features.items[0].kwargs"
        good = render(renderer, seed=99, words="Never encoded", max_tokens=2)
        assert len(asyncio.run(_collect(engine, good))) == 2
        assert engine.load().running_requests == 0
    finally:
        engine.stop()


def test_encode_without_an_encoder_cache_is_a_failed_precondition(small_runner, renderer):
    engine = Engine(small_runner, encoder_cache_bytes=0)
    engine.start()
    try:
        request = render(renderer, seed=3, words="Encode me", max_tokens=1)
        with pytest.raises(FailedPrecondition) as info:
            asyncio.run(engine.encode(Admission.for_backend(engine).admit_encode(media_from_proto(request))))
        assert info.value.reason == "ENCODER_CACHE_DISABLED"
        assert len(asyncio.run(_collect(engine, request))) == 1  # generation still works without a cache
    finally:
        engine.stop()


def test_encode_returns_descriptors_that_name_the_cached_rows(small_runner, renderer):
    engine = Engine(small_runner, encoder_cache_bytes=1 << 22)
    engine.start()
    try:
        request = render(renderer, seed=4, words="Encode me", max_tokens=1)
        items = media_from_proto(request)
        first = asyncio.run(engine.encode(Admission.for_backend(engine).admit_encode(items)))
        # Cached: the same descriptor, a hit.
        second = asyncio.run(engine.encode(Admission.for_backend(engine).admit_encode(items)))
        assert first == second and len(first) == 1
        assert first[0].model_fingerprint == small_runner.info.fingerprint
        assert engine.load().encoder_cache_hits >= 1
    finally:
        engine.stop()


def test_an_encoder_failure_fails_only_its_own_call(small_runner, renderer):
    engine = Engine(small_runner, encoder_cache_bytes=1 << 22)
    engine.start()
    running = render(renderer, seed=60, words="Keep going", max_tokens=30)
    other = render(renderer, seed=61, words="Break", max_tokens=2)
    try:
        expected = asyncio.run(_collect(engine, running))  # its image is cached from now on

        async def both():
            generation = asyncio.create_task(_collect(engine, running))
            await asyncio.sleep(0.01)
            small_runner.broken_encoder = True
            with pytest.raises(RuntimeError, match="encoder exploded"):
                await engine.encode(Admission.for_backend(engine).admit_encode(media_from_proto(other)))
            with pytest.raises(RuntimeError, match="encoder exploded"):
                await _collect(engine, other)
            small_runner.broken_encoder = False
            return await generation

        assert asyncio.run(both()) == expected
        assert len(asyncio.run(_collect(engine, other))) == 2  # and the encoder serves again
    finally:
        small_runner.broken_encoder = False
        engine.stop()


def test_two_phase_admission_equals_one_call_and_crosses_a_pipe(small_runner, renderer):
    request = render(renderer, seed=5, words="Phases", max_tokens=2)
    spec, policy = small_runner.mm_spec, FeaturePolicy()
    checked = validate_structure(list(request.token_ids), media_from_proto(request), spec, policy)
    checked = pickle.loads(pickle.dumps(checked))  # what the server sends the core
    split = resolve_cached(checked, None)
    whole = validate_mm_features(list(request.token_ids), media_from_proto(request), spec, policy)
    assert [(i.embed_positions, i.grid_thw, i.content_id) for i in split.items] == \
           [(i.embed_positions, i.grid_thw, i.content_id) for i in whole.items]
    assert split.items[0].encoder_inputs["pixel_values"].equal(whole.items[0].encoder_inputs["pixel_values"])


def test_a_refusal_from_the_core_survives_pickling_with_code_reason_and_fields():
    error = InvalidArgument("bad descriptor", reason="EC_DESCRIPTOR_INVALID",
                            field="mm_features.items[0].ec_descriptor.key",
                            metadata={"limit": "x"})
    error.violations.append(FieldViolation("mm_features.items[1].hash", "empty"))
    rebuilt = pickle.loads(pickle.dumps(error))
    assert type(rebuilt) is InvalidArgument and rebuilt.reason == error.reason and rebuilt.field == error.field
    assert rebuilt.message == error.message and rebuilt.metadata == {"limit": "x"}
    assert rebuilt.violations == error.violations


@pytest.mark.parametrize("fields, words", [
    ({"require_signed_features": True}, "--hmac-key-file"),
    ({"hmac_key_id": "k"}, "--hmac-key-file"),
    ({"max_mm_items": 0}, "max_mm_items"),
    ({"max_mm_item_bytes": 10, "max_mm_request_bytes": 5}, "max_mm_request_bytes"),
    ({"encoder_cache_bytes": -1}, "encoder_cache_bytes"),
])
def test_media_config_errors_teach(fields, words):
    with pytest.raises(ConfigError) as info:
        EngineConfig(**fields).validate()
    assert words in str(info.value)


def test_hmac_key_file_is_stripped_and_must_be_long_enough(tmp_path):
    short = tmp_path / "short.key"
    short.write_bytes(b"  tooshort \n")
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        EngineConfig(hmac_key_file=str(short)).validate()
    good = tmp_path / "good.key"
    good.write_bytes(b"\n0123456789abcdef0123\n")
    config = EngineConfig(hmac_key_file=str(good), require_signed_features=True)
    config.validate()
    assert config.read_hmac_key() == b"0123456789abcdef0123"
