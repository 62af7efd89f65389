"""Encode on one engine, generate on another (E/PD): two engine servers on port 0 sharing one
encoder-store directory (--encoder-store-dir).

Engine A answers Encode and writes the encoder outputs to the shared directory; engine B gets
the same chat rendered with mm_payload METADATA plus A's descriptors and loads the outputs
instead of running its encoder. The reference is one engine given the TENSORS rendering. Every
refusal (forged, stale, evicted, other model, tampered on disk) is followed by a good request
on the same engine, and a signed stack (render and both engines share an HMAC key, signed
features required, B's core in its own process) does the same with the descriptor signed by A.
"""

from __future__ import annotations

import grpc
import pytest

from tito import tensors
from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, multimodal_pb2, render_pb2, tensor_pb2
from tito_engine.config import EngineConfig
from tito_engine.multimodal.encoder_store import MAGIC, SharedEncoderStore, StoredHeader, checksum_bytes
from tito_engine.server import create_server
from tito_render.media.features import Signer
from tito_render.renderer import Renderer
from tito_render.convert import chat_response

from chat_parts import image, text
from renderers import load_renderer

TIMEOUT = 60
KEY, KEY_ID = b"engine-epd-test-key-0123456789abcdef", "k-epd"
TENSORS, METADATA = multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA
ITEM = "mm_features.items[0]"


def chat(renderer: Renderer, *parts, payload: int, max_tokens: int = 12) -> render_pb2.RenderChatResponse:
    request = render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=list(parts))], mm_payload=payload,
        sampling=render_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0))
    return chat_response(renderer, request)


def generate(stub, request) -> list[int]:
    return [token for response in stub.Generate(request, timeout=TIMEOUT) for token in response.token_ids]


def load(stub) -> engine_pb2.GetLoadResponse:
    return stub.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)


def parts_with(images: int, seed: int) -> list:
    parts = [text("Look at these:")]
    for k in range(images):
        parts += [image(56 + 28 * (k % 2), 56, seed=seed + k), text(f"and {k}")]
    return parts + [text("What do you see?")]


def encode_then_metadata(renderer, encoder, parts) -> tuple[engine_pb2.GenerateRequest, engine_pb2.GenerateRequest,
                                                             render_pb2.RenderChatResponse]:
    """(the TENSORS request, the METADATA request with A's descriptors, the METADATA render response)."""
    with_tensors = chat(renderer, *parts, payload=TENSORS).generate_request
    encoded = encoder.Encode(engine_pb2.EncodeRequest(mm_features=with_tensors.mm_features), timeout=TIMEOUT)
    metadata_response = chat(renderer, *parts, payload=METADATA)
    metadata_only = engine_pb2.GenerateRequest()
    metadata_only.CopyFrom(metadata_response.generate_request)
    assert len(encoded.descriptors) == len(metadata_only.mm_features.items)
    for item, descriptor in zip(metadata_only.mm_features.items, encoded.descriptors):
        assert not item.kwargs
        item.ec_descriptor.CopyFrom(descriptor)
    return with_tensors, metadata_only, metadata_response


def refused(stub, request) -> dict:
    with pytest.raises(grpc.RpcError) as info:
        generate(stub, request)
    return error_details(info.value)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def store_dir(tmp_path_factory):
    return tmp_path_factory.mktemp("ec-store")


@pytest.fixture(scope="module")
def engines(module_aio_server, tiny_vl_model, store_dir):
    """(A: encodes, B: generates, single: no store, the reference), A and B on one directory."""
    def start(**extra):
        config = EngineConfig(model=str(tiny_vl_model), device="cpu", engine_process=False, kv_blocks=512, **extra)
        return engine_pb2_grpc.EngineServiceStub(module_aio_server(lambda: create_server(config)).channel())

    return (start(encoder_store_dir=str(store_dir)), start(encoder_store_dir=str(store_dir)), start())


@pytest.fixture(scope="module")
def store(store_dir, engines) -> SharedEncoderStore:
    """A handle on the same directory, to tamper with it as an operator (or an attacker) could."""
    encoder, _, _ = engines
    info = encoder.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
    return SharedEncoderStore(store_dir, max_bytes=1 << 30, model_fingerprint=info.model_fingerprint)


