"""Weight-only int8 (`--quantization int8`): per-output-channel symmetric scales computed at load,
activations in the compute dtype, every projection and the output layer quantized.

The reference is the same quantization done in plain torch: each weight quantized and dequantized
(`dequantize_per_channel`), then HF's own forward. The engine's int8 linears sum in another order
than HF's float matmul (the scale applied to the sum), so greedy tokens are held equal up to the
first step where HF's own top two logits are within float32 rounding of each other. Agreement with
the float model is reported (`-s`), not asserted: that is the quantization's quality, not a bug.
"""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from engine_greedy import engine_greedy, hf_greedy_with_gaps
from tito.config import ConfigError
from tito.cpu_isa import cpu_supports
from tito_engine.config import EngineConfig
from tito_engine.model.quantization import Int8Linear
from tito_engine.model.quantization.int8 import dequantize_per_channel, quantize_per_channel
from tito_engine.model.quantization.int8_kernel import load_int8_kernel
from tito_engine.model.runner import ModelRunner
from tito_engine.startup_plan import plan_startup

NEW_TOKENS = 16
#: HF's top-two logit gap below which float32 sums taken in another order may order them either way.
TIE_MARGIN = 1e-3
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def prompts(vocab: int) -> list[list[int]]:
    return [[(13 * i + 5 * j) % (vocab - 20) + 5 for j in range(2 + 4 * i)] for i in range(8)]


def dequantized_hf(model_dir) -> torch.nn.Module:
    """HF's model with every linear the engine quantizes replaced by its quantize -> dequantize
    round trip (the output layer untied from the embedding, which stays float)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for module in model.modules():
            for name in PROJECTIONS:
                linear = getattr(module, name, None)
                if isinstance(linear, torch.nn.Linear):
                    linear.weight = torch.nn.Parameter(dequantize_per_channel(*quantize_per_channel(linear.weight)))
        model.lm_head.weight = torch.nn.Parameter(dequantize_per_channel(*quantize_per_channel(model.lm_head.weight)))
    model.generation_config.eos_token_id = None
    model.config.eos_token_id = None
    return model


def test_quantize_per_channel_is_symmetric_per_row():
    weight = torch.randn(6, 32) * torch.tensor([1e-3, 0.1, 1.0, 10.0, 0.0, 3.0])[:, None]
    q, scale = quantize_per_channel(weight)
    assert q.dtype == torch.int8 and scale.shape == (6,)
    assert int(q.abs().max()) == 127 and int(q.min()) >= -127
    assert torch.equal(q[4], torch.zeros(32, dtype=torch.int8)) and float(scale[4]) == 1.0  # an all-zero row
    error = (dequantize_per_channel(q, scale) - weight).abs()
    assert bool((error <= scale[:, None] / 2 + 1e-7).all())  # rounding: half a step at most


@pytest.mark.parametrize("rows", [1, 3, 4, 9, 32])
@pytest.mark.parametrize("bias", [False, True])
def test_int8_linear_equals_a_matmul_on_the_dequantized_weight(rows, bias):
    weight, x = torch.randn(37, 64) * 0.05, torch.randn(rows, 64)  # 37 outputs: a tail past the 4-row tiles
    b = torch.randn(37) if bias else None
    expected = torch.nn.functional.linear(x, dequantize_per_channel(*quantize_per_channel(weight)), b)
    kernel = load_int8_kernel()
    assert kernel is not None, "the int8 kernel did not build (a C compiler is part of the test machine)"
    for linear in (Int8Linear(weight, b, kernel), Int8Linear(weight, b, None)):  # the kernel, torch's path
        torch.testing.assert_close(linear(x), expected, rtol=1e-4, atol=1e-4)
    assert Int8Linear(weight, b).weight_bytes == 37 * 64 + 37 * 4


@pytest.mark.skipif(not cpu_supports(torch.bfloat16), reason="this CPU has no bfloat16 instructions")
def test_int8_linear_in_bfloat16_runs_torch_int8_matmul():
    weight, x = torch.randn(48, 64) * 0.05, torch.randn(5, 64)
    linear = Int8Linear(weight.bfloat16(), None)
    expected = torch.nn.functional.linear(x, dequantize_per_channel(*quantize_per_channel(weight.bfloat16())))
    got = linear(x.bfloat16())
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.float(), expected, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("family", ["tiny_text_model", "tiny_llama_model", "tiny_qwen3_model"])
def test_int8_greedy_tokens_equal_hf_on_dequantized_weights(family, request):
    model_dir = request.getfixturevalue(family)
    runner = ModelRunner(model_dir, model_id=family, device="cpu", dtype="float32", quantization="int8")
    layer = runner.decoder.family.layers[0]
    assert all(isinstance(getattr(layer, name), Int8Linear) for name in ("qkv", "o", "gate_up", "down"))
    assert isinstance(runner.decoder.family.lm_head, Int8Linear)
    batch = prompts(runner.info.vocab_size)
    got = engine_greedy(runner, batch, NEW_TOKENS)
    reference = dequantized_hf(model_dir)
    equal, parted = 0, []
    for index, (prompt, tokens) in enumerate(zip(batch, got)):
        expected, gaps = hf_greedy_with_gaps(reference, prompt, NEW_TOKENS)
        if tokens == expected:
            equal += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        assert gaps[first] <= TIE_MARGIN, (
            f"{family} prompt {index}: int8 tokens part from the dequantized HF model at step {first}, HF's top-two "
            f"gap {gaps[first]:.5f}: engine {tokens[:first + 1]} vs HF {expected[:first + 1]}")
        parted.append((index, first))
    assert equal >= len(batch) - 1, f"{family}: {equal}/{len(batch)} equal; parted at ties {parted}"
    print(f"{family}: int8 top-1 agreement with the float model {float_agreement(model_dir, batch, got):.1%} "
          f"(teacher-forced over {len(batch)} prompts x {NEW_TOKENS} tokens)")


def float_agreement(model_dir, batch: list[list[int]], generated: list[list[int]]) -> float:
    """How often the float model's argmax, fed the int8 run's tokens, is the int8 run's next token."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    same = total = 0
    with torch.inference_mode():
        for prompt, tokens in zip(batch, generated):
            logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0, len(prompt) - 1:]
            same += int((logits.argmax(-1) == torch.tensor(tokens)).sum())
            total += len(tokens)
    return same / total


