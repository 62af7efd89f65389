"""The checkpoint's dtype on CPU: bfloat16 computes in bfloat16 where the CPU has the instructions,
`--dtype` overrides, and greedy tokens in bfloat16 equal HF `generate` in bfloat16.

bfloat16 keeps 8 bits of mantissa: two logits closer than its rounding can swap places when the
sums are taken in another order (oneDNN's packed kernels, a batched attention), as between any two
bf16 implementations. So the equality rule is: every prompt's greedy tokens equal HF's up to the
first step where HF's own top two logits are within `TIE_MARGIN` of each other (a tie at bf16
rounding); at such a step the two runs may part, and the test reports where (first-divergence
figures in the assertion messages and `-s` output). Every family runs 12 prompts of different
lengths, 24 new tokens each, alone in HF and batched in the engine (one prefill step for all of
them, then 23 decode steps of 12 rows).
"""

from __future__ import annotations

import json

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoModelForImageTextToText

from engine_greedy import engine_greedy, hf_greedy_with_gaps
from tito.cpu_isa import cpu_supports
from tito_engine.model.runner import ModelRunner, checkpoint_dtype, choose_dtype
from tito.config import ConfigError

NEW_TOKENS = 24
#: HF's top-two logit gap (absolute) below which bf16 rounding may order them either way: about
#: two bf16 steps at the tiny models' logit scale (|logit| < 8, where a step is 2^-5 = 0.031).
TIE_MARGIN = 0.0625

needs_bf16 = pytest.mark.skipif(not cpu_supports(torch.bfloat16), reason="this CPU has no bfloat16 instructions")


def prompts(vocab: int) -> list[list[int]]:
    return [[(11 * i + 7 * j) % (vocab - 20) + 5 for j in range(3 + 5 * i)] for i in range(12)]


FAMILIES = ["tiny_text_model", "tiny_llama_model", "tiny_qwen3_model", "tiny_interleaved_vl_model",
            "tiny_qwen2_5_vl_model"]


@needs_bf16
@pytest.mark.parametrize("family", FAMILIES)
def test_bf16_greedy_tokens_equal_hf_generate_in_bf16(family, request):
    model_dir = request.getfixturevalue(family)
    runner = ModelRunner(model_dir, model_id=family, device="cpu", dtype="bfloat16")
    assert runner.dtype == torch.bfloat16 and runner.info.dtype == "bfloat16"
    assert runner.cache.keys[0].dtype == torch.bfloat16
    vision = (json.loads((model_dir / "config.json").read_text())).get("vision_config") is not None
    hf = (AutoModelForImageTextToText if vision else AutoModelForCausalLM).from_pretrained(
        model_dir, dtype=torch.bfloat16).eval()
    hf.generation_config.eos_token_id = None  # generate merges its defaults from here and the config
    hf.config.get_text_config().eos_token_id = None
    batch = prompts(runner.info.vocab_size)
    got = engine_greedy(runner, batch, NEW_TOKENS)
    equal, parted = 0, []
    for index, (prompt, tokens) in enumerate(zip(batch, got)):
        expected, gaps = hf_greedy_with_gaps(hf, prompt, NEW_TOKENS)
        if tokens == expected:
            equal += 1
            continue
        first = next(i for i, (a, b) in enumerate(zip(tokens, expected)) if a != b)
        assert gaps[first] <= TIE_MARGIN, (
            f"{family} prompt {index}: tokens part at step {first} where HF's top-two gap is {gaps[first]:.4f} "
            f"(> {TIE_MARGIN}: not a bf16 tie): engine {tokens[:first + 1]} vs HF {expected[:first + 1]}")
        parted.append((index, first, round(gaps[first], 4)))
    print(f"{family}: {equal}/{len(batch)} prompts equal over {NEW_TOKENS} tokens; parted at bf16 ties "
          f"(prompt, step, HF top-two gap): {parted}")
    assert equal >= len(batch) // 2, f"{family}: only {equal}/{len(batch)} equal; parted {parted}"


def save_in(model_dir, out_dir, dtype: torch.dtype):
    """The tiny checkpoint re-saved in `dtype` (what a real bf16 checkpoint looks like)."""
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    model.save_pretrained(out_dir)
    for name in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        if (model_dir / name).is_file():
            (out_dir / name).write_bytes((model_dir / name).read_bytes())
    return out_dir


