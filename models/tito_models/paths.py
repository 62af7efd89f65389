"""Resolve a `--model` value to a local model directory. tito never downloads models.

A value is either a path to a Hugging Face model directory (config.json, tokenizer files,
safetensors weights) or the name of a model tito builds itself offline: the random-weight tiny
ones of `tito_models.tiny`, the trained `tito-demo` of `tito_models.demo`, or a random-weight
checkpoint of a real model's shape (`tito_models.real_shape`, e.g. shape-qwen2.5-0.5b-bf16).
"""

from __future__ import annotations

from pathlib import Path

from tito.config import ConfigError
from tito_models.demo import DEMO_MODEL, ensure_demo_model
from tito_models.real_shape import SHAPED_MODELS, ensure_shaped_model, parse_shaped_model_name
from tito_models.tiny import MODELS, TEXT_MODEL, ensure_model

#: What `tito serve` loads without --model: the random-weight tiny Qwen2 (seconds to build).
DEFAULT_MODEL = TEXT_MODEL
#: What `tito chat` starts its own services on: the trained demo model, which answers sensibly.
DEFAULT_CHAT_MODEL = DEMO_MODEL
TINY_MODELS = (*MODELS, DEMO_MODEL)


def resolve_model(spec: str, cache_dir: Path | None = None) -> Path:
    """Return the model directory for `spec`, building a tiny model on first use."""
    if spec in TINY_MODELS:
        try:
            return ensure_demo_model(cache_dir) if spec == DEMO_MODEL else ensure_model(spec, cache_dir)
        except ImportError as exc:  # a service installed alone (e.g. tito[derender]) cannot build one
            raise ConfigError(
                f"--model {spec}: building this tiny model needs {exc.name or 'torch'}, which is not installed "
                f"(pip install 'tito[models]'); or pass the directory of a model built elsewhere, e.g. by "
                f"`python -m tito_models.tiny DIR --model {spec}`") from None
    shaped = parse_shaped_model_name(spec)
    if shaped is not None:
        return ensure_shaped_model(*shaped, cache_dir=cache_dir)
    path = Path(spec).expanduser()
    if (path / "config.json").is_file() or (path / "tokenizer.json").is_file():
        return path
    raise ConfigError(
        f"--model {spec!r}: not a model directory (expected config.json / tokenizer.json in it) and not "
        f"a built-in model ({', '.join((*TINY_MODELS, *SHAPED_MODELS))}). tito does not download models: pass the path "
        f"of a local Hugging Face model directory.")
