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
    #: Hex key sealing the resumable stream states derender returns (DerenderContext.return_state):
    #: replicas behind one gateway share it so any of them resumes any state. Set it through the
    #: environment (TITO_STREAM_STATE_KEY) rather than the command line, where `ps` shows it.
    stream_state_key: str | None = setting(None, type=str, help="hex key (64 hex digits) sealing resumable "
                                           "stream states; replicas share it",
                                           default_text="a random key per process")

    def state_key(self) -> bytes | None:
        return bytes.fromhex(self.stream_state_key) if self.stream_state_key else None

    def validate(self) -> None:
        super().validate()
        if not self.model:
            raise ConfigError("model is empty: pass --model with a model directory or a tiny model name "
                              "(e.g. tiny-qwen2); derender loads only its tokenizer")
        if self.stream_state_key is not None:
            try:
                key = bytes.fromhex(self.stream_state_key)
            except ValueError:
                key = b""
            if len(key) < 32:
                raise ConfigError("stream_state_key must be at least 64 hex digits (a 32-byte key): generate "
                                  "one with `python -c 'import secrets; print(secrets.token_hex(32))'`")
