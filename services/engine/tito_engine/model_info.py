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
