"""`--model` checked from its files before an engine starts anything (model_info.check_checkpoint)."""

from __future__ import annotations

import json
import shutil

import pytest

from tito.config import ConfigError
from tito_engine.model_info import check_checkpoint


def test_a_complete_checkpoint_passes(tiny_text_model):
    check_checkpoint(tiny_text_model, "tiny-qwen2")


@pytest.mark.parametrize("config, message", [
    (None, "config.json cannot be read"),
    ("{not json", "is not JSON"),
    ('{"architectures": ["Qwen2ForCausalLM"]}', "names no model_type"),
    ('{"model_type": "qwen2"}', "no weight files"),
])
def test_what_a_directory_lacks_is_named(tmp_path, config, message):
    if config is not None:
        (tmp_path / "config.json").write_text(config)
    with pytest.raises(ConfigError, match=message) as refusal:
        check_checkpoint(tmp_path, "m")
    assert str(refusal.value).startswith("--model m: ")


@pytest.mark.parametrize("damage", ["truncated", "empty", "header"])
def test_damaged_safetensors_are_refused(tiny_text_model, tmp_path, damage):
    model = tmp_path / "m"
    shutil.copytree(tiny_text_model, model)
    weights = model / "model.safetensors"
    data = weights.read_bytes()
    if damage == "truncated":
        weights.write_bytes(data[:-1])
    elif damage == "empty":
        weights.write_bytes(b"")
    else:
        weights.write_bytes(len(b"{oops").to_bytes(8, "little") + b"{oops" + data[8:])
    with pytest.raises(ConfigError, match="is truncated or damaged"):
        check_checkpoint(model, "m")
    assert json.loads((model / "config.json").read_text())  # only the weights were damaged
