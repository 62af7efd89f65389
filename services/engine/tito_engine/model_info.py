"""Who the served model is, as every backend reports it (GetModelInfo) and admission checks against
it: `ModelInfo` (ids, limits, EOS ids, fingerprint, media) and `describe_model`, which reads it off
a model directory and its config. Torch-free, so the seam and both backends share it.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito.config import ConfigError
from tito.vocab import load_vocabulary

from tito_engine.multimodal.specs import ModelMultimodalSpec, multimodal_spec_from_config

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    vocab_size: int  # embedding rows: valid token ids are [0, vocab_size) (tito.vocab)
    max_context_length: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    fingerprint: str
    modalities: tuple[str, ...] = ()
    # (modality, placeholder token text, placeholder token id) per accepted modality.
    placeholders: tuple[tuple[str, str, int], ...] = ()
    model_family: str = ""  # config.model_type, e.g. "qwen2", "llama", "qwen3", "qwen2_5_vl", "gemma3"
    tokenizer_vocab_size: int = 0  # the tokenizer's entries (0: unknown, take vocab_size)
    padding_ids: tuple[int, ...] = ()  # valid ids the tokenizer does not name (tito.vocab)


def check_checkpoint(model_dir: Path, model_id: str) -> None:
    """What any backend needs of `--model` before it starts anything, checked from the files
    alone in milliseconds (ConfigError, one line): a config.json object naming its model_type,
    weight files, and safetensors files whose headers parse and whose lengths match them (a
    truncated download fails here, not deep inside a loader after the port is bound)."""
    where = f"--model {model_id}"
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except OSError as exc:
        raise ConfigError(f"{where}: {model_dir / 'config.json'} cannot be read ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise ConfigError(f"{where}: {model_dir / 'config.json'} is not JSON ({exc})") from None
    if not isinstance(config, dict) or not config.get("model_type"):
        raise ConfigError(f"{where}: {model_dir / 'config.json'} names no model_type; is this a Hugging Face "
                          f"model directory?")
    weights = sorted(path for path in model_dir.iterdir() if path.suffix in _WEIGHT_SUFFIXES and path.is_file())
    if not weights:
        raise ConfigError(f"{where}: no weight files (*.safetensors, pytorch_model*.bin) in {model_dir}")
    for path in weights:
        if path.suffix == ".safetensors":
            _check_safetensors(path, where)


def _check_safetensors(path: Path, where: str) -> None:
    damaged = f"{where}: {path} is truncated or damaged"
    size = path.stat().st_size
    with path.open("rb") as stream:
        head = stream.read(8)
        if len(head) < 8:
            raise ConfigError(f"{damaged} ({size} bytes, no safetensors header)")
        length = int.from_bytes(head, "little")
        if length > size - 8:
            raise ConfigError(f"{damaged} (its header claims {length} bytes, the file has {size})")
        try:
            header = json.loads(stream.read(length))
        except ValueError:
            raise ConfigError(f"{damaged} (its header is not JSON)") from None
    ends = [entry["data_offsets"][1] for name, entry in header.items()
            if name != "__metadata__" and isinstance(entry, dict) and "data_offsets" in entry]
    expected = 8 + length + max(ends, default=0)
    if expected != size:
        raise ConfigError(f"{damaged} (its tensors need {expected} bytes, the file has {size})")


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and the weight files' names and sizes (cheap, stable identity)."""
    digest = hashlib.sha256()
    config_path = model_dir / "config.json"
    digest.update(config_path.read_bytes() if config_path.is_file() else b"")
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(f"\0{path.name}\0{path.stat().st_size}".encode())
    return digest.hexdigest()[:16]


def describe_model(model_dir: Path, config: Any, *, model_id: str, vocab_size: int, max_context_length: int,
                   dtype: str, device: str, multimodal: bool = True) -> tuple[ModelInfo, ModelMultimodalSpec | None]:
    """The model's identity and the media it takes, as every backend reports them (GetModelInfo) and
    admits them (features.py). `multimodal=False`: the backend serves the model as text only."""
    fingerprint = model_fingerprint(model_dir)
    vocabulary = load_vocabulary(model_dir, vocab_size)
    mm_spec = multimodal_spec_from_config(config, fingerprint) if multimodal else None
    media = mm_spec.modalities if mm_spec is not None else {}
    info = ModelInfo(
        model_id=model_id, vocab_size=vocab_size, max_context_length=max_context_length,
        eos_token_ids=eos_token_ids(model_dir, config), dtype=dtype, device=device, fingerprint=fingerprint,
        modalities=tuple(media),
        placeholders=tuple((name, token_text(model_dir, spec.placeholder_token_id), spec.placeholder_token_id)
                           for name, spec in media.items()),
        model_family=getattr(config, "model_type", ""),
        tokenizer_vocab_size=vocabulary.tokenizer_vocab_size, padding_ids=vocabulary.padding_ids)
    return info, mm_spec


def eos_token_ids(model_dir: Path, config: Any) -> tuple[int, ...]:
    """EOS ids from generation_config.json (int or list) plus the model config's, in order."""
    ids: list[int] = []

    def add(value: Any) -> None:
        for item in value if isinstance(value, (list, tuple)) else [value]:
            if isinstance(item, int) and item not in ids:
                ids.append(item)

    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    add(getattr(config, "eos_token_id", None))
    text_config = getattr(config, "text_config", None)
    if text_config is not None:
        add(getattr(text_config, "eos_token_id", None))
    return tuple(ids)


def token_text(model_dir: Path, token_id: int) -> str:
    """The text of an added (special) token from tokenizer.json, "" when it cannot be found."""
    path = model_dir / "tokenizer.json"
    try:
        added = json.loads(path.read_text()).get("added_tokens", [])
    except (OSError, ValueError):
        return ""
    return next((token.get("content", "") for token in added if token.get("id") == token_id), "")
