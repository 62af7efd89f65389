"""Random-weight checkpoints with a real model's exact shape and Qwen's real vocabulary, built offline.

The tiny models (`tito_models.tiny`) show behaviour; they are too small to show where a real
model's time goes (arithmetic and memory traffic, a 151,936-row output layer, long contexts). A
model of a real shape answers that without a model hub: the config is the real model's
(:data:`SHAPES`), the tokenizer is Qwen's real one (`tito_models.real_vocab`), and every weight
comes from a private generator seeded by its parameter name (normal(0, initializer_range) for
matrices, zero biases, unit norms), so a build writes the same bytes every time. Outputs are
random text; the sizes, dtypes and costs are the real model's.

    python -m tito_models.real_shape OUT_DIR [--shape qwen2.5-0.5b] [--dtype bfloat16]

A checkpoint is stored in one dtype (``--dtype``: ``bfloat16``, as real checkpoints ship, or
``float32``); :func:`ensure_shaped_model` caches each build under the tiny models' cache
(``<cache>/shape-<shape>-<dtype>-<VERSION>``). ``--model shape-qwen2.5-0.5b-bf16`` (or ``-fp32``)
names them wherever tito takes a model (`tito_models.paths`). Building needs the weights once in
float32 in memory (about 2 GB for the 0.5B shape) and takes some seconds.
"""

from __future__ import annotations

import argparse
import os
import sys
import zlib
from pathlib import Path
from typing import Any

from tito_models.real_vocab import QWEN_ADDED_TOKENS, QWEN_EMBEDDING_ROWS, ensure_real_vocab_tokenizer
from tito_models.tiny import SEED, _read_json, _write_json, build_cached

__all__ = ["SHAPES", "DTYPES", "VERSION", "shaped_model_name", "parse_shaped_model_name", "build_shaped_model",
           "ensure_shaped_model", "SHAPED_MODELS", "main"]

#: Bump whenever the produced bytes change, so cached copies are rebuilt.
VERSION = "v1"

_IDS = {content: token_id for token_id, content, _ in QWEN_ADDED_TOKENS}

#: Real models' text configs (the fields that shape the arithmetic and the KV cache).
SHAPES: dict[str, dict[str, Any]] = {
    # Qwen2.5-0.5B(-Instruct): 494 M parameters, tied embeddings, 14 / 2 heads of 64.
    "qwen2.5-0.5b": {
        "architectures": ["Qwen2ForCausalLM"],
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "max_position_embeddings": 32768,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": True,
        "vocab_size": QWEN_EMBEDDING_ROWS,
        "initializer_range": 0.02,
        "bos_token_id": _IDS["<|endoftext|>"],
        "eos_token_id": _IDS["<|im_end|>"],
    },
}
#: Checkpoint dtypes and their short names in model names.
DTYPES = {"bfloat16": "bf16", "float32": "fp32"}
SHAPED_MODELS = tuple(f"shape-{shape}-{short}" for shape in SHAPES for short in DTYPES.values())


def shaped_model_name(shape: str, dtype: str) -> str:
    """The `--model` name of a shape's checkpoint in a dtype: shape-qwen2.5-0.5b-bf16."""
    return f"shape-{shape}-{DTYPES[dtype]}"


def parse_shaped_model_name(name: str) -> tuple[str, str] | None:
    """(shape, dtype) of a name from :data:`SHAPED_MODELS`; None for any other name."""
    for shape in SHAPES:
        for dtype, short in DTYPES.items():
            if name == f"shape-{shape}-{short}":
                return shape, dtype
    return None


def _config(shape: str, dtype: str) -> Any:
    from transformers import Qwen2Config

    fields = dict(SHAPES[shape])
    architectures = fields.pop("architectures")
    rope_theta = fields.pop("rope_theta")
    config = Qwen2Config(**fields, hidden_act="silu", use_sliding_window=False, attention_dropout=0.0,
                         use_cache=True, rope_parameters={"rope_type": "default", "rope_theta": rope_theta},
                         dtype=dtype)
    config.architectures = architectures
    return config


def _weights(model: Any, dtype: str) -> dict[str, Any]:
    """Every parameter of `model` (built on the meta device: names and shapes only), filled from a
    generator seeded by its name, in `dtype`; a tied output layer is left to the embedding."""
    import torch

    std = model.config.initializer_range
    tied = {"lm_head.weight"} if model.config.tie_word_embeddings else set()
    state = {}
    for name, param in model.named_parameters():
        if name in tied:
            continue
        if name.endswith(".bias"):
            value = torch.zeros(param.shape)
        elif "norm" in name:
            value = torch.ones(param.shape)
        else:
            generator = torch.Generator().manual_seed(SEED + zlib.crc32(name.encode()))
            value = torch.empty(param.shape).normal_(0.0, std, generator=generator)
        state[name] = value.to(getattr(torch, dtype)).contiguous()
    return state


def build_shaped_model(out_dir: Path, shape: str = "qwen2.5-0.5b", dtype: str = "bfloat16") -> Path:
    """Write config.json, generation_config.json, the real-vocabulary tokenizer and the seeded
    random weights (model.safetensors in `dtype`) of `shape` into `out_dir`."""
    import shutil

    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    if shape not in SHAPES:
        raise ValueError(f"unknown shape {shape!r}; expected one of {list(SHAPES)}")
    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {list(DTYPES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    tokenizer_dir = ensure_real_vocab_tokenizer()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copyfile(tokenizer_dir / name, out_dir / name)
    config = _config(shape, dtype)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    weights_path = out_dir / "model.safetensors"
    save_file(_weights(model, dtype), str(weights_path), metadata={"format": "pt"})
    os.chmod(weights_path, 0o644)  # safetensors writes 0600; as readable as the other files
    config.save_pretrained(out_dir)
    _write_json(out_dir / "config.json", _read_json(out_dir / "config.json"))  # sorted, as the tiny models
    _write_json(out_dir / "generation_config.json", {
        "bos_token_id": _IDS["<|endoftext|>"], "do_sample": False,
        "eos_token_id": [_IDS["<|im_end|>"], _IDS["<|endoftext|>"]], "pad_token_id": _IDS["<|endoftext|>"]})
    return out_dir


def _is_complete(model_dir: Path) -> bool:
    return all((model_dir / name).is_file() for name in ("config.json", "model.safetensors", "tokenizer.json"))


def ensure_shaped_model(shape: str = "qwen2.5-0.5b", dtype: str = "bfloat16", cache_dir: Path | None = None) -> Path:
    """The cached checkpoint of `shape` in `dtype`, built on first use (`tiny.build_cached`)."""
    return build_cached(f"shape-{shape}-{DTYPES[dtype]}-{VERSION}",
                        lambda out: build_shaped_model(out, shape, dtype), _is_complete, cache_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tito_models.real_shape", description=__doc__.split("\n\n")[0])
    parser.add_argument("out_dir", type=Path, help="directory to write the checkpoint into")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    args = parser.parse_args(argv)
    print(build_shaped_model(args.out_dir, args.shape, args.dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
