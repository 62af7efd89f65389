"""int4 checkpoints in GPTQ's, AWQ's and compressed-tensors' layouts, written by the test bit by bit as those tools save
them (tests/support/int4_checkpoints.py): the loader's weights equal a plain-torch dequantization
of the values written, greedy tokens equal HF's forward on those dequantized weights, and every
layout outside the ones covered is refused at start-up in one line."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_greedy import engine_greedy, hf_greedy_with_gaps
from int4_checkpoints import PROJECTIONS, write_int4_checkpoint
from tito.config import ConfigError
from tito.cpu_isa import cpu_supports
from tito_engine.config import EngineConfig
from tito_engine.model.quantization import Int4Linear, checkpoint_quantization
from tito_engine.model.quantization.int4_checkpoint import Int4Weights
from tito_engine.model.runner import ModelRunner
from tito_engine.startup_plan import plan_startup

GROUP = 32
NEW_TOKENS = 16
TIE_MARGIN = 1e-3
METHODS = ["gptq", "awq", "compressed-tensors"]


@pytest.fixture(scope="module")
def int4_models(tiny_text_model, tmp_path_factory) -> dict:
    """{method: (checkpoint directory, {module: (q, scales, zeros)} as written)}."""
    models = {}
    for method in METHODS:
        out = tmp_path_factory.mktemp(method) / f"tiny-qwen2-{method}"
        models[method] = out, write_int4_checkpoint(tiny_text_model, out, method, GROUP)
    return models


@pytest.fixture(params=METHODS)
def int4_model(request, int4_models):
    """(method, checkpoint directory, values written), for each method."""
    return request.param, *int4_models[request.param]


def reference_weight(values, module: str) -> torch.Tensor:
    q, scales, zeros = values[module]
    return (q.float() - zeros.float().repeat_interleave(GROUP, 1)) * scales.float().repeat_interleave(GROUP, 1)


def linear_weight(linear: Int4Linear, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """The weight a linear computes with, read back through a call on the identity."""
    out = linear(torch.eye(in_features, dtype=dtype))
    return (out - (linear.bias if linear.bias is not None else 0)).float().t()


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_loaded_int4_weights_equal_the_plain_torch_dequantization(int4_model, dtype):
    if dtype == "bfloat16" and not cpu_supports(torch.bfloat16):
        pytest.skip("this CPU has no bfloat16 instructions")
    method, model_dir, values = int4_model
    runner = ModelRunner(model_dir, model_id=method, device="cpu", dtype=dtype)
    assert runner.decoder.quantized.count == 4 * len(runner.decoder.family.layers)  # the output layer stays float
    for index, layer in enumerate(runner.decoder.family.layers):
        prefix = f"model.layers.{index}."
        expected = {
            "qkv": torch.cat([reference_weight(values, prefix + f"self_attn.{n}") for n in ("q_proj", "k_proj",
                                                                                              "v_proj")]),
            "o": reference_weight(values, prefix + "self_attn.o_proj"),
            "gate_up": torch.cat([reference_weight(values, prefix + f"mlp.{n}") for n in ("gate_proj", "up_proj")]),
            "down": reference_weight(values, prefix + "mlp.down_proj"),
        }
        for name, weight in expected.items():
            linear = getattr(layer, name)
            assert isinstance(linear, Int4Linear)
            got = linear_weight(linear, weight.shape[1], runner.dtype)
            if dtype == "float32":
                torch.testing.assert_close(got, weight, rtol=0, atol=1e-6)
            else:  # the identity's product comes back in bfloat16
                torch.testing.assert_close(got, weight, rtol=1e-2, atol=1e-3)


@pytest.mark.parametrize("rows", [1, 5, 32])
def test_int4_linear_paths_equal_the_dequantized_matmul(rows):
    """float32: the int8 kernel with a scale per group, and the dequantize-per-call path (CUDA's, or no
    compiler); bfloat16: torch's packed int4 matmul (its offset carrying the zero points)."""
    generator = torch.Generator().manual_seed(rows)
    q = torch.randint(0, 16, (48, 128), generator=generator, dtype=torch.uint8)
    zeros = torch.randint(0, 16, (48, 128 // GROUP), generator=generator, dtype=torch.uint8)
    weights = Int4Weights(q, torch.rand(48, 128 // GROUP, generator=generator) * 0.01, zeros, GROUP)
    x, bias = torch.randn(rows, 128, generator=generator), torch.randn(48, generator=generator)
    expected = torch.nn.functional.linear(x, weights.dequantize(), bias)
    kernel_path = Int4Linear(weights, bias, torch.float32, torch.device("cpu"))
    assert kernel_path._kernel is not None, "the int8 kernel did not build (a C compiler is part of the test machine)"
    torch.testing.assert_close(kernel_path(x), expected, rtol=1e-4, atol=1e-4)
    kernel_path._kernel = None
    torch.testing.assert_close(kernel_path(x), expected, rtol=1e-4, atol=1e-4)
    assert kernel_path.weight_bytes == 48 * 128 + 48 * 4 * 4
    if cpu_supports(torch.bfloat16):
        packed = Int4Linear(weights, bias, torch.bfloat16, torch.device("cpu"))
        assert packed.weight_bytes == 48 * 64 + 48 * 4 * 4  # half a byte a value
        torch.testing.assert_close(packed(x.bfloat16()).float(), expected, rtol=3e-2, atol=3e-2)


def dequantized_hf(float_dir, values) -> torch.nn.Module:
    """HF's float model with every quantized linear set to its plain-torch dequantization."""
    model = AutoModelForCausalLM.from_pretrained(float_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rpartition(".")[2] in PROJECTIONS:
                module.weight = torch.nn.Parameter(reference_weight(values, name))
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


def test_int4_greedy_tokens_equal_hf_on_dequantized_weights(int4_model, tiny_text_model):
    method, model_dir, values = int4_model
    runner = ModelRunner(model_dir, model_id=method, device="cpu", dtype="float32")
    batch = [[(13 * i + 5 * j) % (runner.info.vocab_size - 20) + 5 for j in range(2 + 4 * i)] for i in range(8)]
    got = engine_greedy(runner, batch, NEW_TOKENS)
    reference = dequantized_hf(tiny_text_model, values)
    equal, parted = 0, []
    for index, (prompt, tokens) in enumerate(zip(batch, got)):
        expected, gaps = hf_greedy_with_gaps(reference, prompt, NEW_TOKENS)
        if tokens == expected:
            equal += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        assert gaps[first] <= TIE_MARGIN, f"{method} prompt {index} parts at step {first}: {tokens} vs {expected}"
        parted.append((index, first))
    assert equal >= len(batch) - 1, f"{method}: {equal}/{len(batch)} equal; parted at ties {parted}"


REFUSED = [
    ("gptq", {"sym": False}, "GPTQ with {'bits': 4, 'sym': False"),
    ("gptq", {"bits": 8}, "GPTQ with {'bits': 8"),
    ("gptq", {"checkpoint_format": "gptq_v2"}, "'checkpoint_format': 'gptq_v2'"),
    ("gptq", {"lm_head": True}, "'lm_head': True"),
    ("gptq", {"desc_act": True}, "desc_act"),
    ("awq", {"version": "gemv"}, "'version': 'gemv'"),
    ("awq", {"zero_point": False}, "'zero_point': False"),
    ("awq", {"quant_method": "fp8"}, "quant_method 'fp8' is not loaded"),
    ("compressed-tensors", {"format": "float-quantized"}, "compressed-tensors format 'float-quantized'"),
    ("compressed-tensors", {"config_groups": {"group_0": {"weights": {"num_bits": 8, "type": "int", "symmetric": True,
                                                                      "strategy": "channel"},
                                                          "input_activations": {"num_bits": 8}}}},
     "'num_bits': 8"),
]


@pytest.mark.parametrize("method, overrides, message", REFUSED)
def test_other_layouts_are_refused_at_start_up_in_one_line(int4_models, tmp_path, method, overrides, message):
    config = json.loads((int4_models[method][0] / "config.json").read_text())
    config["quantization_config"].update(overrides)
    (tmp_path / "config.json").write_text(json.dumps(config))
    with pytest.raises(ConfigError, match="the native engine loads GPTQ 4-bit symmetric") as refused:
        checkpoint_quantization(tmp_path)
    assert message in str(refused.value) and "\n" not in str(refused.value)
    with pytest.raises(ConfigError, match="--backend vllm"):
        plan_startup(EngineConfig(model=str(tmp_path)))


def test_int8_on_an_int4_checkpoint_is_refused_at_start_up(int4_model):
    method, model_dir, _ = int4_model
    assert checkpoint_quantization(model_dir).method == method
    with pytest.raises(ConfigError, match=f"already quantized \\({method} int4\\)"):
        plan_startup(EngineConfig(model=str(model_dir), quantization="int8"))
