"""SMG's preprocessed media (`mm_inputs`, then each of `extra_mm_inputs`: one batch per modality)
as tito's media items (protobuf only), so media through this face passes the same admission as
tito.v1's `mm_features` (placeholders, tensor sizes, encoder rows, signatures).

A batch carries every item of its modality at once; it is cut into items the way SMG's vLLM
servicer lays it out: a tensor named in `flat_keys` is split along its first axis by the sizes
tensor named there (a `[n, 3]` grid gives each item t*h*w rows), one in `batched_keys` has one row
per item, any other is shared by every item. A sizes tensor of one count per item (`[n]`: SMG's
`patches_per_image` beside its Qwen-VL and Llama4 pixel rows) is the layout's, not the model's: it
cuts, then it is dropped (a `[n, 3]` grid sizes the rows and is also the model's). The primary
tensor (`pixel_values`, or `encoder_input_key`) is the item's encoder input, renamed
`pixel_values_videos` for video as vLLM does; the model-specific tensors (`image_grid_thw`, ...)
are its metadata. Each placeholder's `is_embed` is where the prompt holds `im_token_id` (None when
every position does), as SMG's servicer expands it. The items are unsigned: an engine with
`--require-signed-features` refuses them with its usual reason.
"""

from __future__ import annotations

from collections.abc import Sequence

from smg_grpc_proto import vllm_engine_pb2
from smg_grpc_proto.generated import common_pb2

from tito.errors import InvalidArgument
from tito.media_parts import Placeholder, RawTensor
from tito.tensors import itemsize
from tito.v1 import multimodal_pb2, tensor_pb2

from tito_engine.multimodal.domain import MediaItem

UNSUPPORTED_FIELD = "UNSUPPORTED_FIELD"
INVALID_MM_PAYLOAD = "INVALID_MM_PAYLOAD"
Dtype = tensor_pb2.Dtype
DTYPES = {"float32": Dtype.DTYPE_FLOAT32, "float16": Dtype.DTYPE_FLOAT16, "bfloat16": Dtype.DTYPE_BFLOAT16,
          "float64": Dtype.DTYPE_FLOAT64, "int64": Dtype.DTYPE_INT64, "int32": Dtype.DTYPE_INT32,
          "uint8": Dtype.DTYPE_UINT8}
MODALITIES = {common_pb2.MODALITY_UNSPECIFIED: multimodal_pb2.MODALITY_IMAGE,
              common_pb2.IMAGE: multimodal_pb2.MODALITY_IMAGE, common_pb2.VIDEO: multimodal_pb2.MODALITY_VIDEO,
              common_pb2.AUDIO: multimodal_pb2.MODALITY_AUDIO}


def _bad(field: str, message: str) -> InvalidArgument:
    return InvalidArgument(message, reason=INVALID_MM_PAYLOAD, field=field)


def _tensor(data: vllm_engine_pb2.TensorData, field: str) -> RawTensor:
    if data.WhichOneof("payload") != "inline":
        raise InvalidArgument("this engine takes tensors inline only (no shared memory or remote handles): run "
                              "SMG with --multimodal-tensor-transport inline", reason=UNSUPPORTED_FIELD, field=field)
    if data.dtype not in DTYPES:
        raise _bad(f"{field}.dtype", f"dtype {data.dtype[:32]!r} is not one of {', '.join(DTYPES)}")
    return RawTensor(DTYPES[data.dtype], tuple(data.shape), data.inline)


def _sizes(tensor: RawTensor, items: int, field: str) -> list[int]:
    """Rows per item from a sizes tensor: one count per item, or a [n, 3] grid (t*h*w each)."""
    if tensor.dtype not in (Dtype.DTYPE_INT64, Dtype.DTYPE_INT32):
        raise _bad(field, "a sizes tensor must be int64 or int32")
    width = itemsize(tensor.dtype)
    values = [int.from_bytes(tensor.data[i:i + width], "little", signed=True)
              for i in range(0, len(tensor.data), width)]
    if len(tensor.shape) == 2 and tensor.shape[0] == items and len(values) == items * tensor.shape[1]:
        columns = tensor.shape[1]
        rows = []
        for item in range(items):
            product = 1
            for value in values[item * columns:(item + 1) * columns]:
                product *= value
            rows.append(product)
        return rows
    if len(values) == items:
        return values
    raise _bad(field, f"a sizes tensor of shape {list(tensor.shape)} does not give one size per item ({items})")


