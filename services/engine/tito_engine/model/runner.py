"""Owns the model: loading, identity (fingerprint, limits, EOS ids), the paged KV cache and the
batched forward (forward.BatchedDecoder) the scheduler calls once per step.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from tito.config import ConfigError
from tito.cpu_affinity import format_cpu_list
from tito.cpu_isa import cpu_supports
from tito.startup import StartupPhases

from tito_engine.model import constraints
from tito_engine.model_info import ModelInfo, describe_model
from tito_engine.model.choices import ModelChoiceState

from tito_engine.multimodal import vision
from tito_engine.model.cpu_attention import AttentionKernel, load_attention_kernel
from tito_engine.model.cpu_runtime import (forward_macs_per_token, keep_freed_memory, lend_cpus_to_lone_prefill,
                                           plan_cpus, set_cpu_threads)
from tito_engine.model.forward import BatchedDecoder, MultiModalPrefill
from tito_engine.model.linear import wide_linears
from tito_engine.model.quantization import Int4Checkpoint, scheme_for
from tito_engine.model.quantization.int4_checkpoint import load_int4_model
from tito_engine.model.lora import LoraSlots
from tito_engine.model.kv_cache import KVLayout, PagedKVCache
from tito_engine.kv_sizing import available_host_memory, kv_budget
from tito_engine.limits import DEFAULT_BLOCK_SIZE, DEFAULT_MAX_RUNNING_SEQUENCES
from tito_engine.scheduling.plan import RowInput, SampledTokens, StepPlan
from tito_engine.model.sampler import mask_logits, sample_batch

log = logging.getLogger(__name__)


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


#: `--dtype` values and the torch dtypes they name ("auto" picks one of them, see choose_dtype).
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def checkpoint_dtype(model_dir: Path) -> torch.dtype:
    """The dtype the checkpoint is stored in (config.json `dtype`, or the older `torch_dtype`;
    float32 when it names none)."""
    try:
        config = json.loads((model_dir / "config.json").read_text())
    except (OSError, ValueError):
        return torch.float32
    text_config = config.get("text_config") or {}
    name = config.get("dtype") or config.get("torch_dtype") or text_config.get("dtype") or text_config.get(
        "torch_dtype")
    return DTYPES.get(str(name), torch.float32)


def choose_dtype(device: torch.device, requested: str = "auto", stored: torch.dtype = torch.float32
                 ) -> tuple[torch.dtype, str]:
    """The compute dtype for `--dtype` and why, as vLLM's `auto` chooses: the checkpoint's own
    dtype (`stored`) where the device computes it natively; on CPU float32 otherwise (a half
    checkpoint on a CPU without bf16 / fp16 instructions would be emulated, several times slower);
    on CUDA a float32 checkpoint runs in bfloat16 where the GPU has it (half the memory and
    traffic, tensor cores), float16 checkpoints in float16. An explicit dtype the device cannot
    compute natively is refused (ConfigError) rather than run emulated."""
    if requested != "auto":
        dtype = DTYPES[requested]
        if device.type == "cpu" and not cpu_supports(dtype):
            raise ConfigError(f"--dtype {requested}: this CPU has no {requested} instructions (oneDNN reports none); "
                              f"use --dtype float32, or auto")
        if device.type == "cuda" and dtype == torch.bfloat16 and not torch.cuda.is_bf16_supported():
            raise ConfigError("--dtype bfloat16: this GPU has no bfloat16 support; use --dtype float16 or float32")
        return dtype, "--dtype"
    stored_name = str(stored).removeprefix("torch.")
    if device.type == "cuda":
        if stored == torch.float16 or (stored == torch.bfloat16 and not torch.cuda.is_bf16_supported()):
            return torch.float16, f"auto: the checkpoint is {stored_name}"
        if torch.cuda.is_bf16_supported():
            return torch.bfloat16, f"auto: the checkpoint is {stored_name}, the GPU computes bfloat16"
        return torch.float32, f"auto: the checkpoint is {stored_name}"
    if stored != torch.float32 and cpu_supports(stored):
        return stored, f"auto: the checkpoint is {stored_name}, the CPU computes it natively"
    if stored != torch.float32:
        return torch.float32, f"auto: the checkpoint is {stored_name}, but this CPU has no {stored_name} instructions"
    return torch.float32, "auto: the checkpoint is float32"


@dataclass(frozen=True)
class KVCacheSpec:
    """How big the paged KV cache is: explicit blocks, a byte budget, or (neither given) the rule
    of tito_engine.kv_sizing over the memory free after loading, with `memory_fraction` its
    fraction and `max_sequences` x the context its cap."""

    block_size: int = DEFAULT_BLOCK_SIZE
    num_blocks: int | None = None
    cache_bytes: int | None = None
    memory_fraction: float | None = None
    max_sequences: int = DEFAULT_MAX_RUNNING_SEQUENCES


def _describe_vocab(info: ModelInfo) -> str:
    if not info.padding_ids:
        return str(info.vocab_size)
    return f"{info.vocab_size} ({info.tokenizer_vocab_size} tokenizer entries, {len(info.padding_ids)} padding ids)"


def padding_mask(padding_ids: tuple[int, ...], device: torch.device | str) -> torch.Tensor | None:
    """The columns sampler.mask_logits sets to -inf: the padding ids as one index tensor on the
    model's device, built once; None when there are none."""
    if not padding_ids:
        return None
    return torch.tensor(padding_ids, dtype=torch.long, device=device)


