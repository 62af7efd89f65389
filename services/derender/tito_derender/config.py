"""Derender's typed configuration (extends the common ServerConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from tito.config import ConfigError, ServerConfig, model_setting
from tito.settings import setting
from tito_models.tiny import TEXT_MODEL


@dataclass
class DerenderConfig(ServerConfig):
    """What derender needs beyond the common server settings: only the tokenizer's location.

    Everything request-specific (parsers, stop strings, skip_special_tokens) arrives in each
    stream's DerenderContext, so derender has no per-model output settings to drift from render's.
    """

    #: A local Hugging Face model directory or a tiny model name (see tito_models.paths). Only
    #: the tokenizer files are read.
    model: str = model_setting(TEXT_MODEL, "derender reads only its tokenizer")
    #: Where tiny models are built; None = tito's default cache.
    model_cache_dir: str | None = setting(None, type=str, help="where tiny models are built",
                                          default_text="tito's cache")

    def validate(self) -> None:
        super().validate()
        if not self.model:
            raise ConfigError("model is empty: pass --model with a model directory or a tiny model name "
                              "(e.g. tiny-qwen2); derender loads only its tokenizer")