def test_quantized_linears_free_the_float_weights(tiny_text_model):
    runner = ModelRunner(tiny_text_model, model_id="m", device="cpu", quantization="int8")
    quantized = runner.decoder.quantized
    layers = len(runner.decoder.family.layers)
    assert quantized.count == 4 * layers + 1  # each layer's four projections and the output layer
    assert quantized.float_bytes_freed > 3 * quantized.quantized_bytes // 2
    assert runner.model.model.layers[0].mlp.down_proj.weight.numel() == 0


def test_quantization_is_validated_at_start_up_and_reaches_the_core():
    config = EngineConfig(model="tiny-qwen2", quantization="int8")
    config.validate()
    runner = plan_startup(config).core_spec(config).load_runner()
    assert isinstance(runner.decoder.family.layers[0].qkv, Int8Linear)
    with pytest.raises(ConfigError, match="the native backend takes --quantization int8"):
        EngineConfig(model="tiny-qwen2", quantization="int4").validate()


def test_the_kernel_builds_without_openmp_where_openmp_cannot_be_built(monkeypatch, tmp_path):
    import tito_engine.model.quantization.int8_kernel as int8_kernel

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setattr(int8_kernel, "EXTRA_FLAGS", ("-fno-such-option-anywhere",))  # the OpenMP build fails
    load_int8_kernel.cache_clear()
    try:
        kernel = load_int8_kernel()
        assert kernel is not None
        weight, x = torch.randn(8, 32), torch.randn(2, 32)
        expected = torch.nn.functional.linear(x, dequantize_per_channel(*quantize_per_channel(weight)))
        torch.testing.assert_close(Int8Linear(weight, None, kernel)(x), expected, rtol=1e-4, atol=1e-4)
    finally:
        load_int8_kernel.cache_clear()  # the next caller builds (or finds) the usual kernel
