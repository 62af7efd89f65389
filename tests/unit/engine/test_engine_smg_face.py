"""The SMG face's domain pieces, without a server: field names, sampling fields as SMG means them,
media batches cut into items, sampling defaults, stop strings on detokenized text, the stream's
shape, block ids."""

from __future__ import annotations

import asyncio
import json
import struct

import pytest
from smg_grpc_proto import vllm_engine_pb2
from smg_grpc_proto.generated import common_pb2
from tokenizers import Tokenizer

from tito.errors import InvalidArgument
from tito.v1 import multimodal_pb2, tensor_pb2
from tito_engine.request import ChoiceOutput, FinishReason, Usage
from tito_engine.smg.convert import block_hash, mm_item_limits, sampling_from_proto, smg_field, with_smg_fields
from tito_engine.smg.facts import sampling_defaults_json
from tito_engine.smg.media import media_from_proto
from tito_engine.smg.stops import RequestStops, StopStringOptions, TokenizerSource
from tito_engine.smg.stream import face_outputs


def test_tito_field_paths_in_smgs_names():
    assert smg_field("token_ids[3]") == "tokenized.input_ids[3]"
    assert smg_field("sampling_params.top_logprobs") == "sampling_params.logprobs"
    assert smg_field("sampling_params.structured_output.regex") == "sampling_params.regex"
    assert smg_field("sampling_params.stop_token_ids[0]") == "sampling_params.stop_token_ids[0]"
    assert smg_field("mm_features.items[1].placeholder") == "mm_inputs.items[1].placeholder"
    error = with_smg_fields(InvalidArgument("token_ids[2]: out of range", reason="TOKEN_ID_OUT_OF_RANGE",
                                            field="token_ids[2]"))
    assert error.message == "tokenized.input_ids[2]: out of range" and error.field == "tokenized.input_ids[2]"
    assert isinstance(error, InvalidArgument) and error.reason == "TOKEN_ID_OUT_OF_RANGE"


def test_sampling_fields_mean_what_smgs_servicer_makes_of_them():
    unset = sampling_from_proto(vllm_engine_pb2.SamplingParams())
    assert unset.temperature is None and unset.top_p is None and unset.repetition_penalty is None
    assert unset.n is None and unset.max_tokens is None and unset.seed is None and not unset.logprobs
    params = sampling_from_proto(vllm_engine_pb2.SamplingParams(temperature=0.0, top_p=0.5, seed=-1, logprobs=0,
                                                                n=3, json_object=True))
    assert params.temperature == 0.0 and params.top_p == 0.5 and params.n == 3
    assert params.seed == (1 << 64) - 1  # int32 -1: the same 64 bits as tito's uint64
    assert params.logprobs and params.top_logprobs == 0
    assert params.structured_output.kind == "json_object"
    assert sampling_from_proto(vllm_engine_pb2.SamplingParams(json_object=False)).structured_output is None
    choice = sampling_from_proto(vllm_engine_pb2.SamplingParams(
        choice=vllm_engine_pb2.ChoiceConstraint(choices=["a", "b"]))).structured_output
    assert choice.kind == "choice" and json.loads(choice.value) == ["a", "b"]


def _tensor(dtype: str, shape, values, fmt: str) -> vllm_engine_pb2.TensorData:
    return vllm_engine_pb2.TensorData(dtype=dtype, shape=shape, inline=struct.pack(f"<{len(values)}{fmt}", *values))


def test_a_media_batch_is_cut_into_items_as_smg_lays_it_out():
    pad = 9
    prompt = [1, pad, pad, 2, 3, pad, pad, pad, pad, 4]
    grids = [1, 2, 1, 1, 2, 2]  # two items of 1*2*1 = 2 and 1*2*2 = 4 rows
    batch = vllm_engine_pb2.MultimodalInputs(
        pixel_values=_tensor("float32", [6, 2], list(range(12)), "f"),
        model_specific_tensors={"image_grid_thw": _tensor("int64", [2, 3], grids, "q"),
                                "shared": _tensor("int64", [1], [7], "q")},
        flat_keys={"pixel_values": "image_grid_thw"}, batched_keys=["image_grid_thw"], im_token_id=pad,
        mm_hashes=["h0", "h1"], modality=common_pb2.IMAGE,
        mm_placeholders=[vllm_engine_pb2.PlaceholderRange(offset=1, length=2),
                         vllm_engine_pb2.PlaceholderRange(offset=4, length=5)])
    request = vllm_engine_pb2.GenerateRequest(mm_inputs=batch)
    first, second = media_from_proto(request, prompt)
    assert first.modality == multimodal_pb2.MODALITY_IMAGE and first.mm_hash == "h0"
    assert first.kwargs["pixel_values"].shape == (2, 2) and second.kwargs["pixel_values"].shape == (4, 2)
    assert struct.unpack("<8f", second.kwargs["pixel_values"].data) == tuple(float(v) for v in range(4, 12))
    assert struct.unpack("<3q", second.metadata["image_grid_thw"].data) == (1, 2, 2)
    assert second.metadata["image_grid_thw"].shape == (1, 3)
    assert first.metadata["shared"] == second.metadata["shared"]
    assert first.placeholder.is_embed == ()  # every position is the image token
    assert second.placeholder.is_embed == (False, True, True, True, True)
    assert first.kwargs["pixel_values"].dtype == tensor_pb2.DTYPE_FLOAT32

    request.mm_inputs.modality = common_pb2.VIDEO  # (the request holds a copy of `batch`)
    video = media_from_proto(request, prompt)[0]
    assert video.modality == multimodal_pb2.MODALITY_VIDEO and "pixel_values_videos" in video.kwargs

    request.mm_inputs.pixel_values.inline = batch.pixel_values.inline[:-4]
    with pytest.raises(InvalidArgument) as caught:
        media_from_proto(request, prompt)
    assert caught.value.field == "mm_inputs.pixel_values" and caught.value.reason == "INVALID_MM_PAYLOAD"


