"""PEFT LoRA adapters on disk: where they may be read from, and what a valid one holds.

An adapter is a directory as PEFT's `save_pretrained` writes it: `adapter_config.json` (method,
rank `r`, `lora_alpha`, `use_rslora`, target modules) and `adapter_model.safetensors` (one
`lora_A` [r, in] and one `lora_B` [out, r] per adapted module of each layer). The engine reads
only directories under its `--lora-dir` (a caller names a path, so without the root any file the
engine can read would be one RPC away), and checks every tensor against the base model's shapes
before anything reaches the model: an adapter for another base model is refused here, naming the
tensor, never applied.

Every refusal is an InvalidArgument naming `lora_path` (the caller's field) with a reason the
contract lists (proto/tito/v1/errors.proto, LORA_*).
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tito.errors import InvalidArgument

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"

#: The modules PEFT targets in Llama-style decoders (Qwen2/Qwen3/Llama/Mistral), the ones the
#: native engine applies adapters to.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

PATH_FIELD = "lora_path"
PATH_NOT_ALLOWED = "LORA_PATH_NOT_ALLOWED"
ADAPTER_INVALID = "LORA_ADAPTER_INVALID"
BASE_MISMATCH = "LORA_BASE_MISMATCH"
RANK_TOO_LARGE = "LORA_RANK_TOO_LARGE"

# PEFT's keys: base_model.model.model.layers.3.self_attn.q_proj.lora_A.weight (a VLM's language
# model adds `.language_model`).
_KEY = re.compile(r"layers\.(\d+)\.(?:self_attn|mlp)\.(\w+)\.lora_([AB])\.weight$")


@dataclass(frozen=True)
class BaseShapes:
    """What an adapter must fit: the base model's layers and each target's (out, in) features."""

    num_layers: int
    features: dict[str, tuple[int, int]]  # target module -> (out_features, in_features)


@dataclass(frozen=True)
class LoraAdapter:
    """A checked adapter: its weights per (layer, module) as (A [r, in], B [out, r]) and how
    they scale (PEFT: lora_alpha / r, or lora_alpha / sqrt(r) under use_rslora)."""

    rank: int
    scaling: float
    targets: tuple[str, ...]  # sorted
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]
    #: sha256 of the config and weights: what the prefix cache keys blocks by, so an adapter
    #: reloaded under the same name with other weights never meets the old one's blocks.
    fingerprint: str


def resolve_adapter_dir(root: Path, path: str) -> Path:
    """`path` (relative to `root`, or absolute) as a directory inside `root`, symlinks resolved;
    anything else is refused."""
    if not path:
        raise InvalidArgument("lora_path is empty: name the adapter's directory under the engine's --lora-dir",
                              reason=PATH_NOT_ALLOWED, field=PATH_FIELD)
    base = root.resolve()
    try:
        candidate = (base / path).resolve()
        inside = candidate == base or base in candidate.parents
        is_dir = inside and candidate.is_dir()
    except (OSError, ValueError) as exc:  # a NUL byte, a name longer than the file system takes
        raise InvalidArgument(f"lora_path {path[:200]!r} is not a usable path ({exc})", reason=PATH_NOT_ALLOWED,
                              field=PATH_FIELD) from None
    if not inside:
        raise InvalidArgument(f"lora_path {path[:200]!r} is outside the engine's --lora-dir; adapters are loaded "
                              f"only from directories under it", reason=PATH_NOT_ALLOWED, field=PATH_FIELD)
    if not is_dir:
        raise InvalidArgument(f"lora_path {path[:200]!r} is not a directory under the engine's --lora-dir",
                              reason=ADAPTER_INVALID, field=PATH_FIELD)
    return candidate


def read_adapter_config(directory: Path, max_rank: int) -> dict[str, Any]:
    """The adapter's checked adapter_config.json (rank within `max_rank`), its weights file
    present: what a backend that reads the weights itself (vLLM) is handed."""
    config = _parse_config(_read(directory / CONFIG_FILE))
    _check_rank(config["r"], max_rank)
    if not (directory / WEIGHTS_FILE).is_file():
        raise _invalid(f"the adapter has no {WEIGHTS_FILE}; PEFT's save_pretrained writes {CONFIG_FILE} and "
                       f"{WEIGHTS_FILE}")
    return config


def _check_rank(rank: int, max_rank: int) -> None:
    if rank > max_rank:
        raise InvalidArgument(f"the adapter's rank {rank} exceeds the engine's --max-lora-rank {max_rank}",
                              reason=RANK_TOO_LARGE, field=PATH_FIELD)


def read_adapter(directory: Path, shapes: BaseShapes, max_rank: int, dtype: torch.dtype) -> LoraAdapter:
    """The adapter in `directory`, checked against the base model and the rank limit."""
    config_bytes = _read(directory / CONFIG_FILE)
    weight_bytes = _read(directory / WEIGHTS_FILE)
    config = _parse_config(config_bytes)
    rank = config["r"]
    _check_rank(rank, max_rank)
    alpha = float(config.get("lora_alpha", rank))
    scaling = alpha / math.sqrt(rank) if config.get("use_rslora") else alpha / rank
    weights = _weights(_parse_tensors(weight_bytes), shapes, rank, dtype)
    digest = hashlib.sha256(config_bytes + b"\0" + weight_bytes).hexdigest()
    targets = tuple(sorted({module for _, module in weights}))
    return LoraAdapter(rank, scaling, targets, weights, digest)


def _invalid(message: str) -> InvalidArgument:
    return InvalidArgument(message, reason=ADAPTER_INVALID, field=PATH_FIELD)


def _read(path: Path) -> bytes:
    try:
        return path.read_bytes()
    except OSError as exc:
        raise _invalid(f"the adapter's {path.name} cannot be read ({exc.strerror or exc}); PEFT's "
                       f"save_pretrained writes {CONFIG_FILE} and {WEIGHTS_FILE}") from None


def _parse_config(raw: bytes) -> dict[str, Any]:
    try:
        config = json.loads(raw)
    except ValueError as exc:
        raise _invalid(f"{CONFIG_FILE} is not JSON ({exc})") from None
    if not isinstance(config, dict):
        raise _invalid(f"{CONFIG_FILE} is not a JSON object")
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise _invalid(f"{CONFIG_FILE} describes a {config.get('peft_type')} adapter; the engine serves LoRA only")
    rank = config.get("r")
    if not isinstance(rank, int) or isinstance(rank, bool) or rank < 1:
        raise _invalid(f"{CONFIG_FILE} has no valid rank r (got {rank!r})")
    # What would change the math beyond A, B and one scale per adapter: refused, not ignored.
    unserved = [key for key in ("use_dora", "fan_in_fan_out", "modules_to_save", "rank_pattern", "alpha_pattern")
                if config.get(key)]
    if config.get("bias", "none") != "none":
        unserved.append("bias")
    if unserved:
        raise _invalid(f"{CONFIG_FILE} sets {', '.join(unserved)}, which the engine does not serve (plain LoRA: "
                       f"one rank and one alpha, no bias, no extra trained modules)")
    return config


def _parse_tensors(raw: bytes) -> dict[str, torch.Tensor]:
    from safetensors.torch import load as load_safetensors

    try:
        return load_safetensors(raw)
    except Exception as exc:  # noqa: BLE001 - safetensors raises several types for damaged files
        raise _invalid(f"{WEIGHTS_FILE} is not a readable safetensors file ({exc})") from None


def _weights(tensors: dict[str, torch.Tensor], shapes: BaseShapes, rank: int, dtype: torch.dtype
             ) -> dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]]:
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, tensor in tensors.items():
        match = _KEY.search(key)
        if match is None:
            raise _invalid(f"{WEIGHTS_FILE} holds {key!r}, which is not a LoRA weight of a decoder layer's "
                           f"{'/'.join(TARGET_MODULES)}")
        layer, module, half = int(match.group(1)), match.group(2), match.group(3)
        if module not in TARGET_MODULES:
            raise _invalid(f"{key!r} adapts {module}; the engine applies adapters to {', '.join(TARGET_MODULES)}")
        if layer >= shapes.num_layers:
            raise InvalidArgument(f"{key!r} adapts layer {layer} but the base model has {shapes.num_layers} layers: "
                                  f"the adapter was trained for another model", reason=BASE_MISMATCH,
                                  field=PATH_FIELD)
        halves.setdefault((layer, module), {})[half] = tensor
    if not halves:
        raise _invalid(f"{WEIGHTS_FILE} holds no LoRA weights")
    weights = {}
    for (layer, module), pair in sorted(halves.items()):
        if set(pair) != {"A", "B"}:
            raise _invalid(f"layer {layer} {module} has lora_{'A' if 'A' not in pair else 'B'} missing")
        out_features, in_features = shapes.features[module]
        a, b = pair["A"], pair["B"]
        if tuple(a.shape) != (rank, in_features) or tuple(b.shape) != (out_features, rank):
            raise InvalidArgument(
                f"layer {layer} {module}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                f"model's ({out_features} x {in_features}) at rank {rank}: the adapter was trained for another model",
                reason=BASE_MISMATCH, field=PATH_FIELD)
        weights[(layer, module)] = (a.to(dtype), b.to(dtype))
    return weights
