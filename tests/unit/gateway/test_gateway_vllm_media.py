"""Media on vLLM's token-in/token-out API over a fake of the three services (the fake render
gives an image IMAGE_SPAN placeholder ids and an item with metadata and, when asked, tensors):
`content_parts` rendered by render and placed in the caller's ids (expanded or as the one-token
marker), hashes-only `features` sent with the metadata the gateway kept, vLLM's serialized
tensors (`mm_payload` "tensors", `kwargs_data`) where vLLM is installed and a 400 naming the
field where it is not, and the chat's reuse path with `kv_transfer_params.prompt_features`."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from gateway_fakes import IMAGE_SPAN, IMAGE_TOKEN, SERVED, TokensUpstream, prompt_ids_of
from starlette.testclient import TestClient

from tito.errors import InvalidArgument
from tito.v1 import multimodal_pb2
from tito_gateway.app import Gateway
from tito_gateway.vllm_api import media, mm_serde

IMAGE = "data:image/png;base64,AAAA"
OTHER_IMAGE = "data:image/png;base64,BBBB"
MEDIA_CHAT = {"model": SERVED, "max_tokens": 3, "temperature": 0, "messages": [{"role": "user", "content": [
    {"type": "text", "text": "Hi"}, {"type": "image_url", "image_url": {"url": IMAGE}}]}]}
OPENAI_KIND = "invalid_request_error"  # /v1/chat/completions answers in OpenAI's error shape
needs_vllm = pytest.mark.skipif(not mm_serde.available(), reason="vLLM's serializer is not installed")


@pytest.fixture
def upstream() -> TokensUpstream:
    return TokensUpstream(model_id=SERVED)


@pytest.fixture
def client(upstream) -> Iterator[TestClient]:
    with TestClient(Gateway(upstream).asgi(), raise_server_exceptions=False) as http:
        yield http


@pytest.fixture
def without_vllm(monkeypatch):
    monkeypatch.setattr(mm_serde, "_codec", lambda: None)


def _ok(reply) -> dict:
    assert reply.status_code == 200, reply.text
    return reply.json()


def _refused(reply, param: str, kind: str = "BadRequestError") -> dict:
    """A 400 naming `param`, in vLLM's error shape (`kind` OpenAI's on OpenAI's endpoints)."""
    assert reply.status_code == 400, reply.text
    error = reply.json()["error"]
    assert error["param"] == param and error["type"] == kind
    return error


def _sent(upstream) -> multimodal_pb2.MultiModalItem:
    (item,) = upstream.pipeline.engine.requests[-1].mm_features.items
    return item


# -- content_parts: the gateway has render render the media ---------------------------------------

def test_content_parts_are_placed_at_the_span_render_expanded(client, upstream):
    rendered = _ok(client.post("/v1/chat/completions/render", json={**MEDIA_CHAT, "mm_payload": "none"}))
    ids = rendered["token_ids"]
    answer = _ok(client.post("/inference/v1/generate", json={
        "token_ids": ids, "content_parts": [{"type": "image_url", "url": IMAGE}], "return_token_ids": True,
        "sampling_params": {"max_tokens": 2}, "cache_salt": "tenant-a"}))
    sent = upstream.pipeline.engine.requests[-1]
    item = _sent(upstream)
    assert list(sent.token_ids) == ids and answer["prompt_token_ids"] == ids
    assert sent.cache_salt == "tenant-a"  # the engine's prefix-cache keys, media or not
    assert item.placeholder.offset == ids.index(IMAGE_TOKEN) and item.placeholder.length == IMAGE_SPAN
    assert item.kwargs["pixel_values"].data and item.metadata["image_grid_thw"].data  # tensors: the encoder runs
    assert item.mm_hash == rendered["features"]["mm_hashes"]["image"][0]
    assert answer["mm_placeholders"] == {"image": [{"offset": item.placeholder.offset, "length": IMAGE_SPAN}]}


