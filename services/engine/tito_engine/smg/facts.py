"""What SMG's GetModelInfo reports beyond tito's ModelInfo, read once from the model directory:
the architecture (config.json) and the generation config's sampling defaults.

tito.v1 has render resolve sampling defaults before a request reaches the engine; SMG resolves
them itself from what the worker advertises (`default_sampling_params_json`, the keys vLLM's
servicer advertises), so requests through either path sample alike.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tito.vocab import read_model_config

#: The generation-config keys advertised as sampling defaults (vLLM's servicer's set).
SAMPLING_DEFAULT_KEYS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


@dataclass(frozen=True)
class ModelFacts:
    model_type: str = ""
    architectures: tuple[str, ...] = ()
    pad_token_id: int = 0  # 0 when the config names none (as vLLM's servicer reports it)
    bos_token_id: int = 0
    sampling_defaults_json: str = ""  # compact JSON of the defaults; "" when there are none


def _id(config: dict[str, Any], name: str) -> int:
    value = config.get(name)
    if value is None and isinstance(config.get("text_config"), dict):
        value = config["text_config"].get(name)
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else 0


def _generation_config(model_dir: Path) -> dict[str, Any]:
    try:
        data = json.loads((model_dir / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def sampling_defaults_json(generation_config: dict[str, Any]) -> str:
    # A sampled model's defaults apply only when it samples (transformers' own rule: with
    # do_sample false, generate() is greedy whatever temperature says).
    if generation_config.get("do_sample") is False:
        return json.dumps({"temperature": 0.0}, separators=(",", ":"))
    defaults = {key: value for key in SAMPLING_DEFAULT_KEYS
                if isinstance(value := generation_config.get(key), (int, float)) and not isinstance(value, bool)}
    return json.dumps(defaults, separators=(",", ":")) if defaults else ""


def read_model_facts(model_dir: Path) -> ModelFacts:
    config = read_model_config(model_dir)
    architectures = config.get("architectures")
    return ModelFacts(
        model_type=str(config.get("model_type") or ""),
        architectures=tuple(str(a) for a in architectures) if isinstance(architectures, list) else (),
        pad_token_id=_id(config, "pad_token_id"), bos_token_id=_id(config, "bos_token_id"),
        sampling_defaults_json=sampling_defaults_json(_generation_config(Path(model_dir))))