def _split(tensor: RawTensor, rows: Sequence[int], field: str) -> list[RawTensor]:
    """`tensor` cut along its first axis into pieces of `rows` rows."""
    if not tensor.shape or sum(rows) != tensor.shape[0] or any(count < 0 for count in rows):
        raise _bad(field, f"shape {list(tensor.shape)} does not hold the items' {sum(rows)} rows")
    row_bytes = itemsize(tensor.dtype)
    for dimension in tensor.shape[1:]:
        row_bytes *= dimension
    if len(tensor.data) != row_bytes * tensor.shape[0]:
        raise _bad(field, f"{len(tensor.data)} bytes do not match shape {list(tensor.shape)}")
    pieces, start = [], 0
    for count in rows:
        pieces.append(RawTensor(tensor.dtype, (count, *tensor.shape[1:]),
                                tensor.data[start * row_bytes:(start + count) * row_bytes]))
        start += count
    return pieces


def _is_embed(prompt: Sequence[int], offset: int, length: int, token_id: int | None) -> tuple[bool, ...]:
    if token_id is None:
        return ()
    mask = tuple(token == token_id for token in prompt[offset:offset + length])
    return () if all(mask) and len(mask) == length else mask


def _batch_items(batch: vllm_engine_pb2.MultimodalInputs, prompt: Sequence[int], path: str) -> list[MediaItem]:
    count = len(batch.mm_placeholders)
    if not count:
        raise _bad(f"{path}.mm_placeholders", "a media batch needs one placeholder per item")
    if len(batch.mm_hashes) != count:
        raise _bad(f"{path}.mm_hashes", f"{len(batch.mm_hashes)} hashes for {count} placeholders: one per item")
    video = batch.modality == common_pb2.VIDEO
    primary = batch.encoder_input_key or "pixel_values"
    named: dict[str, tuple[RawTensor, bool]] = {}  # wire key -> (tensor, is an encoder input)
    if batch.HasField("pixel_values"):
        named[primary] = (_tensor(batch.pixel_values, f"{path}.pixel_values"), True)
    for key, data in batch.model_specific_tensors.items():
        named[key] = (_tensor(data, f"{path}.model_specific_tensors.{key[:64]}"), False)
    per_item: list[tuple[dict[str, RawTensor], dict[str, RawTensor]]] = [({}, {}) for _ in range(count)]
    counts_only = {key for key in batch.flat_keys.values() if key in named and len(named[key][0].shape) == 1}
    for key, (tensor, is_input) in named.items():
        if key in counts_only:
            continue
        field = f"{path}.{'pixel_values' if is_input else 'model_specific_tensors.' + key[:64]}"
        if key in batch.flat_keys:
            sizes_key = batch.flat_keys[key]
            if sizes_key not in named:
                raise _bad(f"{path}.flat_keys", f"{key[:64]!r} is sized by {sizes_key[:64]!r}, which is not sent")
            pieces = _split(tensor, _sizes(named[sizes_key][0], count, f"{path}.flat_keys"), field)
        elif key in batch.batched_keys:
            pieces = _split(tensor, [1] * count, field)
        else:
            pieces = [tensor] * count
        name = "pixel_values_videos" if video and key == "pixel_values" else key
        for item, piece in zip(per_item, pieces):
            item[0 if is_input else 1][name] = piece
    token_id = batch.im_token_id if batch.HasField("im_token_id") else None
    return [MediaItem(modality=MODALITIES.get(batch.modality, batch.modality), mm_hash=mm_hash,
                      placeholder=Placeholder(place.offset, place.length,
                                              _is_embed(prompt, place.offset, place.length, token_id)),
                      kwargs=kwargs, metadata=metadata)
            for place, mm_hash, (kwargs, metadata) in zip(batch.mm_placeholders, batch.mm_hashes, per_item)]


def media_from_proto(request: vllm_engine_pb2.GenerateRequest, prompt: Sequence[int]) -> tuple[MediaItem, ...]:
    """Every batch's items, `mm_inputs` first, in prompt order (admission wants them so)."""
    batches = [("mm_inputs", request.mm_inputs)] if request.HasField("mm_inputs") else []
    batches += [(f"extra_mm_inputs[{i}]", batch) for i, batch in enumerate(request.extra_mm_inputs)]
    items = [item for path, batch in batches for item in _batch_items(batch, prompt, path)]
    return tuple(sorted(items, key=lambda item: item.placeholder.offset))