# --------------------------------------------------------------------------- the cross-engine path


@pytest.mark.parametrize("images", [1, 4])
def test_encode_on_a_generate_on_b_equals_one_engine_with_tensors(engines, renderer, images):
    encoder, generator, single = engines
    with_tensors, metadata_only, metadata_response = encode_then_metadata(renderer, encoder,
                                                                          parts_with(images, seed=100 * images))
    expected = generate(single, with_tensors)
    assert len(set(expected)) > 1
    descriptor = metadata_only.mm_features.items[0].ec_descriptor
    assert descriptor.store_id.startswith("ecdir-") and descriptor.uri == f"ecdir://{descriptor.store_id}"
    before = load(generator)
    assert generate(generator, metadata_only) == expected
    after = load(generator)
    assert after.encoded_items == before.encoded_items == 0  # B never ran its encoder
    assert after.encoder_store_loads - before.encoder_store_loads == images
    # The METADATA render response (GenerateRequest + DerenderContext) is small: no pixels.
    assert metadata_response.ByteSize() <= 2048 * images, metadata_response.ByteSize()
    assert chat(renderer, *parts_with(images, seed=100 * images), payload=TENSORS).ByteSize() > 10_000 * images
    # Again on B: now from its own encoder cache, still no encoder run.
    assert generate(generator, metadata_only) == expected
    assert load(generator).encoded_items == 0


def test_b_loads_a_metadata_item_by_hash_from_the_shared_store(engines, renderer):
    """Without a descriptor, a trusted hash also finds A's output in the shared store."""
    encoder, generator, single = engines
    with_tensors, metadata_only, _ = encode_then_metadata(renderer, encoder, parts_with(1, seed=900))
    metadata_only.mm_features.items[0].ClearField("ec_descriptor")
    assert generate(generator, metadata_only) == generate(single, with_tensors)
    assert load(generator).encoded_items == 0


def test_encode_twice_gives_the_same_descriptor_from_either_engine(engines, renderer):
    encoder, generator, _ = engines
    request = chat(renderer, *parts_with(1, seed=950), payload=TENSORS).generate_request
    first = encoder.Encode(engine_pb2.EncodeRequest(mm_features=request.mm_features), timeout=TIMEOUT)
    again = generator.Encode(engine_pb2.EncodeRequest(mm_features=request.mm_features), timeout=TIMEOUT)
    assert first.descriptors[0] == again.descriptors[0]  # the shared entry, written once


# --------------------------------------------------------------------------- refusals


def _rewrite(store: SharedEncoderStore, key: str, data: bytes, header: StoredHeader) -> None:
    raw = header.to_json()
    store.path_for(key).write_bytes(MAGIC + len(raw).to_bytes(4, "little") + raw + data)


def _forged_key(request, store, other):
    request.mm_features.items[0].ec_descriptor.key = other.mm_features.items[0].ec_descriptor.key


def _forged_uri(request, store, other):
    request.mm_features.items[0].ec_descriptor.uri = "ecdir://somewhere-else"


def _forged_shape(request, store, other):
    descriptor = request.mm_features.items[0].ec_descriptor
    descriptor.shape[0] += 1


def _unknown_store(request, store, other):
    request.mm_features.items[0].ec_descriptor.store_id = "ecdir-0000000000000000"


def _other_model(request, store, other):
    request.mm_features.items[0].ec_descriptor.model_fingerprint = "ffffffffffffffff"


def _evicted(request, store, other):
    store.remove(request.mm_features.items[0].ec_descriptor.key)


def _stale(request, store, other):
    """Another engine re-encoded the item since (other rounding): a valid entry, other bytes."""
    key = request.mm_features.items[0].ec_descriptor.key
    header, data = store.get(key)
    rows = tensors.to_torch(tensor_pb2.Tensor(dtype=header.dtype, shape=list(header.shape), data=data))
    wire = tensors.from_torch(rows * 1.001)
    _rewrite(store, key, wire.data, StoredHeader(key, header.model_fingerprint, header.dtype, header.shape,
                                                 len(wire.data), checksum_bytes(wire.data)))