def test_a_one_token_marker_is_expanded_to_the_items_span(client, upstream):
    ids = [*prompt_ids_of("see "), IMAGE_TOKEN, *prompt_ids_of(" and "), IMAGE_TOKEN, 7]
    _ok(client.post("/inference/v1/generate", json={
        "token_ids": ids, "sampling_params": {"max_tokens": 1},
        "content_parts": [{"type": "image_url", "url": IMAGE}, {"type": "image_url", "url": OTHER_IMAGE}]}))
    sent = upstream.pipeline.engine.requests[-1]
    first, second = sent.mm_features.items
    expected = [*prompt_ids_of("see "), *[IMAGE_TOKEN] * IMAGE_SPAN, *prompt_ids_of(" and "),
                *[IMAGE_TOKEN] * IMAGE_SPAN, 7]
    assert list(sent.token_ids) == expected
    assert (first.placeholder.offset, second.placeholder.offset) == (4, 4 + IMAGE_SPAN + 5)
    assert first.mm_hash != second.mm_hash


def test_render_refusing_a_content_part_names_it(client, upstream):
    async def refuse(request, timeout=None, metadata=None):
        raise InvalidArgument("not an image", reason="MEDIA_INVALID", field="messages[0].content_parts[0].image")

    upstream.pipeline.render.RenderChat = refuse
    _refused(client.post("/inference/v1/generate", json={
        "token_ids": [IMAGE_TOKEN], "sampling_params": {}, "content_parts": [{"type": "image_url", "url": "x"}]}),
        "content_parts[0].url")


def test_place_items_refuses_ids_without_the_items_span():
    item = multimodal_pb2.MultiModalItem(mm_hash="ab" * 16, placeholder=multimodal_pb2.PlaceholderRange(
        offset=1, length=3, is_embed=[False, True, False]))
    rendered = [5, 90, 91, 90, 6]  # an interleaved span: no one-token marker to expand
    assert media.place_items([1, 90, 91, 90], rendered, [item])[1][0].placeholder.offset == 1
    with pytest.raises(InvalidArgument) as refused:
        media.place_items([1, 90, 2], rendered, [item])
    assert refused.value.field == "content_parts"


# -- hashes-only features: the metadata the gateway kept ------------------------------------------

def test_hashes_only_features_carry_the_metadata_kept_from_render(client, upstream):
    rendered = _ok(client.post("/v1/chat/completions/render", json={**MEDIA_CHAT, "mm_payload": "none"}))
    assert rendered["features"]["kwargs_data"] is None and rendered["features"]["mm_metadata"] is None
    _ok(client.post("/inference/v1/generate", json=rendered))
    item = _sent(upstream)
    assert not item.kwargs and item.metadata["image_grid_thw"].data  # tito's METADATA path
    unknown = {**rendered, "features": {**rendered["features"], "mm_hashes": {"image": ["cd" * 16]}}}
    _ok(client.post("/inference/v1/generate", json=unknown))
    assert not _sent(upstream).metadata  # nothing kept for it: the engine says what it lacks


# -- vLLM's serialized tensors ------------------------------------------------------------------

@needs_vllm
def test_render_with_tensors_writes_vllms_serialized_items_and_generate_reads_them(client, upstream):
    from vllm.entrypoints.scale_out.token_in_token_out import mm_serde as vllm_serde, protocol

    rendered = _ok(client.post("/v1/chat/completions/render", json=MEDIA_CHAT))  # vLLM's default: tensors
    protocol.GenerateRequest.model_validate(rendered)
    (data,) = rendered["features"]["kwargs_data"]["image"]
    item = vllm_serde.decode_mm_kwargs_item(data)
    assert type(item["pixel_values"].field).__name__ == "MultiModalFlatField"
    assert not item["pixel_values"].field.keep_on_cpu
    assert item["image_grid_thw"].field.keep_on_cpu and item["image_grid_thw"].data.tolist() == [1, 2, 8]
    (metadata,) = rendered["features"]["mm_metadata"]["image"]
    assert set(vllm_serde.decode_mm_kwargs_item(metadata)) == {"image_grid_thw"}
    _ok(client.post("/inference/v1/generate", json=rendered))
    sent, (render_item,) = _sent(upstream), upstream.pipeline.engine.requests[-1].mm_features.items
    assert sent.kwargs["pixel_values"] == render_item.kwargs["pixel_values"]
    assert list(sent.metadata["image_grid_thw"].shape) == [1, 3]


@needs_vllm
def test_serialized_items_round_trip_tito_tensors():
    from gateway_fakes import image_item

    item = image_item(IMAGE, 0, multimodal_pb2.MM_PAYLOAD_TENSORS)
    kwargs, metadata = mm_serde.decode_item(mm_serde.encode_item(item.kwargs, item.metadata), "x")
    assert kwargs == dict(item.kwargs) and metadata == dict(item.metadata)


