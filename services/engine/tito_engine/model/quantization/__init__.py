"""Quantized linears for the native forward: the projections of every layer (q/k/v, o, gate/up,
down) and the output layer swapped for quantized ones once the model is loaded.

int4 checkpoints in GPTQ's, AWQ's and compressed-tensors' layouts (int4_checkpoint.py:
`quantization_config` in config.json picks them, no flag; `scheme_for`) run their projections as
Int4Linear (int4.py); their output layer stays float, as those checkpoints store it.

`--quantization int8` (`quantize_linears`): weight-only int8 per output channel (int8.py), computed
at load from any float checkpoint. The output layer is quantized too: in a c=1 decode it is the
largest single read (Qwen2.5-0.5B: 136 M of its 494 M parameters); when it is tied to the
embedding, the embedding keeps its float rows for the lookup and the output layer reads an int8
copy. Embeddings and norms stay float.

The families (families.py) hold each projection as an object called with `[rows, in]`; this
package only replaces those objects, so the forward is the same code quantized or not.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from tito.config import ConfigError

from tito_engine.model.linear import Linear
from tito_engine.model.quantization.int4_checkpoint import Int4Checkpoint, Int4Weights, checkpoint_quantization
from tito_engine.model.quantization.int4 import Int4Linear
from tito_engine.model.quantization.int8 import Int8Linear, int8_linear

__all__ = ["SCHEMES", "Int4Checkpoint", "Int4Linear", "Int8Linear", "QuantizedLinears", "checkpoint_quantization",
           "quantize_linears", "scheme_for"]

#: What `--quantization` takes: none (the checkpoint's weights as they are) or int8.
SCHEMES = ("none", "int8")
_PROJECTIONS = ("qkv", "o", "gate_up", "down")


@dataclass(frozen=True)
class QuantizedLinears:
    """What quantizing did: how many linears, their bytes as stored now, and the float bytes freed."""

    count: int = 0
    quantized_bytes: int = 0
    float_bytes_freed: int = 0


def scheme_for(model_dir: Any, quantization: str) -> "str | Int4Checkpoint":
    """What a checkpoint's linears run in: `--quantization` (SCHEMES) for a float checkpoint, the
    checkpoint's own int4 layout for a quantized one. A layout the native engine does not load, or
    --quantization on an already quantized checkpoint, raises ConfigError (in one line)."""
    int4 = checkpoint_quantization(model_dir)
    if int4 is None:
        return quantization
    if quantization != "none":
        raise ConfigError(f"--quantization {quantization}: {model_dir} is already quantized ({int4.method} int4); "
                          f"drop the flag")
    return int4


def _slots(family: Any) -> Iterator[tuple[Any, str]]:
    """(owner, attribute) of every linear the scheme replaces: each layer's four, then the output layer."""
    for layer in family.layers:
        for name in _PROJECTIONS:
            yield layer, name
    yield family, "lm_head"


def _free_float(linear: Linear) -> int:
    """Drop the float weight of `linear` from the Hugging Face modules that share it; bytes freed
    (0 for a tied output layer, whose weight the embedding still reads)."""
    if not linear.sources:
        return 0
    for module in linear.sources:
        module.weight = torch.nn.Parameter(torch.empty(0, dtype=linear.weight.dtype), requires_grad=False)
    return linear.weight.numel() * linear.weight.element_size()


def _int4_linear(linear: Linear, config: Int4Checkpoint, names: dict[int, str]) -> Int4Linear | None:
    """The Int4Linear of a (fused) linear whose modules the checkpoint stores in int4;
    None when it stores them in float."""
    parts = [config.tensors.get(names.get(id(module), "")) for module in linear.sources]
    if all(part is None for part in parts):
        return None
    if any(part is None for part in parts):
        modules = [names.get(id(module)) for module in linear.sources]
        raise ConfigError(f"an int4 checkpoint with only some of {modules} quantized is not loaded (they run fused)")
    weights = Int4Weights(torch.cat([part.q for part in parts]), torch.cat([part.scales for part in parts]),
                          torch.cat([part.zeros for part in parts]), parts[0].group_size)
    return Int4Linear(weights, linear.bias, linear.weight.dtype, linear.weight.device)


def _load_int4(family: Any, config: Int4Checkpoint, model: Any) -> QuantizedLinears:
    names = {id(module): name for name, module in model.named_modules()}
    count = quantized = freed = 0
    for owner, name in _slots(family):
        linear = getattr(owner, name)
        replacement = _int4_linear(linear, config, names) if isinstance(linear, Linear) else None
        if replacement is None:
            continue
        setattr(owner, name, replacement)
        freed += _free_float(linear)
        count, quantized = count + 1, quantized + replacement.weight_bytes
    config.tensors.clear()  # the unpacked copies are the linears' now
    return QuantizedLinears(count, quantized, freed)


def quantize_linears(family: Any, scheme: "str | Int4Checkpoint", model: Any = None) -> QuantizedLinears:
    """Replace the family's linears by `scheme`'s (see SCHEMES, or an int4 checkpoint's weights,
    found by the names of `model`'s modules); none: nothing changes."""
    if isinstance(scheme, Int4Checkpoint):
        return _load_int4(family, scheme, model)
    if scheme == "none":
        return QuantizedLinears()
    if scheme != "int8":
        raise ValueError(f"unknown quantization {scheme!r}: one of {', '.join(SCHEMES)}")
    count = quantized = freed = 0
    for owner, name in _slots(family):
        linear = getattr(owner, name)
        replacement = int8_linear(linear.weight, linear.bias)
        setattr(owner, name, replacement)
        freed += _free_float(linear)
        count, quantized = count + 1, quantized + replacement.weight_bytes
    return QuantizedLinears(count, quantized, freed)