@needs_bf16
def test_auto_computes_a_bf16_checkpoint_in_bf16_and_float32_stays_float32(tiny_text_model, tmp_path):
    bf16_dir = save_in(tiny_text_model, tmp_path / "bf16", torch.bfloat16)
    assert checkpoint_dtype(bf16_dir) == torch.bfloat16 and checkpoint_dtype(tiny_text_model) == torch.float32
    assert ModelRunner(bf16_dir, model_id="m", device="cpu").info.dtype == "bfloat16"
    assert ModelRunner(tiny_text_model, model_id="m", device="cpu").info.dtype == "float32"
    # --dtype wins over the checkpoint, both ways.
    assert ModelRunner(bf16_dir, model_id="m", device="cpu", dtype="float32").info.dtype == "float32"


def test_choose_dtype_rules(monkeypatch):
    cpu = torch.device("cpu")
    import tito_engine.model.runner as runner_module

    monkeypatch.setattr(runner_module, "cpu_supports", lambda dtype: dtype == torch.float32)
    assert choose_dtype(cpu, "auto", torch.bfloat16)[0] == torch.float32  # no bf16 instructions: float32
    assert "no bfloat16 instructions" in choose_dtype(cpu, "auto", torch.bfloat16)[1]
    with pytest.raises(ConfigError, match="--dtype bfloat16: this CPU has no bfloat16 instructions"):
        choose_dtype(cpu, "bfloat16", torch.float32)
    monkeypatch.setattr(runner_module, "cpu_supports", lambda dtype: True)
    assert choose_dtype(cpu, "auto", torch.bfloat16)[0] == torch.bfloat16
    assert choose_dtype(cpu, "auto", torch.float16)[0] == torch.float16
    assert choose_dtype(cpu, "auto", torch.float32)[0] == torch.float32
    assert choose_dtype(cpu, "float16", torch.bfloat16) == (torch.float16, "--dtype")


@needs_bf16
def test_packed_bf16_linears_hold_one_copy_of_a_large_weight():
    from tito_engine.model.linear import Linear, pack_linears

    module = torch.nn.Linear(1024, 2048, bias=False).to(torch.bfloat16)
    linear = Linear(module.weight.detach(), None, sources=[module])
    x = torch.randn(3, 1024, dtype=torch.bfloat16)
    expected = torch.nn.functional.linear(x, module.weight)
    assert pack_linears([linear], release_plain=True) == (2048 * 1024 * 2, 2048 * 1024 * 2)
    assert linear.weight is None and module.weight.numel() == 0  # the plain copy is gone, module's too
    for rows in (1, 3):  # every row count takes the packed weight
        got = linear(x[:rows])
        assert (got.float() - expected[:rows].float()).norm() / expected[:rows].float().norm() < 1e-2


def test_dtype_is_a_flag_and_a_variable_that_reaches_the_core(capsys, monkeypatch):
    import tito_engine.model.runner as runner_module
    from tito_cli import main as cli
    from tito.env_flags import apply_env
    from tito_engine.server import config_from_args
    from tito_engine.startup_plan import plan_startup

    # The flag's way to the core, on any CPU: whether this one computes bf16 is the next test's concern.
    monkeypatch.setattr(runner_module, "cpu_supports", lambda dtype: True)
    parser = cli.build_parser()
    for argv, environ, expected in ((["--dtype", "bfloat16"], {}, "bfloat16"),
                                    ([], {"TITO_DTYPE": "float32"}, "float32"),
                                    ([], {}, "auto")):
        argv = ["serve", "engine", *argv]
        args = parser.parse_args(argv)
        apply_env(parser, cli.serve_parser(parser, "engine"), argv, args, environ)
        config = config_from_args(args)
        assert config.dtype == expected
        assert plan_startup(config).core_spec(config).dtype == expected
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", "engine", "--dtype", "int8"])
    assert "invalid choice: 'int8'" in capsys.readouterr().err


def test_a_dtype_the_cpu_lacks_is_refused_at_start_up(monkeypatch):
    import tito_engine.model.runner as runner_module
    from tito_engine.config import EngineConfig

    monkeypatch.setattr(runner_module, "cpu_supports", lambda dtype: dtype == torch.float32)
    with pytest.raises(ConfigError, match="--dtype float16: this CPU has no float16 instructions"):
        EngineConfig(device="cpu", dtype="float16").validate()
    EngineConfig(device="cpu", dtype="float32").validate()
