"""Render's typed configuration (extends the common ServerConfig)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tito.config import ConfigError, ServerConfig
from tito.signing import read_key_file

#: Reasoning parsers derender knows, plus "auto" (detect from the tokenizer) and "none".
REASONING_PARSERS = ("qwen3", "deepseek_r1", "gpt_oss")
#: Tool-call parsers derender knows.
TOOL_PARSERS = ("hermes", "llama3_json", "mistral", "pythonic", "qwen3_coder", "deepseek_v3", "kimi_k2", "glm45",
                "gpt_oss")
#: Tool-call parsers whose markup is special tokens the tokenizer may not flag as the model's own
#: markers (Mistral's [TOOL_CALLS]): for the requests they parse, skip_special_tokens defaults to
#: false (derender's ToolParser.needs_special_tokens says the same per parser; a test keeps the
#: two in step). Families whose markers are special tokens of their tokenizer are found by
#: families.keeps_special_tokens instead.
TOOL_PARSERS_NEEDING_SPECIAL_TOKENS = frozenset({"mistral"})
AUTO = "auto"
NONE = "none"

MIB = 1024 * 1024


def available_cpus() -> int:
    """CPUs this process may run on (affinity-aware: a container's cpuset, `taskset`)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


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
    #: Rendering processes behind the one address (SO_REUSEPORT); 0 = one per available CPU.
    workers: int = 1

    # ---- media sources
    #: Directory local image files may be read from (file:// URLs and bare paths); "" = none.
    media_dir: str = ""
    #: Fetch http(s) image URLs (off by default: a render server that fetches URLs can be made to
    #: reach internal hosts).
    allow_remote_media: bool = False
    #: Timeout of one remote fetch, seconds.
    media_fetch_timeout: float = 10.0

    # ---- request limits
    #: Largest encoded image (bytes), whatever its source.
    max_image_bytes: int = 20 * MIB
    #: Largest decoded image (width x height): decompression-bomb guard, checked from the header
    #: before any pixel is decoded. Also caps the min/max_pixels a request may ask for.
    max_image_pixels: int = 64_000_000
    #: Decoded pixels of all images and video frames of one request together.
    max_request_pixels: int = 128_000_000
    #: Most images (and video frames) in one request.
    max_images_per_request: int = 32
    #: Most frames in one video part (each frame also counts toward max_images_per_request).
    max_video_frames: int = 64
    #: Most prompt tokens (media placeholders included); 0 = the context limit only.
    max_prompt_tokens: int = 0
    #: Seconds a chat template may run on one chat before it is stopped (TEMPLATE_TIMEOUT); a
    #: call's own deadline, when sooner, applies instead.
    max_template_seconds: float = 10.0
    #: MiB of processed images each worker keeps for reuse (a chat resends its images every
    #: turn); 0 = no cache.
    media_cache_mb: int = 256

    # ---- feature signing
    #: File holding the HMAC key shared with the engine; "" = items are not signed.
    hmac_key_file: str = ""
    #: Identifier of that key, put in each item's auth_key_id (key rotation).
    hmac_key_id: str = ""

    def resolved_workers(self) -> int:
        return self.workers if self.workers > 0 else available_cpus()

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
        self._validate_workers()
        if self.media_dir and not Path(self.media_dir).is_dir():
            raise ConfigError(f"media_dir={self.media_dir!r} is not a directory: pass --media-dir with an "
                              f"existing directory, or leave it empty to refuse local files")
        if self.media_fetch_timeout <= 0:
            raise ConfigError(f"media_fetch_timeout={self.media_fetch_timeout} must be > 0 seconds")
        for name in ("max_image_bytes", "max_image_pixels", "max_request_pixels", "max_images_per_request",
                     "max_video_frames"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.media_cache_mb < 0:
            raise ConfigError(f"media_cache_mb={self.media_cache_mb} must be >= 0 (0 = no cache)")
        if not 0 < self.max_template_seconds <= 3600:
            raise ConfigError(f"max_template_seconds={self.max_template_seconds} must be in (0, 3600] (default 10)")
        if self.max_prompt_tokens < 0:
            raise ConfigError(f"max_prompt_tokens={self.max_prompt_tokens} must be >= 0 (0 = the context limit)")
        if self.hmac_key_id and not self.hmac_key_file:
            raise ConfigError("hmac_key_id is set but hmac_key_file is not: pass --hmac-key-file too")
        if self.hmac_key_file:
            self.read_hmac_key()

    def _validate_workers(self) -> None:
        if self.workers < 0:
            raise ConfigError(f"workers={self.workers} must be >= 0 (0 = one per available CPU)")
        if self.resolved_workers() == 1:
            return
        if self.address.startswith("unix:"):
            raise ConfigError(f"workers={self.workers} needs a TCP address: several processes cannot share one "
                              f"Unix socket; use --workers 1 with {self.address}, or a host:port")
        if self.address.rsplit(":", 1)[1] == "0":
            raise ConfigError(f"workers={self.workers} needs a fixed port: with port 0 every worker process "
                              f"would pick a different one; choose a port, e.g. 127.0.0.1:50051")

    def read_hmac_key(self) -> bytes | None:
        """The signing key (see tito.signing.read_key_file); None when signing is off."""
        return read_key_file(self.hmac_key_file) if self.hmac_key_file else None