def _tampered(request, store, other):
    path = store.path_for(request.mm_features.items[0].ec_descriptor.key)
    blob = bytearray(path.read_bytes())
    blob[-3] ^= 0x40  # one bit of one encoder row, header left as it was
    path.write_bytes(bytes(blob))


def _copied_over(request, store, other):
    """Another item's (valid) file put under this item's name."""
    mine = store.path_for(request.mm_features.items[0].ec_descriptor.key)
    mine.write_bytes(store.path_for(other.mm_features.items[0].ec_descriptor.key).read_bytes())


INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION
REFUSALS = [
    (_forged_key, INVALID, "EC_DESCRIPTOR_INVALID", f"{ITEM}.ec_descriptor.key"),
    (_forged_uri, INVALID, "EC_DESCRIPTOR_INVALID", f"{ITEM}.ec_descriptor.uri"),
    (_forged_shape, INVALID, "EC_DESCRIPTOR_INVALID", f"{ITEM}.ec_descriptor.shape"),
    (_unknown_store, INVALID, "EC_DESCRIPTOR_INVALID", f"{ITEM}.ec_descriptor.store_id"),
    (_other_model, INVALID, "EC_MODEL_MISMATCH", f"{ITEM}.ec_descriptor.model_fingerprint"),
    (_evicted, PRECONDITION, "EC_ENTRY_EVICTED", f"{ITEM}.ec_descriptor"),
    (_stale, PRECONDITION, "EC_DESCRIPTOR_STALE", f"{ITEM}.ec_descriptor.checksum"),
    (_tampered, PRECONDITION, "EC_ENTRY_CORRUPT", f"{ITEM}.ec_descriptor"),
    (_copied_over, PRECONDITION, "EC_ENTRY_CORRUPT", f"{ITEM}.ec_descriptor"),
]


@pytest.fixture(scope="module")
def good(engines, renderer):
    encoder, _, single = engines
    with_tensors, metadata_only, _ = encode_then_metadata(renderer, encoder, parts_with(1, seed=7000))
    return metadata_only, generate(single, with_tensors)


@pytest.mark.parametrize("spoil, code, reason, field", REFUSALS, ids=[r[0].__name__[1:] for r in REFUSALS])
def test_a_bad_descriptor_is_refused_then_b_still_serves(engines, renderer, store, good, spoil, code, reason, field):
    encoder, generator, _ = engines
    seed = 8000 + 10 * [r[0] for r in REFUSALS].index(spoil)
    _, request, _ = encode_then_metadata(renderer, encoder, parts_with(1, seed=seed))  # B has never seen it
    _, other, _ = encode_then_metadata(renderer, encoder, parts_with(1, seed=seed + 5))
    spoil(request, store, other)
    details = refused(generator, request)
    assert (details["code"], details["reason"], details["fields"][:1]) == (code, reason, [field]), details
    if reason == "EC_ENTRY_CORRUPT":
        assert not store.path_for(request.mm_features.items[0].ec_descriptor.key).exists()  # removed
    good_request, expected = good
    assert generate(generator, good_request) == expected  # the engine keeps serving
    assert load(generator).encoded_items == 0


def test_a_corrupt_entry_is_rewritten_by_the_next_encode(engines, renderer, store):
    encoder, generator, single = engines
    with_tensors, request, _ = encode_then_metadata(renderer, encoder, parts_with(1, seed=9100))
    _tampered(request, store, None)
    assert refused(generator, request)["reason"] == "EC_ENTRY_CORRUPT"
    _, again, _ = encode_then_metadata(renderer, encoder, parts_with(1, seed=9100))  # A still caches it
    assert again.mm_features.items[0].ec_descriptor == request.mm_features.items[0].ec_descriptor
    assert generate(generator, again) == generate(single, with_tensors)


