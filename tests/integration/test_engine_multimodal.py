"""Image requests through the engine over real gRPC, built the way render builds them.

Requests come from render's own domain code (`tito_render` Renderer: chat template, image
processor, features with tensors, HMAC tags), which is allowed in tests (never in engine code).
References come from Hugging Face `generate` on the same input_ids / pixel_values /
image_grid_thw / mm_token_type_ids.

Two servers per module: an open one (no signing; core on a thread) for the equality and
Encode tests, and a signed one (--require-signed-features, small media limits, the deployed
child-process core) for the admission rules, each of which is followed by a good request.
"""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch
from transformers import AutoModelForImageTextToText

from tito import signing, tensors
from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, multimodal_pb2, render_pb2
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_render.media.features import Signer
from tito_render.renderer import Renderer
from tito_render.convert import chat_response

from chat_parts import image, text
from images import noise_png
from renderers import load_renderer
from vl_reference import hf_vl_greedy as hf_greedy

TIMEOUT = 60
KEY, KEY_ID = b"engine-multimodal-test-key-0123456789", "k1"
ITEM_LIMIT, REQUEST_LIMIT, ITEMS_LIMIT = 100_000, 160_000, 3  # a 56x56 image: ~75 KB of pixel values
TENSORS, METADATA = multimodal_pb2.MM_PAYLOAD_TENSORS, multimodal_pb2.MM_PAYLOAD_METADATA


# --------------------------------------------------------------------------- building requests


def render(renderer: Renderer, *parts, max_tokens: int = 12, payload: int = TENSORS) -> engine_pb2.GenerateRequest:
    request = render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=list(parts))], mm_payload=payload,
        sampling=render_pb2.SamplingOptions(max_tokens=max_tokens, temperature=0.0))
    return chat_response(renderer, request).generate_request


def generate(stub, request) -> list[int]:
    return [token for response in stub.Generate(request, timeout=TIMEOUT) for token in response.token_ids]


def resign(item: multimodal_pb2.MultiModalItem) -> None:
    signing.sign_item(item, KEY, KEY_ID)


# --------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def signed_renderer(tiny_vl_model) -> Renderer:
    return load_renderer(tiny_vl_model, signer=Signer(KEY, KEY_ID))


