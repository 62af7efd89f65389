"""Media through SMG's face: a Qwen2-VL request as SMG sends it (one `mm_inputs` batch: the
images' pixel rows concatenated, their grids, placeholders, hashes, `flat_keys`/`batched_keys`)
gives the same tokens as the same images through tito.v1's `mm_features`; malformed batches and
unsigned items on a signing engine are refused with tito's reasons."""

from __future__ import annotations

import grpc
import pytest
from smg_grpc_proto import vllm_engine_pb2, vllm_engine_pb2_grpc
from smg_grpc_proto.generated import common_pb2

from tito.grpc_errors import error_details
from tito.v1 import chat_pb2, engine_pb2, engine_pb2_grpc, multimodal_pb2, render_pb2, tensor_pb2
from tito_engine.config import EngineConfig
from tito_engine.server import create_server
from tito_render.convert import chat_response

from chat_parts import image, text
from engine_calls import collect
from smg_calls import read_stream

TIMEOUT = 60
DTYPE_NAMES = {tensor_pb2.DTYPE_FLOAT32: "float32", tensor_pb2.DTYPE_INT64: "int64"}


def render(renderer, *parts) -> engine_pb2.GenerateRequest:
    request = render_pb2.RenderChatRequest(
        messages=[chat_pb2.ChatMessage(role="user", content_parts=list(parts))],
        mm_payload=multimodal_pb2.MM_PAYLOAD_TENSORS, sampling=render_pb2.SamplingOptions(max_tokens=10,
                                                                                       temperature=0.0))
    return chat_response(renderer, request).generate_request


def _concat(tensors) -> vllm_engine_pb2.TensorData:
    first = tensors[0]
    shape = [sum(t.shape[0] if len(t.shape) > 1 else 1 for t in tensors), *first.shape[-1:]]
    return vllm_engine_pb2.TensorData(shape=shape, dtype=DTYPE_NAMES[first.dtype], inline=b"".join(t.data
                                                                                                   for t in tensors))


def as_smg(generate: engine_pb2.GenerateRequest, placeholder_id: int,
           request_id: str) -> vllm_engine_pb2.GenerateRequest:
    """`generate` (rendered for tito.v1) as SMG sends it: one image batch."""
    items = generate.mm_features.items
    batch = vllm_engine_pb2.MultimodalInputs(
        pixel_values=_concat([item.kwargs["pixel_values"] for item in items]),
        model_specific_tensors={"image_grid_thw": _concat([item.metadata["image_grid_thw"] for item in items])},
        im_token_id=placeholder_id, mm_hashes=[item.mm_hash for item in items],
        mm_placeholders=[vllm_engine_pb2.PlaceholderRange(offset=item.placeholder.offset,
                                                          length=item.placeholder.length) for item in items],
        batched_keys=["image_grid_thw"], flat_keys={"pixel_values": "image_grid_thw"}, modality=common_pb2.IMAGE)
    return vllm_engine_pb2.GenerateRequest(
        request_id=request_id, stream=True, tokenized=vllm_engine_pb2.TokenizedInput(input_ids=generate.token_ids),
        sampling_params=vllm_engine_pb2.SamplingParams(temperature=0.0, max_tokens=10), mm_inputs=batch)


def engine(module_aio_server, model, **overrides):
    config = EngineConfig(model=str(model), device="cpu", engine_process=False, **overrides)
    channel = module_aio_server(lambda: create_server(config)).channel()
    return vllm_engine_pb2_grpc.VllmEngineStub(channel), engine_pb2_grpc.EngineServiceStub(channel)


@pytest.fixture(scope="module")
def stubs(module_aio_server, tiny_vl_model):
    return engine(module_aio_server, tiny_vl_model)


@pytest.fixture(scope="module")
def placeholder_id(stubs) -> int:
    info = stubs[1].GetModelInfo(engine_pb2.EngineServiceGetModelInfoRequest(), timeout=TIMEOUT)
    return next(m.placeholder_token_id for m in info.modalities if m.modality == multimodal_pb2.MODALITY_IMAGE)


def test_two_images_give_tito_v1s_tokens(stubs, renderer, placeholder_id):
    smg, tito = stubs
    generate = render(renderer, text("compare"), image(56, 56, 1), text("and"), image(84, 56, 2))
    assert len(generate.mm_features.items) == 2
    expected, _ = collect(tito.Generate(generate, timeout=TIMEOUT))
    got = read_stream(smg.Generate(as_smg(generate, placeholder_id, "two-images"), timeout=TIMEOUT))
    assert got.tokens() == expected[0] and got.completes[0].finish_reason == "length"
    info = smg.GetModelInfo(vllm_engine_pb2.GetModelInfoRequest(), timeout=TIMEOUT)
    assert info.supports_vision
    # SMG holds a request to the engine's media limit (--max-mm-items, default 64) before sending it.
    server = smg.GetServerInfo(vllm_engine_pb2.GetServerInfoRequest(), timeout=TIMEOUT)
    assert server.mm_item_limits == "image=64,video=64"


def _refusal(smg, message) -> dict:
    with pytest.raises(grpc.RpcError) as caught:
        list(smg.Generate(message, timeout=TIMEOUT))
    return error_details(caught.value)


def test_malformed_batches_are_refused_naming_the_field(stubs, renderer, placeholder_id):
    smg, _ = stubs
    generate = render(renderer, text("look"), image(56, 56, 3))
    past = as_smg(generate, placeholder_id, "past")
    past.mm_inputs.mm_placeholders[0].offset = len(generate.token_ids) + 5
    details = _refusal(smg, past)
    assert details["code"] == grpc.StatusCode.INVALID_ARGUMENT and details["fields"][0].startswith("mm_inputs"), details
    short = as_smg(generate, placeholder_id, "short")
    short.mm_inputs.pixel_values.inline = short.mm_inputs.pixel_values.inline[:-4]
    details = _refusal(smg, short)
    assert details["reason"] == "INVALID_MM_PAYLOAD" and details["fields"] == ["mm_inputs.pixel_values"]
    hashless = as_smg(generate, placeholder_id, "hashless")
    del hashless.mm_inputs.mm_hashes[:]
    assert _refusal(smg, hashless)["fields"] == ["mm_inputs.mm_hashes"]
    shm = as_smg(generate, placeholder_id, "shm")
    shm.mm_inputs.pixel_values.shm.name = "/smg-0"
    assert _refusal(smg, shm)["reason"] == "UNSUPPORTED_FIELD"
    # The engine still serves.
    assert read_stream(smg.Generate(as_smg(generate, placeholder_id, "after"), timeout=TIMEOUT)).completes[0]


def test_a_signing_engine_refuses_smgs_unsigned_items_as_tito_v1s(module_aio_server, tiny_vl_model, renderer,
                                                                  placeholder_id, tmp_path):
    key = tmp_path / "hmac.key"
    key.write_text("smg-face-test-key-0123456789abcdef\n")
    smg, tito = engine(module_aio_server, tiny_vl_model, hmac_key_file=str(key), require_signed_features=True)
    generate = render(renderer, text("look"), image(56, 56, 4))  # unsigned: this renderer has no key
    with pytest.raises(grpc.RpcError) as caught:
        list(tito.Generate(generate, timeout=TIMEOUT))
    expected = error_details(caught.value)
    details = _refusal(smg, as_smg(generate, placeholder_id, "unsigned"))
    assert details["code"] == expected["code"] and details["reason"] == expected["reason"]
