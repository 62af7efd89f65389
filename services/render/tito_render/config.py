"""Render's typed configuration (extends the common ServerConfig)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from tito.config import ConfigError, ServerConfig, model_setting
from tito.parsers import REASONING_PARSER_NAMES, TOOL_PARSER_NAMES
from tito.settings import setting
from tito.signing import read_key_file
from tito_models.tiny import TEXT_MODEL

#: Reasoning parsers derender knows (tito.parsers), plus "auto" (detect from the tokenizer) and "none".
REASONING_PARSERS = REASONING_PARSER_NAMES
#: Tool-call parsers derender knows (tito.parsers).
TOOL_PARSERS = TOOL_PARSER_NAMES
AUTO = "auto"
NONE = "none"

MIB = 1024 * 1024
MEDIA = "media"
LIMITS = "request limits"
SIGNING = "feature signing"


def available_cpus() -> int:
    """CPUs this process may run on (affinity-aware: a container's cpuset, `taskset`)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


@dataclass
class RenderConfig(ServerConfig):
    """What render needs beyond the common server settings."""

    #: A local Hugging Face model directory or a tiny model name (see tito_models.paths).
    model: str = model_setting(TEXT_MODEL, "render reads its tokenizer, chat template and processors")
    #: Context limit override; 0 = the model's own (config max_position_embeddings, else the
    #: tokenizer's model_max_length).
    max_model_len: int = setting(0, help="context limit in tokens; 0 = the model's own")
    reasoning_parser: str = setting(
        AUTO, choices=(AUTO, NONE, *REASONING_PARSERS),
        help="reasoning parser named in DerenderContext (auto: gpt_oss for harmony tokenizers, deepseek_r1 for "
             "DeepSeek R1, else qwen3 when the tokenizer has <think>/</think>)")
    tool_parser: str = setting(
        AUTO, choices=(AUTO, NONE, *TOOL_PARSERS),
        help="tool-call parser named in DerenderContext (auto: by the model family's tokens or template, see "
             "services/render/README.md; else hermes when the tokenizer has <tool_call>)")
    workers: int = setting(1, help="render processes sharing the address with SO_REUSEPORT (needs a fixed TCP "
                                   "port); 0 = one per available CPU")

    # ---- media sources
    media_dir: str = setting("", group=MEDIA, default_text="none",
                             help="directory image files may be read from (file:// URLs, bare paths)")
    #: Off by default: a render server that fetches URLs can be made to reach internal hosts.
    allow_remote_media: bool = setting(False, group=MEDIA, help="fetch http(s) image URLs")
    media_fetch_timeout: float = setting(10.0, group=MEDIA, help="seconds for one remote image fetch")
    #: A chat resends its images every turn.
    media_cache_mb: int = setting(256, group=MEDIA,
                                  help="MiB of processed images each worker keeps for reuse, 0 = none")

    # ---- request limits
    max_image_bytes: int = setting(20 * MIB, group=LIMITS, default_text="20 MiB",
                                   help="largest encoded image, bytes, whatever its source")
    #: Checked from the header before any pixel is decoded; also caps a request's min/max_pixels.
    max_image_pixels: int = setting(64_000_000, group=LIMITS,
                                    help="largest decoded image, width x height (decompression-bomb guard)")
    max_request_pixels: int = setting(128_000_000, group=LIMITS,
                                      help="decoded pixels of all images and video frames of one request "
                                           "together, checked from each image's header before decoding")
    max_images_per_request: int = setting(32, group=LIMITS,
                                          help="most images in one request, video frames included")
    max_video_frames: int = setting(64, group=LIMITS, help="most frames in one video part")
    max_prompt_tokens: int = setting(0, group=LIMITS,
                                     help="most prompt tokens, media placeholders included; 0 = the context limit")
    #: TEMPLATE_TIMEOUT when exceeded.
    max_template_seconds: float = setting(10.0, group=LIMITS,
                                          help="run time of a chat template on one chat before it is stopped (a "
                                               "call's own deadline, when sooner, applies instead)")

    # ---- feature signing
    hmac_key_file: str = setting("", group=SIGNING, default_text="items are not signed",
                                 help="file with the key shared with the engine; each media item gets an HMAC tag")
    hmac_key_id: str = setting("", group=SIGNING, help="key identifier put in each item (key rotation)")

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
            raise ConfigError(f"max_template_seconds={self.max_template_seconds} must be in (0, 3600] (default "
                              f"{type(self).max_template_seconds})")
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