def test_smgs_per_item_patch_counts_cut_the_rows_and_stay_off_the_items():
    """SMG's Qwen-VL layout (smg 1.13): pixel rows sized by `patches_per_image` ([n] counts, only
    the layout's), `image_grid_thw` batched (the model's)."""
    batch = vllm_engine_pb2.MultimodalInputs(
        pixel_values=_tensor("float32", [6, 2], list(range(12)), "f"),
        model_specific_tensors={"image_grid_thw": _tensor("int64", [2, 3], [1, 2, 1, 1, 2, 2], "q"),
                                "patches_per_image": _tensor("int64", [2], [2, 4], "q")},
        flat_keys={"pixel_values": "patches_per_image"}, batched_keys=["image_grid_thw", "patches_per_image"],
        mm_hashes=["h0", "h1"], modality=common_pb2.IMAGE,
        mm_placeholders=[vllm_engine_pb2.PlaceholderRange(offset=1, length=2),
                         vllm_engine_pb2.PlaceholderRange(offset=4, length=5)])
    first, second = media_from_proto(vllm_engine_pb2.GenerateRequest(mm_inputs=batch), list(range(10)))
    assert first.kwargs["pixel_values"].shape == (2, 2) and second.kwargs["pixel_values"].shape == (4, 2)
    assert set(first.metadata) == set(second.metadata) == {"image_grid_thw"}
    assert struct.unpack("<3q", second.metadata["image_grid_thw"].data) == (1, 2, 2)


def test_sampling_defaults_follow_the_generation_config():
    assert sampling_defaults_json({"do_sample": False, "temperature": 0.7}) == '{"temperature":0.0}'
    assert json.loads(sampling_defaults_json({"temperature": 0.7, "top_k": 20, "max_length": 9})) == \
        {"temperature": 0.7, "top_k": 20}
    assert sampling_defaults_json({}) == ""


@pytest.fixture(scope="module")
def source(tiny_text_model):
    return TokenizerSource(tiny_text_model, 1013)


def test_stop_strings_end_at_the_token_that_completes_them(source, tiny_text_model):
    tokenizer = Tokenizer.from_file(str(tiny_text_model / "tokenizer.json"))
    ids = tokenizer.encode("hello world, this is a test").ids
    stops = RequestStops(source, StopStringOptions(("is a",)), [5, 6])
    # Fed in two messages: the hit counts the tokens of the message that completed it.
    assert stops.feed(0, tuple(ids[:4])) is None
    hit = stops.feed(0, tuple(ids[4:]))
    text_before = tokenizer.decode(ids[:4 + hit.kept])
    assert "is a" in text_before and "is a" not in tokenizer.decode(ids[:3 + hit.kept])
    assert hit.stop == "is a" and hit.completion_tokens == 4 + hit.kept and stops.ended_a_choice
    # Another choice has its own text; min_tokens keeps the first tokens out of the match.
    assert stops.feed(1, tuple(ids[:2])) is None
    late = RequestStops(source, StopStringOptions(("is a",), min_tokens=len(ids)), [5, 6])
    assert late.feed(0, tuple(ids)) is None


def _outputs(*outputs):
    async def stream():
        for output in outputs:
            yield output
    return stream()


def _run(generator):
    async def collect():
        return [item async for item in generator]
    return asyncio.run(collect())


def test_the_stream_shape_and_a_non_streamed_answer():
    outputs = [ChoiceOutput(0, (1, 2)), ChoiceOutput(1, (5,)), ChoiceOutput(1, (6,), FinishReason.LENGTH,
                                                                           usage=Usage(3, 2)),
               ChoiceOutput(0, (3,), FinishReason.STOP, 3, Usage(3, 3)), ChoiceOutput(0, (99,))]
    streamed = _run(face_outputs(_outputs(*outputs), choices=2, stream=True, prompt_tokens=3))
    assert [(f.output.index, f.output.token_ids) for f in streamed] == [(0, (1, 2)), (1, (5,)), (1, (6,)), (0, (3,))]
    whole = _run(face_outputs(_outputs(*outputs), choices=2, stream=False, prompt_tokens=3))
    assert [(f.output.index, f.output.token_ids, f.output.finish_reason) for f in whole] == \
        [(0, (1, 2, 3), FinishReason.STOP), (1, (5, 6), FinishReason.LENGTH)]


def test_kv_block_ids_fold_to_the_integer_vllm_sends():
    digest = bytes(range(24)) + (0xFFFFFFFFFFFFFFFF).to_bytes(8, "big")
    assert block_hash(digest) == -1
    assert block_hash(bytes(24) + (5).to_bytes(8, "big")) == 5
    assert block_hash(1 << 63) == -(1 << 63)


def test_media_item_limits_label_the_modalities_a_router_request_carries():
    assert mm_item_limits(("video", "image"), 64) == "image=64,video=64"
    assert mm_item_limits(("image",), 8) == "image=8"
    assert mm_item_limits(("audio",), 8) == mm_item_limits((), 64) == ""  # none SMG's label names; a text model