def test_an_evicted_entry_falls_back_to_tensors_when_the_item_has_them(engines, renderer, store):
    encoder, generator, single = engines
    with_tensors, request, _ = encode_then_metadata(renderer, encoder, parts_with(1, seed=9200))
    both = engine_pb2.GenerateRequest()
    both.CopyFrom(with_tensors)
    both.mm_features.items[0].ec_descriptor.CopyFrom(request.mm_features.items[0].ec_descriptor)
    store.remove(request.mm_features.items[0].ec_descriptor.key)
    before = load(generator).encoded_items
    assert generate(generator, both) == generate(single, with_tensors)
    assert load(generator).encoded_items == before + 1


# --------------------------------------------------------------------------- signed stacks


@pytest.fixture(scope="module")
def signed_renderer(tiny_vl_model) -> Renderer:
    return load_renderer(tiny_vl_model, signer=Signer(KEY, KEY_ID))


@pytest.fixture(scope="module")
def signed_engines(module_aio_server, tiny_vl_model, tmp_path_factory):
    """(A, B) requiring signed features, one key, one directory; B's core in its own process."""
    key_file = tmp_path_factory.mktemp("keys") / "hmac.key"
    key_file.write_bytes(KEY + b"\n")
    directory = tmp_path_factory.mktemp("signed-ec-store")

    def start(engine_process: bool):
        config = EngineConfig(model=str(tiny_vl_model), device="cpu", engine_process=engine_process, kv_blocks=256,
                              hmac_key_file=str(key_file), hmac_key_id=KEY_ID, require_signed_features=True,
                              encoder_store_dir=str(directory))
        return engine_pb2_grpc.EngineServiceStub(module_aio_server(lambda: create_server(config)).channel())

    return start(False), start(True)


def test_signed_stack_encode_on_a_generate_on_b(signed_engines, signed_renderer, engines):
    encoder, generator = signed_engines
    _, _, single = engines
    with_tensors, metadata_only, _ = encode_then_metadata(signed_renderer, encoder, parts_with(2, seed=500))
    for item in metadata_only.mm_features.items:
        assert item.auth_tag and item.ec_descriptor.auth_tag  # render's tag, and A's on the descriptor
        assert item.ec_descriptor.auth_key_id == KEY_ID
    reference = engine_pb2.GenerateRequest()
    reference.CopyFrom(with_tensors)
    for item in reference.mm_features.items:
        item.ClearField("auth_tag")
    assert generate(generator, metadata_only) == generate(single, reference)
    assert load(generator).encoded_items == 0 and load(generator).encoder_store_loads == 2


def _descriptor_changed(request):
    request.mm_features.items[0].ec_descriptor.checksum = "sha256:" + "0" * 64


def _descriptor_unsigned(request):
    request.mm_features.items[0].ec_descriptor.ClearField("auth_tag")


def _descriptor_moved(request, other):
    request.mm_features.items[0].ec_descriptor.CopyFrom(other.mm_features.items[0].ec_descriptor)


@pytest.mark.parametrize("spoil, reason, field", [
    (_descriptor_changed, "EC_DESCRIPTOR_INVALID", f"{ITEM}.ec_descriptor.auth_tag"),
    (_descriptor_unsigned, "MM_SIGNATURE_INVALID", f"{ITEM}.auth_tag"),
    (_descriptor_moved, "EC_DESCRIPTOR_INVALID", f"{ITEM}.ec_descriptor.key"),
], ids=["changed", "unsigned", "moved_to_another_image"])
def test_signed_stack_refuses_a_changed_descriptor_then_serves(signed_engines, signed_renderer, spoil, reason, field):
    encoder, generator = signed_engines
    _, request, _ = encode_then_metadata(signed_renderer, encoder, parts_with(1, seed=600))
    if spoil is _descriptor_moved:
        _, other, _ = encode_then_metadata(signed_renderer, encoder, parts_with(1, seed=650))
        spoil(request, other)
    else:
        spoil(request)
    details = refused(generator, request)
    assert (details["code"], details["reason"], details["fields"][:1]) == (INVALID, reason, [field]), details
    _, good_request, _ = encode_then_metadata(signed_renderer, encoder, parts_with(1, seed=601))
    assert len(generate(generator, good_request)) == 12