@needs_vllm
def test_serialized_items_are_not_read_where_vllm_would_unpickle_them(monkeypatch):
    from gateway_fakes import image_item

    item = image_item(IMAGE, 0, multimodal_pb2.MM_PAYLOAD_TENSORS)
    data = mm_serde.encode_item(item.kwargs, item.metadata)
    monkeypatch.setenv(mm_serde.INSECURE, "1")
    with pytest.raises(InvalidArgument) as refused:
        mm_serde.decode_item(data, "features.kwargs_data.image[0]")
    assert refused.value.field == "features.kwargs_data.image[0]"


def test_without_vllm_serialized_tensors_are_a_400_naming_the_field(client, without_vllm):
    _refused(client.post("/v1/chat/completions/render", json=MEDIA_CHAT), "mm_payload")
    rendered = _ok(client.post("/v1/chat/completions/render", json={**MEDIA_CHAT, "mm_payload": "none"}))
    text = _ok(client.post("/v1/chat/completions/render", json={**MEDIA_CHAT, "messages": [
        {"role": "user", "content": "Hi"}]}))
    assert text["features"] is None
    rendered["features"]["kwargs_data"] = {"image": ["AAAA"]}
    _refused(client.post("/inference/v1/generate", json=rendered), "features.kwargs_data.image[0]")


def test_a_text_chat_never_loads_vllms_serializer(client, monkeypatch):
    def loaded():  # importing vLLM takes seconds: only a media chat may pay it
        raise AssertionError("a text chat asked for vLLM's serializer")

    monkeypatch.setattr(mm_serde, "available", loaded)
    rendered = _ok(client.post("/v1/chat/completions/render", json={**MEDIA_CHAT, "messages": [
        {"role": "user", "content": "Hi"}]}))
    assert rendered["features"] is None


# -- the chat's reuse path with prompt_features -------------------------------------------------

def test_forwarded_ids_and_features_skip_render_and_give_the_plain_chats_answer(client, upstream):
    plain = _ok(client.post("/v1/chat/completions", json=MEDIA_CHAT))
    rendered = _ok(client.post("/v1/chat/completions/render", json={**MEDIA_CHAT, "mm_payload": "none"}))
    calls = dict(upstream.pipeline.render.calls)
    reused = _ok(client.post("/v1/chat/completions", json={**MEDIA_CHAT, "kv_transfer_params": {
        "prompt_token_ids": rendered["token_ids"], "prompt_features": rendered["features"]}}))
    assert upstream.pipeline.render.calls == calls  # render was not called again
    salted = {**MEDIA_CHAT, "cache_salt": "tenant-b"}
    _ok(client.post("/v1/chat/completions", json={**salted, "kv_transfer_params": {
        "prompt_token_ids": rendered["token_ids"], "prompt_features": rendered["features"]}}))
    assert upstream.pipeline.engine.requests[-1].cache_salt == "tenant-b"  # rendered again for it: another chat
    assert reused["choices"][0]["message"] == plain["choices"][0]["message"]
    sent = upstream.pipeline.engine.requests[-1]
    assert list(sent.token_ids) == rendered["token_ids"]
    assert _sent(upstream).metadata["image_grid_thw"].data and not _sent(upstream).kwargs


def test_bad_forwarded_features_are_refused(client, upstream):
    rendered = _ok(client.post("/v1/chat/completions/render", json={**MEDIA_CHAT, "mm_payload": "none"}))
    alone = {**MEDIA_CHAT, "kv_transfer_params": {"prompt_features": rendered["features"]}}
    _refused(client.post("/v1/chat/completions", json=alone), "kv_transfer_params.prompt_features", OPENAI_KIND)
    past = {"mm_hashes": {"image": ["ab" * 16]}, "mm_placeholders": {"image": [{"offset": 1, "length": 9}]}}
    _refused(client.post("/v1/chat/completions", json={**MEDIA_CHAT, "kv_transfer_params": {
        "prompt_token_ids": [1, 2, 3], "prompt_features": past}}),
        "kv_transfer_params.prompt_features.mm_placeholders.image[0]", OPENAI_KIND)
    assert len(upstream.pipeline.engine.requests) == 0
