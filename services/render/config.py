"""Render's typed configuration (extends the common ServerConfig)."""

from __future__ import annotations

from dataclasses import dataclass

from tito.config import ConfigError, ServerConfig

#: Reasoning parsers derender knows, plus "auto" (detect from the tokenizer) and "none".
REASONING_PARSERS = ("qwen3", "deepseek_r1")
#: Tool-call parsers derender knows.
TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")
AUTO = "auto"
NONE = "none"


@dataclass
class RenderConfig(ServerConfig):
    """What render needs beyond the common server settings."""

    #: A local Hugging Face model directory or a tiny model name (see tito.model_paths).
    model: str = "tiny-qwen2"
    #: Context limit override; 0 = the model's own (config max_position_embeddings, else the
    #: tokenizer's model_max_length).
    max_model_len: int = 0
    #: Reasoning parser named in DerenderContext: "auto", "none", or one of REASONING_PARSERS.
    reasoning_parser: str = AUTO
    #: Tool-call parser named in DerenderContext: "auto", "none", or one of TOOL_PARSERS.
    tool_parser: str = AUTO
    #: Rendering processes. Only 1 (a thread beside the event loop) exists in this version.
    workers: int = 1

    def validate(self) -> None:
        super().validate()
        if not self.model:
            raise ConfigError("model is empty: pass --model with a model directory or a tiny model name "
                              "(e.g. tiny-qwen2)")
        if self.max_model_len < 0:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 0 (0 = the model's own limit)")
        if self.reasoning_parser not in (AUTO, NONE, *REASONING_PARSERS):
            raise ConfigError(f"reasoning_parser={self.reasoning_parser!r} must be one of "
                              f"{', '.join((AUTO, NONE, *REASONING_PARSERS))}")
        if self.tool_parser not in (AUTO, NONE, *TOOL_PARSERS):
            raise ConfigError(f"tool_parser={self.tool_parser!r} must be one of "
                              f"{', '.join((AUTO, NONE, *TOOL_PARSERS))}")
        if self.workers != 1:
            raise ConfigError(f"workers={self.workers}: only 1 render worker is supported in this version "
                              f"(rendering runs on one thread beside the event loop); multi-process "
                              f"rendering is not available yet")