def _load_model(model_dir: Path, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    config = AutoConfig.from_pretrained(model_dir)
    # Vision-language models (Qwen2-VL, Qwen2.5-VL, Gemma3) load as image-text-to-text; the engine drives
    # their text model.
    loader = AutoModelForImageTextToText if getattr(config, "vision_config", None) is not None else AutoModelForCausalLM
    return loader.from_pretrained(model_dir, dtype=dtype)


def _load_quantized_or_float(model_dir: Path, dtype: torch.dtype, quantization: str) -> tuple[Any, Any]:
    """The model, and what its linears run in (model/quantization.scheme_for): `quantization` for a
    float checkpoint, an Int4Checkpoint holding its int4 weights for a quantized one."""
    scheme = scheme_for(model_dir, quantization)
    if not isinstance(scheme, Int4Checkpoint):
        return _load_model_quietly(model_dir, dtype), scheme
    from transformers import AutoConfig, AutoModelForCausalLM, AutoModelForImageTextToText

    vision = getattr(AutoConfig.from_pretrained(model_dir), "vision_config", None) is not None
    loader = AutoModelForImageTextToText if vision else AutoModelForCausalLM
    return load_int4_model(model_dir, dtype, scheme, loader), scheme


def _load_model_quietly(model_dir: Path, dtype: torch.dtype) -> Any:
    """`_load_model` without transformers' progress bar (one per load is noise in server logs)."""
    from transformers.utils import logging as hf_logging

    bar_was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        return _load_model(model_dir, dtype)
    finally:
        if bar_was_enabled:
            hf_logging.enable_progress_bar()


class ModelRunner:
    """Loads a causal LM, sizes its paged KV cache and runs one batched forward per step."""

    #: The LoRA adapter slots (model/lora.py); None: the engine serves the base model only, and its
    #: linears are untouched.
    lora: LoraSlots | None = None

    def __init__(self, model_dir: Path, *, model_id: str, device: str = "auto",
                 max_model_len: int | None = None, kv_cache: KVCacheSpec | None = None,
                 cpu_threads: int | None = None, exclude_padding_ids: bool = True, packed_linears: bool = True,
                 dtype: str = "auto", decode_kernel: bool | None = None,
                 lone_prefill_cpus: frozenset[int] | None = None, quantization: str = "none",
                 max_loras: int = 0, max_lora_rank: int = 16):
        """`quantization`: the scheme the linears run in (model/quantization; none: as stored).
        `cpu_threads` and `lone_prefill_cpus` come from the engine's CPU plan (cpu_runtime.CpuPlan,
        made once at start-up); `cpu_threads` unset: chosen from the model's work, as that plan
        chooses them. `lone_prefill_cpus`: CPUs (the server's) a lone prefill's linears borrow on CPU
        (cpu_runtime.lend_cpus_to_lone_prefill); None: every step on this process's threads.
        `max_loras` > 0: LoRA adapter slots of up to `max_lora_rank` (model/lora.py) in the forward."""
        self.model_dir = model_dir  # structured outputs read the tokenizer from here (constraints.py)
        self.device = choose_device(device)
        self.dtype, dtype_reason = choose_dtype(self.device, dtype, checkpoint_dtype(model_dir))
        #: torch threads of a lone prefill's linears (linear.wide_linears); 0: the usual count.
        self.lone_prefill_threads = 0
        if self.device.type == "cpu":
            self._set_up_cpu(cpu_threads, lone_prefill_cpus)
        self.model, quantization = _load_quantized_or_float(model_dir, self.dtype, quantization)
        self.model = self.model.to(self.device).eval()
        text_config = self._describe(model_id, max_model_len)
        #: Logit columns set to -inf every step (sampler.mask_logits) when padding ids are
        #: excluded; None when they are not or the model has none (then it costs nothing).
        self.logits_mask = padding_mask(self.info.padding_ids, self.device) if exclude_padding_ids else None
        self._token_masks: constraints.TokenMasks | None = None  # built by the first constrained step
        self.cache = self._make_cache(text_config, kv_cache or KVCacheSpec())
        self.choice_state = ModelChoiceState(self.device)
        kernel = self._attention_kernel(decode_kernel)
        self.decoder = self._build_decoder(model_id, packed_linears, kernel, quantization)
        if max_loras:
            self.lora = LoraSlots(self.decoder, max_loras, max_lora_rank)
        self._log_loaded(model_id, dtype_reason, kernel is not None)

    def _set_up_cpu(self, cpu_threads: int | None, lone_prefill_cpus: frozenset[int] | None) -> None:
        """The process-wide CPU settings (cpu_runtime): torch's threads, the allocator's thresholds,
        and the threads a lone prefill borrows the server's CPUs with."""
        # Unset (a runner built alone: tests, benchmarks): the threads the engine's plan would give.
        set_cpu_threads(cpu_threads or plan_cpus("none", "", None, forward_macs_per_token(self.model_dir)).threads)
        if keep_freed_memory():
            log.debug("glibc malloc keeps freed memory for the next step (cpu_runtime.keep_freed_memory)")
        if lone_prefill_cpus:
            self.lone_prefill_threads = lend_cpus_to_lone_prefill(lone_prefill_cpus)
            if self.lone_prefill_threads:
                log.info("a lone prefill's linears run on %d threads, the extra ones on CPUs %s "
                         "(--no-cpu-lone-prefill-borrow: the core's alone)", self.lone_prefill_threads,
                         format_cpu_list(lone_prefill_cpus))

    def _describe(self, model_id: str, max_model_len: int | None) -> Any:
        """Set the loaded model's identity (`info`: ids, limits, EOS ids, fingerprint) and what media
        it takes (`mm_spec`, features.py admission; None for text-only models); its text config."""
        config = self.model.config
        text_config = getattr(config, "text_config", None) or config
        vocab_size = int(self.model.get_input_embeddings().weight.shape[0])
        model_max = int(getattr(text_config, "max_position_embeddings", 0) or 0) or 2048
        if max_model_len is not None and max_model_len > model_max:
            log.warning("max_model_len=%d exceeds the model's max_position_embeddings=%d; quality may "
                        "degrade past it", max_model_len, model_max)
        self.info, self.mm_spec = describe_model(
            self.model_dir, config, model_id=model_id, vocab_size=vocab_size,
            max_context_length=max_model_len or model_max, dtype=str(self.dtype).removeprefix("torch."),
            device=str(self.device))
        return text_config

    def _attention_kernel(self, decode_kernel: bool | None) -> AttentionKernel | None:
        """The CPU kernel decode rows attend in, where it is asked for (None: where this process runs
        one torch thread) and can run and be built; None: the torch path."""
        if decode_kernel is None:  # the kernel runs on one thread; SDPA spreads over torch's threads
            decode_kernel = torch.get_num_threads() == 1
        if decode_kernel and AttentionKernel.supports(self.dtype, self.device):
            return load_attention_kernel()  # None: it could not be built (logged), the torch path runs
        return None

    def _build_decoder(self, model_id: str, packed_linears: bool, kernel: AttentionKernel | None,
                       quantization: Any) -> BatchedDecoder:
        """The batched forward over the model and the cache (linears packed on CPU unless told)."""
        try:
            return BatchedDecoder(self.model, self.cache, max_positions=self.info.max_context_length,
                                  packed_linears=packed_linears and self.device.type == "cpu",
                                  release_plain_weights=True, attention_kernel=kernel, quantization=quantization)
        except ValueError as exc:  # an architecture (or a setting of one) the native forward does not run
            raise ConfigError(f"{model_id}: {exc}") from exc

    def _log_loaded(self, model_id: str, dtype_reason: str, kernel: bool) -> None:
        log.info("loaded %s on %s (%s, %s): vocab %s%s, context %d, eos %s, fingerprint %s; KV cache %d blocks x %d "
                 "tokens (%.1f MiB)", model_id, self.info.device, self.info.dtype, dtype_reason,
                 _describe_vocab(self.info),
                 " (padding ids excluded from sampling)" if self.logits_mask is not None else "",
                 self.info.max_context_length, list(self.info.eos_token_ids), self.info.fingerprint,
                 self.cache.num_blocks, self.cache.block_size,
                 self.cache.capacity_tokens * self.cache.layout.bytes_per_token / 2**20)
        quantized = self.decoder.quantized
        if quantized.count:
            log.info("%d linears quantized (%.1f MiB as stored now, %.1f MiB of float weights freed)", quantized.count,
                     quantized.quantized_bytes / 2**20, quantized.float_bytes_freed / 2**20)
        if kernel:
            log.info("decode rows attend in the CPU kernel (--no-cpu-decode-kernel: the torch path)")
        if self.decoder.packed_linear_bytes:
            extra = self.decoder.packed_linear_bytes - self.decoder.released_weight_bytes
            log.info("linears run on oneDNN-packed weights (%.1f MiB packed, %.1f MiB of it held twice; "
                     "--no-cpu-packed-linears holds one copy)", self.decoder.packed_linear_bytes / 2**20,
                     extra / 2**20)

    def _make_cache(self, text_config: Any, spec: KVCacheSpec) -> PagedKVCache:
        heads = text_config.num_attention_heads
        head_dim = getattr(text_config, "head_dim", None) or text_config.hidden_size // heads
        layout = KVLayout(num_layers=text_config.num_hidden_layers, kv_heads=text_config.num_key_value_heads,
                          head_dim=head_dim, dtype=self.dtype)
        if spec.num_blocks is not None:
            num_blocks = spec.num_blocks
            how = "--kv-blocks"
        elif spec.cache_bytes is not None:
            if self.device.type == "cpu" and spec.cache_bytes > (free := available_host_memory()):
                raise ConfigError(f"--kv-cache-bytes {spec.cache_bytes} ({spec.cache_bytes / 2**30:.2f} GiB) does not "
                                  f"fit in memory: {free / 2**30:.2f} GiB free after loading the model; lower "
                                  f"--kv-cache-bytes, or leave it out to size the cache from the free memory")
            num_blocks = layout.blocks_for_bytes(spec.cache_bytes, spec.block_size)
            how = "--kv-cache-bytes"
        else:
            free = (torch.cuda.mem_get_info(self.device)[0] if self.device.type == "cuda"
                    else available_host_memory())
            budget = kv_budget(free, layout.bytes_per_token, max_sequences=spec.max_sequences,
                               context_length=self.info.max_context_length, fraction=spec.memory_fraction)
            num_blocks = layout.blocks_for_bytes(budget.bytes, spec.block_size)
            how = budget.why
        if num_blocks >= 1:
            size = num_blocks * spec.block_size * layout.bytes_per_token
            log.info("KV cache: %.2f GiB = %s tokens of context, %d blocks x %d tokens (%s)", size / 2**30,
                     f"{num_blocks * spec.block_size:,}", num_blocks, spec.block_size, how)
        if num_blocks < 1:
            raise ConfigError(f"the KV cache budget holds no block of {spec.block_size} tokens "
                              f"({layout.bytes_per_token} bytes per token); raise --kv-cache-bytes or --kv-blocks")
        return PagedKVCache(layout, num_blocks, spec.block_size, self.device)

    def encode(self, items: list) -> list[torch.Tensor]:
        """Encoder rows per validated item (features.ValidatedItem), one encoder call per modality."""
        return vision.encode_items(self.model, items)

    def multimodal_prefill(self, token_ids: list[int], items_with_rows: list) -> MultiModalPrefill:
        """The forward's multimodal input for a prompt: encoder rows at their positions, M-RoPE
        positions (Qwen2-VL), bidirectional spans (Gemma3: each image's run of soft tokens)."""
        return MultiModalPrefill.for_model(self.model.config,
                                           **vision.prefill_media(token_ids, items_with_rows, self.model.config))

    def multimodal_positions(self, token_ids: list[int], items: list) -> MultiModalPrefill:
        """`multimodal_prefill` without encoder rows (vision.prefill_positions): for a prompt
        whose KV was pulled from the engine that prefilled it."""
        return MultiModalPrefill.for_model(self.model.config, **vision.prefill_positions(token_ids, items,
                                                                                         self.model.config))

    def execute(self, rows: list[RowInput]) -> torch.Tensor:
        """One batched forward over the step's rows; logits [rows needing logits, vocab] (float32).
        A lone row (nothing else running: a lone prefill) runs its linears on the borrowed CPUs too."""
        if self.lora is None:
            return self._execute(rows)
        self.lora.begin_step(rows)  # each row's adapter, for the linears of this forward
        try:
            return self._execute(rows)
        finally:
            self.lora.end_step()

    def _execute(self, rows: list[RowInput]) -> torch.Tensor:
        if self.lone_prefill_threads and len(rows) == 1:
            with wide_linears(self.lone_prefill_threads):
                return self.decoder.forward(rows)
        return self.decoder.forward(rows)

    def run(self, plan: StepPlan) -> SampledTokens:
        """Execute a scheduler plan: one batched forward, then one batched sampling call (argmax
        alone when every target is plain greedy). Constrained targets are masked by their
        grammars first, in one apply, and their matchers take the sampled tokens after."""
        logits = self.execute(plan.rows)
        if plan.logit_rows != list(range(logits.shape[0])):
            logits = logits[plan.logit_rows]  # forking choices read their parent's row
        raw_logits = logits = mask_logits(logits, self.logits_mask)
        matchers = [plan.targets[i][1].matcher for i in plan.constrained]
        if matchers:
            if self._token_masks is None:
                self._token_masks = constraints.TokenMasks(logits.shape[-1])
            if any(sample.options.wants_logprobs for sample in plan.samples):
                logits = logits.clone()  # logprobs are those of the distribution before the grammar
            self._token_masks.apply(logits, plan.constrained, matchers)
        if plan.plain_greedy:
            tokens, logprobs = logits.max(dim=-1).indices.tolist(), None  # max: faster than argmax on CPU
        else:
            tokens, logprobs = sample_batch(logits, plan.samples, raw_logits=raw_logits)
        complete: frozenset[int] = frozenset()
        if matchers:
            finished = self._token_masks.advance(matchers, [tokens[i] for i in plan.constrained])
            complete = frozenset(i for i, done in zip(plan.constrained, finished) if done)
        return SampledTokens(tokens, logprobs, complete)

    def warm_up(self, step_tokens: int = 2) -> None:
        """A prefill of one full step (`step_tokens`, the scheduler's prefill budget, within the
        context and the cache) and a one-token decode through the real forward, before the first
        request: first-call costs (allocations at the largest step's size, oneDNN primitives for its
        shapes; on CUDA, library handles and kernel loads) are paid here, not by the first burst of
        callers. The blocks are zeroed and freed again, so the cache is as it was."""
        block_size = self.cache.block_size
        prompt = max(1, min(step_tokens, self.info.max_context_length - 1, self.cache.num_blocks * block_size - 1))
        tokens = [token % self.info.vocab_size for token in range(prompt + 1)]
        blocks = self.cache.allocator.allocate(-(-len(tokens) // block_size))
        try:
            self.execute([RowInput(token_ids=tokens[:prompt], start=0, block_table=blocks, needs_logits=True)])
            self.execute([RowInput(token_ids=tokens[prompt:], start=prompt, block_table=blocks, needs_logits=True)])
        finally:
            for keys, values in zip(self.cache.keys, self.cache.values):
                keys[blocks] = 0  # padded slots are read under a mask: keep them zero
                values[blocks] = 0
            self.cache.allocator.release(blocks)


def warm_up_or_warn(runner: ModelRunner, step_tokens: int) -> None:
    """`runner.warm_up(step_tokens)`, logged as the start-up phase "warm-up". A failure is logged, not fatal:
    the first request then pays the first-call costs (or meets the same error, as a status)."""
    try:
        with StartupPhases().phase("warm-up"):
            runner.warm_up(step_tokens)
    except Exception:  # noqa: BLE001 - serving without a warm-up beats not serving
        log.warning("warm-up failed; serving without it", exc_info=True)
