"""vLLM's serialized media items (`features.kwargs_data` / `mm_metadata`: base64 of vLLM's msgpack
of a `MultiModalKwargsItem`) <-> tito's per-item tensors (an item's `kwargs` and `metadata`).

Domain code: no HTTP here. The format is vLLM's own classes packed by vLLM's own encoder, so
only vLLM can read or write it: where the vllm package is not installed, `available()` is false
and the caller answers a 400 naming the field. vLLM is imported on first use (seconds), never
at the gateway's start.

The mapping, field by field: a field vLLM keeps on the CPU (`keep_on_cpu`, e.g. Qwen2-VL's
`image_grid_thw`) is tito's metadata, every other field is tito's kwargs (encoder input). A
`batched` field holds one item's row (`[3]`), which tito carries with its leading item axis
(`[1, 3]`); a `flat` field holds the item's slice along dimension 0 (`pixel_values`
`[patches, C*T*P*P]`), as tito does. Written back the same way, so a Qwen2-VL item round-trips
into exactly the fields vLLM's own processor builds.

The bytes are the caller's: vLLM's decoder unpickles its pickle extension types when
`VLLM_ALLOW_INSECURE_SERIALIZATION` is set in the process, so with that variable set the gateway
refuses to decode any item (400) rather than run a caller's pickle."""

from __future__ import annotations

import binascii
import os
from functools import cache

from tito import tensors
from tito.v1 import tensor_pb2
from tito_gateway.openai_in import invalid, unsupported

#: vLLM's switch that makes its decoder unpickle (see the module's docstring).
INSECURE = "VLLM_ALLOW_INSECURE_SERIALIZATION"
#: The largest base64 string taken for one item (the body's own limit bounds it too).
MAX_ITEM_CHARS = 64 << 20


def available() -> bool:
    """Whether vLLM's serializer can be imported here."""
    return _codec() is not None


@cache
def _codec():
    try:
        from vllm.entrypoints.scale_out.token_in_token_out import mm_serde
        from vllm.multimodal.inputs import (MultiModalBatchedField, MultiModalFieldConfig, MultiModalFieldElem,
                                            MultiModalFlatField, MultiModalKwargsItem)
    except ImportError:
        return None
    return mm_serde, MultiModalBatchedField, MultiModalFlatField, MultiModalFieldConfig, MultiModalFieldElem, \
        MultiModalKwargsItem


def decode_item(data: object, where: str) -> tuple[dict[str, tensor_pb2.Tensor], dict[str, tensor_pb2.Tensor]]:
    """One serialized item -> (kwargs, metadata) as tito's tensors. A string vLLM cannot read,
    or a field layout tito has no tensor for, is a 400 naming `where`."""
    codec = _codec()
    if codec is None:
        raise unsupported(where, "vLLM's serialized media items need the vllm package on the gateway; send "
                                 "content_parts (the gateway renders the media) or features the engine holds")
    mm_serde, batched, flat = codec[0], codec[1], codec[2]
    if os.environ.get(INSECURE, "").strip().lower() not in ("", "0", "false"):
        raise unsupported(where, f"the gateway does not read serialized media items while {INSECURE} is set (vLLM's "
                                 f"decoder would unpickle them); send content_parts")
    if not isinstance(data, str) or len(data) > MAX_ITEM_CHARS:
        raise invalid(where, "must be a base64 string of a serialized MultiModalKwargsItem")
    try:
        item = mm_serde.decode_mm_kwargs_item(data)
    except (binascii.Error, ValueError, TypeError, KeyError, AttributeError, IndexError) as exc:
        raise invalid(where, f"is not a serialized MultiModalKwargsItem: {str(exc)[:200]}") from None
    except Exception as exc:  # msgspec's DecodeError and the like: still the caller's bytes
        raise invalid(where, f"is not a serialized MultiModalKwargsItem: {type(exc).__name__}") from None
    kwargs: dict[str, tensor_pb2.Tensor] = {}
    metadata: dict[str, tensor_pb2.Tensor] = {}
    for name, elem in item.items():
        at = f"{where}.{name[:64]}"
        value = elem.data
        if not hasattr(value, "shape") or not hasattr(value, "dtype"):
            raise unsupported(at, "only tensor fields are supported (no nested lists)")
        if isinstance(elem.field, batched):
            value = value.unsqueeze(0)  # tito keeps the item axis
        elif not isinstance(elem.field, flat) or elem.field.dim != 0:
            raise unsupported(at, f"a {type(elem.field).__name__} field is not supported (batched, or flat "
                                  f"along dimension 0)")
        try:
            tensor = tensors.from_torch(value.contiguous())
        except (KeyError, ValueError, TypeError) as exc:
            raise unsupported(at, f"dtype {value.dtype} is not supported: {exc}") from None
        (metadata if elem.field.keep_on_cpu else kwargs)[name] = tensor
    return kwargs, metadata


def encode_item(kwargs: dict[str, tensor_pb2.Tensor], metadata: dict[str, tensor_pb2.Tensor]) -> str:
    """tito's item tensors -> vLLM's serialized item (kwargs flat along dimension 0, metadata
    batched and kept on the CPU), as vLLM's own render writes `kwargs_data`."""
    mm_serde, batched, flat, _, elem_type, item_type = _codec()
    elems = {}
    for name, tensor in kwargs.items():
        value = tensors.to_torch(tensor, name)
        elems[name] = elem_type(data=value, field=flat(slices=[slice(0, value.shape[0])], dim=0))
    for name, tensor in metadata.items():
        value = tensors.to_torch(tensor, name)
        if value.ndim and value.shape[0] == 1:
            elems[name] = elem_type(data=value[0], field=batched(keep_on_cpu=True))
        else:
            elems[name] = elem_type(data=value, field=flat(slices=[slice(0, value.shape[0])], dim=0,
                                                           keep_on_cpu=True))
    return mm_serde.encode_mm_kwargs_item(item_type(elems))