@pytest.fixture(scope="module")
def hf_model(tiny_vl_model):
    return AutoModelForImageTextToText.from_pretrained(tiny_vl_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def open_engine(module_aio_server, tiny_vl_model):
    config = EngineConfig(model=str(tiny_vl_model), device="cpu", engine_process=False, kv_blocks=512)
    server = module_aio_server(lambda: create_server(config))
    return engine_pb2_grpc.EngineServiceStub(server.channel())


@pytest.fixture(scope="module")
def signed_engine(module_aio_server, tiny_vl_model, tmp_path_factory):
    key_file = tmp_path_factory.mktemp("keys") / "hmac.key"
    key_file.write_bytes(KEY + b"\n")
    config = EngineConfig(model=str(tiny_vl_model), device="cpu", engine_process=True, kv_blocks=256,
                          hmac_key_file=str(key_file), hmac_key_id=KEY_ID, require_signed_features=True,
                          max_mm_item_bytes=ITEM_LIMIT, max_mm_request_bytes=REQUEST_LIMIT, max_mm_items=ITEMS_LIMIT)
    server = module_aio_server(lambda: create_server(config))
    return engine_pb2_grpc.EngineServiceStub(server.channel())


# --------------------------------------------------------------------------- equality with HF


def test_model_info_lists_image_and_video_placeholders(open_engine):
    info = open_engine.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
    by_modality = {m.modality: (m.placeholder_token, m.placeholder_token_id) for m in info.modalities}
    assert by_modality[multimodal_pb2.MODALITY_IMAGE][0] == "<|image_pad|>"
    assert by_modality[multimodal_pb2.MODALITY_VIDEO][0] == "<|video_pad|>"
    assert by_modality[multimodal_pb2.MODALITY_IMAGE][1] != by_modality[multimodal_pb2.MODALITY_VIDEO][1]


def test_image_prompt_alone_equals_hf_generate(open_engine, renderer, hf_model):
    request = render(renderer, text("Describe this:"), image(84, 56, seed=1), text("Be brief."), max_tokens=24)
    assert len(request.mm_features.items) == 1
    tokens = generate(open_engine, request)
    assert tokens == hf_greedy(hf_model, request)
    assert len(set(tokens)) > 1


def _mixed_requests(renderer) -> list[engine_pb2.GenerateRequest]:
    requests = []
    for k in range(16):
        words = " ".join(["sea", "sky", "stone", "leaf", "wind"][: 1 + k % 5]) * (1 + k % 3)
        if k % 2:
            requests.append(render(renderer, text(f"Plain text {k}: {words}"), max_tokens=16 + k))
        elif k % 4 == 0:
            requests.append(render(renderer, text(f"Two {k}:"), image(56, 56 + 28 * (k % 3), seed=10 + k),
                                   text("and"), image(112, 56, seed=40 + k), text(words), max_tokens=16 + k))
        else:
            requests.append(render(renderer, image(28 * (2 + k % 4), 56, seed=10 + k), text(f"{words} {k}"),
                                   max_tokens=16 + k))
    return requests


def test_sixteen_mixed_requests_joining_at_different_steps_equal_hf(open_engine, renderer, hf_model):
    requests = _mixed_requests(renderer)
    expected = [hf_greedy(hf_model, request) for request in requests]
    results: list[list[int] | BaseException | None] = [None] * len(requests)
    threads = []

    def run(index: int, started: threading.Event) -> None:
        tokens: list[int] = []
        first = None
        try:
            for response in open_engine.Generate(requests[index], timeout=TIMEOUT):
                tokens.extend(response.token_ids)
                first = first or time.monotonic()
                started.set()
            spans[index] = (first, time.monotonic())
            results[index] = tokens
        except BaseException as exc:  # noqa: BLE001 - reported below
            results[index] = exc
        finally:
            started.set()

    spans: list[tuple[float, float] | None] = [None] * len(requests)  # first and last token times
    # Each request starts once the previous one streams, so they join the batch at different steps.
    for index in range(len(requests)):
        started = threading.Event()
        thread = threading.Thread(target=run, args=(index, started))
        thread.start()
        threads.append(thread)
        started.wait(TIMEOUT)
    for thread in threads:
        thread.join(TIMEOUT)
    assert results == expected
    # The test means something only if the requests overlapped: most were still streaming when a
    # later one started.
    overlapping = sum(1 for k in range(1, len(spans)) if spans[k][0] < spans[k - 1][1])
    assert overlapping >= len(spans) // 2, spans
    load = open_engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert load.running_requests == 0 and load.kv_blocks_used == 0


def test_video_and_image_prompt_equals_hf_generate(open_engine, renderer, hf_model):
    frames = chat_pb2.VideoFrames(frames=[chat_pb2.ImageSource(data=noise_png(56, 56, seed=70 + k)) for k in range(4)],
                                  fps=2.0)
    request = render(renderer, text("A clip:"), chat_pb2.ContentPart(video=frames), text("and a still:"),
                     image(56, 84, seed=75), max_tokens=20)
    modalities = [item.modality for item in request.mm_features.items]
    assert modalities == [multimodal_pb2.MODALITY_VIDEO, multimodal_pb2.MODALITY_IMAGE]
    assert generate(open_engine, request) == hf_greedy(hf_model, request)


def test_features_of_another_image_with_the_same_ids_give_that_images_tokens(open_engine, renderer, hf_model):
    a = render(renderer, text("Which one?"), image(56, 84, seed=101), max_tokens=16)
    b = render(renderer, text("Which one?"), image(56, 84, seed=202), max_tokens=16)
    assert list(a.token_ids) == list(b.token_ids)  # same size: identical placeholder runs
    expected_a, expected_b = hf_greedy(hf_model, a), hf_greedy(hf_model, b)
    assert expected_a != expected_b
    swapped = engine_pb2.GenerateRequest()
    swapped.CopyFrom(a)
    swapped.mm_features.CopyFrom(b.mm_features)
    assert generate(open_engine, swapped) == expected_b
    assert generate(open_engine, a) == expected_a


def test_n_choices_share_the_image_prefill(open_engine, renderer, hf_model):
    request = render(renderer, image(56, 56, seed=303), text("Twice."), max_tokens=8)
    expected = hf_greedy(hf_model, request)
    request.sampling_params.n = 3
    by_choice: dict[int, list[int]] = {}
    for response in open_engine.Generate(request, timeout=TIMEOUT):
        by_choice.setdefault(response.index, []).extend(response.token_ids)
    assert by_choice == {0: expected, 1: expected, 2: expected}


# --------------------------------------------------------------------------- Encode


def test_encode_then_metadata_only_generate_equals_tensors(open_engine, renderer, hf_model):
    parts = (text("Encoded first:"), image(84, 84, seed=404), text("Now answer."))
    with_tensors = render(renderer, *parts, max_tokens=16)
    expected = hf_greedy(hf_model, with_tensors)
    encoded = open_engine.Encode(engine_pb2.EncodeRequest(mm_features=with_tensors.mm_features), timeout=TIMEOUT)
    assert len(encoded.descriptors) == 1
    descriptor = encoded.descriptors[0]
    assert descriptor.checksum.startswith("sha256:")
    assert descriptor.key.endswith(with_tensors.mm_features.items[0].mm_hash)
    assert list(descriptor.shape) == [with_tensors.mm_features.items[0].placeholder.length, 64]

    metadata_only = render(renderer, *parts, max_tokens=16, payload=METADATA)
    assert not metadata_only.mm_features.items[0].kwargs and metadata_only.mm_features.items[0].metadata
    assert list(metadata_only.token_ids) == list(with_tensors.token_ids)
    before = open_engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    metadata_only.mm_features.items[0].ec_descriptor.CopyFrom(descriptor)
    assert generate(open_engine, metadata_only) == expected
    metadata_only.mm_features.items[0].ClearField("ec_descriptor")  # a plain cache hit by (trusted) hash
    assert generate(open_engine, metadata_only) == expected
    after = open_engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert after.encoder_cache_hits == before.encoder_cache_hits + 2
    assert after.encoder_cache_misses == before.encoder_cache_misses


def test_encode_answers_an_item_without_a_placeholder(open_engine, renderer):
    """Encode has no token ids: an item's placeholder is not needed (it was once an INTERNAL)."""
    features = render(renderer, image(56, 56, seed=606), text("Encode me.")).mm_features
    expected = open_engine.Encode(engine_pb2.EncodeRequest(mm_features=features), timeout=TIMEOUT).descriptors
    features.items[0].ClearField("placeholder")
    assert open_engine.Encode(engine_pb2.EncodeRequest(mm_features=features), timeout=TIMEOUT).descriptors == expected


def test_repeated_image_hits_the_encoder_cache(open_engine, renderer, hf_model):
    request = render(renderer, image(56, 112, seed=505), text("Again?"), max_tokens=6)
    before = open_engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    first = generate(open_engine, request)
    second = generate(open_engine, request)
    after = open_engine.GetLoad(engine_pb2.GetLoadRequest(), timeout=TIMEOUT)
    assert first == second == hf_greedy(hf_model, request)
    assert (after.encoder_cache_misses - before.encoder_cache_misses,
            after.encoder_cache_hits - before.encoder_cache_hits) == (1, 1)


# --------------------------------------------------------------------------- admission over gRPC


def _signed(signed_renderer, *parts, seed=7, payload=TENSORS):
    return render(signed_renderer, text("Look:"), *(parts or (image(56, 56, seed=seed),)), text("What is it?"),
                  max_tokens=4, payload=payload)


def _forged_hash(r, stub):
    request = _signed(r)
    request.mm_features.items[0].mm_hash = "ab" * 32  # not what render signed
    return request


def _bad_tag(r, stub):
    request = _signed(r)
    tag = bytearray(request.mm_features.items[0].auth_tag)
    tag[0] ^= 1
    request.mm_features.items[0].auth_tag = bytes(tag)
    return request


def _unsigned(r, stub):
    request = _signed(r)
    request.mm_features.items[0].ClearField("auth_tag")
    return request


def _metadata_only_uncached(r, stub):
    return _signed(r, seed=9001, payload=METADATA)  # never encoded on this engine


def _forged_descriptor(r, stub):
    request = _signed(r, seed=11)
    item = request.mm_features.items[0]
    descriptor = stub.Encode(engine_pb2.EncodeRequest(mm_features=request.mm_features), timeout=TIMEOUT).descriptors[0]
    descriptor.checksum = "sha256:" + "0" * 64
    descriptor.ClearField("auth_tag")  # the engine's own tag would no longer verify; the item's tag covers it
    item.ec_descriptor.CopyFrom(descriptor)
    resign(item)  # even a correctly signed item may not make the engine trust a wrong descriptor
    return request


def _overlap(r, stub):
    request = _signed(r, image(56, 56, seed=12), text("and"), image(56, 56, seed=13))
    second = request.mm_features.items[1]
    second.placeholder.offset = request.mm_features.items[0].placeholder.offset
    resign(second)
    return request


def _is_embed_length(r, stub):
    request = _signed(r)
    item = request.mm_features.items[0]
    item.placeholder.is_embed.extend([True] * (item.placeholder.length - 1))
    resign(item)
    return request


def _embed_count(r, stub):
    request = _signed(r)
    item = request.mm_features.items[0]
    item.placeholder.is_embed.extend([True] * (item.placeholder.length - 1) + [False])
    resign(item)
    return request


def _tensor_bytes(r, stub):
    request = _signed(r)
    item = request.mm_features.items[0]
    item.kwargs["pixel_values"].data = item.kwargs["pixel_values"].data[:-4]
    resign(item)
    return request


def _unknown_dtype(r, stub):
    request = _signed(r)
    item = request.mm_features.items[0]
    item.kwargs["pixel_values"].dtype = 99
    resign(item)
    return request


def _too_many_items(r, stub):
    return _signed(r, *[image(28, 28, seed=20 + k) for k in range(ITEMS_LIMIT + 1)])


def _item_too_large(r, stub):
    return _signed(r, image(112, 112, seed=30))  # 64 patches: ~300 KB > ITEM_LIMIT


def _request_too_large(r, stub):
    return _signed(r, *[image(56, 56, seed=31 + k) for k in range(3)])  # each fits, together > REQUEST_LIMIT


def _stray_placeholder(r, stub):
    request = _signed(r)
    pad = request.token_ids[request.mm_features.items[0].placeholder.offset]
    text_only = engine_pb2.GenerateRequest(token_ids=[5, 6, pad, 7], sampling_params=request.sampling_params)
    return text_only


def _placeholder_token_mismatch(r, stub):
    request = _signed(r)
    request.token_ids[request.mm_features.items[0].placeholder.offset] = 5
    return request


def _unsupported_modality(r, stub):
    request = _signed(r)
    item = request.mm_features.items[0]
    item.modality = multimodal_pb2.MODALITY_AUDIO
    resign(item)
    return request


ITEM = "mm_features.items[0]"
ADMISSION_RULES = [
    (_forged_hash, grpc.StatusCode.INVALID_ARGUMENT, "MM_SIGNATURE_INVALID", f"{ITEM}.auth_tag"),
    (_bad_tag, grpc.StatusCode.INVALID_ARGUMENT, "MM_SIGNATURE_INVALID", f"{ITEM}.auth_tag"),
    (_unsigned, grpc.StatusCode.INVALID_ARGUMENT, "MM_SIGNATURE_INVALID", f"{ITEM}.auth_tag"),
    (_metadata_only_uncached, grpc.StatusCode.FAILED_PRECONDITION, "MM_TENSORS_REQUIRED", f"{ITEM}.kwargs"),
    (_forged_descriptor, grpc.StatusCode.INVALID_ARGUMENT, "EC_DESCRIPTOR_INVALID", f"{ITEM}.ec_descriptor.checksum"),
    (_overlap, grpc.StatusCode.INVALID_ARGUMENT, "MM_PLACEHOLDER_OVERLAP", "mm_features.items[1].placeholder.offset"),
    (_is_embed_length, grpc.StatusCode.INVALID_ARGUMENT, "MM_IS_EMBED_LENGTH_MISMATCH", f"{ITEM}.placeholder.is_embed"),
    (_embed_count, grpc.StatusCode.INVALID_ARGUMENT, "MM_EMBED_COUNT_MISMATCH", f"{ITEM}.placeholder.is_embed"),
    (_tensor_bytes, grpc.StatusCode.INVALID_ARGUMENT, "TENSOR_SIZE_MISMATCH", f"{ITEM}.kwargs.pixel_values.data"),
    (_unknown_dtype, grpc.StatusCode.INVALID_ARGUMENT, "TENSOR_DTYPE_INVALID", f"{ITEM}.kwargs.pixel_values.dtype"),
    (_too_many_items, grpc.StatusCode.RESOURCE_EXHAUSTED, "MM_TOO_MANY_ITEMS", "mm_features.items"),
    (_item_too_large, grpc.StatusCode.RESOURCE_EXHAUSTED, "MM_ITEM_TOO_LARGE", ITEM),
    (_request_too_large, grpc.StatusCode.RESOURCE_EXHAUSTED, "MM_REQUEST_TOO_LARGE", "mm_features"),
    (_stray_placeholder, grpc.StatusCode.INVALID_ARGUMENT, "MM_PLACEHOLDER_UNCLAIMED", "token_ids[2]"),
    (_placeholder_token_mismatch, grpc.StatusCode.INVALID_ARGUMENT, "MM_PLACEHOLDER_TOKEN_MISMATCH",
     f"{ITEM}.placeholder"),
    (_unsupported_modality, grpc.StatusCode.INVALID_ARGUMENT, "UNSUPPORTED_MODALITY", f"{ITEM}.modality"),
]


@pytest.fixture(scope="module")
def good_signed(signed_renderer, hf_model):
    request = _signed(signed_renderer, seed=8)
    return request, hf_greedy(hf_model, request)


@pytest.mark.parametrize("build, code, reason, field", ADMISSION_RULES,
                         ids=[rule[0].__name__[1:] for rule in ADMISSION_RULES])
def test_admission_rule_then_a_good_request(signed_engine, signed_renderer, good_signed, build, code, reason, field):
    bad = build(signed_renderer, signed_engine)
    with pytest.raises(grpc.RpcError) as info:
        generate(signed_engine, bad)
    details = error_details(info.value)
    assert details["code"] == code, details
    assert details["fields"][:1] == [field], details
    assert details["reason"] == reason, details
    request, expected = good_signed
    assert generate(signed_engine, request) == expected  # the engine still serves, through its child process


def test_signed_metadata_only_item_hits_after_a_tensors_request(signed_engine, signed_renderer, hf_model):
    with_tensors = _signed(signed_renderer, seed=606)
    expected = hf_greedy(hf_model, with_tensors)
    assert generate(signed_engine, with_tensors) == expected
    metadata_only = _signed(signed_renderer, seed=606, payload=METADATA)
    assert generate(signed_engine, metadata_only) == expected


# --------------------------------------------------------------------------- Gemma3 (interleaved spans)


@pytest.fixture(scope="module")
def gemma_renderer(tiny_interleaved_vl_model) -> Renderer:
    return load_renderer(tiny_interleaved_vl_model)


@pytest.fixture(scope="module")
def gemma_hf(tiny_interleaved_vl_model):
    return AutoModelForImageTextToText.from_pretrained(tiny_interleaved_vl_model, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def gemma_engine(module_aio_server, tiny_interleaved_vl_model):
    # A prefill budget of 5 tokens per step: every image span (16 soft tokens) would be split if
    # the scheduler did not keep bidirectional spans in one chunk.
    config = EngineConfig(model=str(tiny_interleaved_vl_model), device="cpu", engine_process=False, kv_blocks=256,
                          max_prefill_tokens_per_step=5)
    server = module_aio_server(lambda: create_server(config))
    return engine_pb2_grpc.EngineServiceStub(server.channel())


def gemma_hf_greedy(model, request: engine_pb2.GenerateRequest, soft_token_id: int) -> list[int]:
    ids = torch.tensor([list(request.token_ids)])
    inputs = {"token_type_ids": (ids == soft_token_id).long()}
    if request.mm_features.items:
        inputs["pixel_values"] = torch.cat([tensors.to_torch(item.kwargs["pixel_values"]).reshape(1, 3, 64, 64)
                                            for item in request.mm_features.items])
    with torch.inference_mode():
        output = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                max_new_tokens=request.sampling_params.max_tokens, **inputs)
    return output[0, ids.shape[1]:].tolist()


def test_gemma3_image_prompts_mixed_with_text_equal_hf(gemma_engine, gemma_renderer, gemma_hf):
    info = gemma_engine.GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
    assert [(m.modality, m.placeholder_token) for m in info.modalities] == [
        (multimodal_pb2.MODALITY_IMAGE, "<image_soft_token>")]
    soft_token = info.modalities[0].placeholder_token_id
    requests = [
        render(gemma_renderer, text("Look:"), image(64, 48, seed=1), text("what?"), max_tokens=16),
        render(gemma_renderer, text("Just words, no picture at all."), max_tokens=12),
        render(gemma_renderer, image(40, 40, seed=2), text("and"), image(64, 64, seed=3), max_tokens=14),
        render(gemma_renderer, text("Short."), max_tokens=10),
    ]
    assert any(item.placeholder.is_embed for item in requests[0].mm_features.items)  # interleaved span
    expected = [gemma_hf_greedy(gemma_hf, request, soft_token) for request in requests]
    assert generate(gemma_engine, requests[0]) == expected[0]  # alone
    results: list = [None] * len(requests)

    def run(index: int) -> None:
        results[index] = generate(gemma_engine, requests[index])

    threads = [threading.Thread(target=run, args=(index,)) for index in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(TIMEOUT)
    assert results == expected
