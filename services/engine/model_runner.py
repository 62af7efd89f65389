"""Owns the model: loading, identity (fingerprint, limits, EOS ids) and forward passes.

This phase runs one forward per sequence with an HF DynamicCache per sequence: `prefill` once per
request, then one-token `decode` steps. The scheduler only calls `prefill`/`decode`/`fork`, so a
batched forward over a paged KV cache can replace this class without touching anything above it.
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tito.config import ConfigError

log = logging.getLogger(__name__)

_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth")


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    vocab_size: int
    max_context_length: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    fingerprint: str
    modalities: tuple[str, ...] = ()


def choose_device(spec: str) -> torch.device:
    """`auto` takes CUDA when present, else CPU; an explicit CUDA device must exist."""
    if spec == "auto":
        return torch.device("cuda:0" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device={spec!r} but CUDA is not available here; use --device cpu or auto")
        index = device.index or 0
        if index >= torch.cuda.device_count():
            raise ConfigError(f"device={spec!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
        device = torch.device("cuda", index)
    return device


def choose_dtype(device: torch.device) -> torch.dtype:
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        return torch.bfloat16
    return torch.float32


def model_fingerprint(model_dir: Path) -> str:
    """sha256 over config.json and the weight files' names and sizes (cheap, stable identity)."""
    digest = hashlib.sha256()
    config_path = model_dir / "config.json"
    digest.update(config_path.read_bytes() if config_path.is_file() else b"")
    for path in sorted(model_dir.iterdir()):
        if path.is_file() and path.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(f"\0{path.name}\0{path.stat().st_size}".encode())
    return digest.hexdigest()[:16]


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


class ModelRunner:
    """Loads a causal LM and runs prefill/decode forwards on it."""

    def __init__(self, model_dir: Path, *, model_id: str, device: str = "auto",
                 max_model_len: int | None = None):
        from transformers import AutoModelForCausalLM

        self.device = choose_device(device)
        self.dtype = choose_dtype(self.device)
        from transformers.utils import logging as hf_logging

        bar_was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # a progress bar per load is noise in server logs
        try:
            self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=self.dtype).to(self.device).eval()
        finally:
            if bar_was_enabled:
                hf_logging.enable_progress_bar()
        config = self.model.config
        text_config = getattr(config, "text_config", None) or config
        vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        model_max = int(getattr(text_config, "max_position_embeddings", 0) or 0) or 2048
        if max_model_len is not None and max_model_len > model_max:
            log.warning("max_model_len=%d exceeds the model's max_position_embeddings=%d; quality may "
                        "degrade past it", max_model_len, model_max)
        self.info = ModelInfo(
            model_id=model_id,
            vocab_size=vocab_size,
            max_context_length=max_model_len or model_max,
            eos_token_ids=eos_token_ids(model_dir, config),
            dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device),
            fingerprint=model_fingerprint(model_dir),
        )
        log.info("loaded %s on %s (%s): vocab %d, context %d, eos %s, fingerprint %s", model_id,
                 self.info.device, self.info.dtype, vocab_size, self.info.max_context_length,
                 list(self.info.eos_token_ids), self.info.fingerprint)

    def new_cache(self) -> Any:
        from transformers import DynamicCache

        return DynamicCache(config=self.model.config)

    @torch.inference_mode()
    def prefill(self, token_ids: list[int]) -> tuple[torch.Tensor, Any]:
        """Run the whole prompt once; return the last position's logits [vocab] and the cache."""
        cache = self.new_cache()
        input_ids = torch.tensor([token_ids], dtype=torch.long, device=self.device)
        output = self.model(input_ids=input_ids, cache=cache, use_cache=True, logits_to_keep=1)
        return output.logits[0, -1], cache

    @torch.inference_mode()
    def decode(self, token_id: int, cache: Any) -> torch.Tensor:
        """Append one token to `cache` and return the next position's logits [vocab]."""
        input_ids = torch.tensor([[token_id]], dtype=torch.long, device=self.device)
        output = self.model(input_ids=input_ids, cache=cache, use_cache=True)
        return output.logits[0, -1]

    def fork(self, cache: Any) -> Any:
        """An independent copy of a prompt's cache, for another choice of the same request."""
        return copy.deepcopy(cache)
