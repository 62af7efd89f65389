"""The vllm backend's configuration: tito flags translated, vLLM arguments passed through, conflicts refused."""

from __future__ import annotations

import json

import pytest
import torch

from tito_cli.main import main as tito_main
from tito.config import ConfigError
from tito_engine.config import EngineConfig
from tito_engine.model.runner import DTYPES, choose_dtype
from tito_engine.vllm.args import build_engine_args

pytestmark = pytest.mark.vllm

GIB = 1 << 30


def vllm_config(*vllm_args, **fields) -> EngineConfig:
    return EngineConfig(backend="vllm", vllm_args=tuple(vllm_args), **fields)


def test_tito_flags_translate_and_vllm_arguments_pass_through():
    config = vllm_config("--tensor-parallel-size", "2", "--gpu-memory-utilization", "0.5", "--dtype", "bfloat16",
                         "--kv-cache-dtype", "fp8", "--enforce-eager",
                         max_running_sequences=8, max_choices_per_request=4, max_model_len=512,
                         prefix_caching=False, kv_cache_bytes=1 << 20, block_size=32, max_prefill_tokens_per_step=256)
    config.validate()
    args = build_engine_args(config, "/models/m")
    assert (args.model, args.tokenizer, args.served_model_name) == ("/models/m", "/models/m", ["tiny-qwen2"])
    assert (args.max_num_seqs, args.max_model_len, args.enable_prefix_caching) == (8, 512, False)
    assert (args.kv_cache_memory_bytes, args.block_size, args.max_num_batched_tokens) == (1 << 20, 32, 256)
    assert (args.tensor_parallel_size, args.gpu_memory_utilization, args.dtype) == (2, 0.5, "bfloat16")
    assert (args.kv_cache_dtype, args.enforce_eager) == ("fp8", True)
    # Render resolves sampling defaults; the engine must not apply the model's a second time.
    assert args.generation_config == "vllm" and args.disable_log_stats is False
    # Render's pixel values arrive normalized: vLLM must not normalize them again in the model.
    assert args.mm_device_do_normalize is False


def test_quantization_passes_through_to_vllm_and_is_checked_against_its_methods():
    config = vllm_config(quantization="fp8", kv_cache_bytes=1 << 20)
    config.validate()
    assert build_engine_args(config, "/models/m").quantization == "fp8"
    # none: vLLM reads the checkpoint's own quantization_config.
    assert build_engine_args(vllm_config(kv_cache_bytes=1 << 20), "/models/m").quantization is None
    with pytest.raises(ConfigError, match="'int4' is not a vLLM quantization method; vLLM takes one of .*gptq"):
        vllm_config(quantization="int4").validate()
    with pytest.raises(ConfigError, match="set by tito's --quantization"):
        vllm_config("--quantization", "fp8").validate()


def test_lora_flags_turn_on_vllm_s_own_lora_support(tmp_path):
    config = vllm_config(lora_dir=str(tmp_path), max_loras=3, max_lora_rank=32, kv_cache_bytes=1 << 20)
    config.validate()
    args = build_engine_args(config, "/models/m")
    assert (args.enable_lora, args.max_loras, args.max_lora_rank) == (True, 3, 32)
    assert not build_engine_args(vllm_config(kv_cache_bytes=1 << 20), "/models/m").enable_lora


def test_with_no_prefill_budget_given_vllm_keeps_its_own_default():
    from vllm.engine.arg_utils import AsyncEngineArgs

    args = build_engine_args(vllm_config(kv_cache_bytes=1 << 20), "/models/m")
    assert args.max_num_batched_tokens == AsyncEngineArgs.max_num_batched_tokens


def test_dtype_is_tito_s_flag_or_vllm_s_but_not_both():
    args = build_engine_args(vllm_config(dtype="bfloat16", kv_cache_bytes=1 << 20), "/models/m")
    assert args.dtype == "bfloat16"
    with pytest.raises(ConfigError, match="--dtype is given twice"):
        vllm_config("--dtype", "float32", dtype="bfloat16").validate()


def _checkpoint(tmp_path, dtype, weights=0):
    (tmp_path / "config.json").write_text(json.dumps({
        "model_type": "qwen2", "dtype": dtype, "num_hidden_layers": 4, "num_attention_heads": 4,
        "num_key_value_heads": 2, "hidden_size": 256, "max_position_embeddings": 2048}))
    (tmp_path / "model.safetensors").write_bytes(b"\0" * weights)
    return str(tmp_path)


def test_with_no_kv_size_vllm_s_cpu_cache_is_sized_by_tito_s_rule(tmp_path, monkeypatch):
    import tito_engine.vllm.args as vllm_args

    monkeypatch.setattr(vllm_args, "available_host_memory", lambda: 9 * GIB + (8 << 20))
    model = _checkpoint(tmp_path, "float32", weights=8 << 20)
    per_token = 2 * 4 * 2 * 64 * 4  # float32 K and V of 4 layers, 2 KV heads of 64
    # Capped: 64 sequences x 2048 tokens is far less than half of 8 GiB.
    assert build_engine_args(vllm_config(), model).kv_cache_memory_bytes == 64 * 2048 * per_token
    # Uncapped: 0.25 x (9 GiB free after the 8 MiB of weights - 1 GiB reserve).
    args = build_engine_args(vllm_config(kv_memory_fraction=0.25, max_running_sequences=4096), model)
    assert args.kv_cache_memory_bytes == 2 * GIB
    assert build_engine_args(vllm_config(kv_cache_bytes=1 << 20), model).kv_cache_memory_bytes == 1 << 20
    # vLLM's own sizing, when asked for after `--`, is left to vLLM.
    assert build_engine_args(vllm_config("--gpu-memory-utilization", "0.3"), model).kv_cache_memory_bytes is None
    with pytest.raises(ConfigError, match="give one"):
        vllm_config("--gpu-memory-utilization", "0.3", kv_memory_fraction=0.3).validate()


@pytest.mark.parametrize("stored", ["float32", "bfloat16", "float16"])
def test_auto_is_the_native_engine_s_rule_not_vllm_s(tmp_path, stored):
    # vLLM's own `auto` downcasts a float32 checkpoint to bfloat16 on CPU; tito's keeps float32, so
    # vLLM is handed the dtype the native engine computes the same checkpoint in.
    expected, _ = choose_dtype(torch.device("cpu"), "auto", DTYPES[stored])
    args = build_engine_args(vllm_config(), _checkpoint(tmp_path, stored))
    assert args.dtype == str(expected).removeprefix("torch.")
    if stored == "float32":
        assert args.dtype == "float32"


def test_vllm_s_own_dtype_after_the_double_dash_is_kept(tmp_path):
    args = build_engine_args(vllm_config("--dtype", "bfloat16"), _checkpoint(tmp_path, "float32"))
    assert args.dtype == "bfloat16"


@pytest.mark.parametrize("vllm_args, message", [
    (("--max-model-len", "100"), "--max-model-len"),
    (("--max-num-seqs", "4"), "--max-running-sequences"),
    (("--enable-prefix-caching",), "--prefix-caching"),
    (("--generation-config", "auto"), "render's resolved sampling"),
    (("--mm-device-do-normalize",), "pixel values arrive normalized"),
    (("--enable-lora",), "--lora-dir"),
    (("--max-loras", "2"), "--max-loras"),
    (("--tensor-paralel-size", "2"), "unrecognized arguments"),
    (("--gpu-memory-utilization", "lots"), "invalid"),
])
def test_conflicts_and_typos_are_refused_at_start_up(vllm_args, message):
    with pytest.raises(ConfigError, match=message):
        vllm_config(*vllm_args).validate()


@pytest.mark.parametrize("fields, flag", [
    ({"kv_blocks": 10}, "--kv-blocks"),
    ({"cpu_threads": 2}, "--cpu-threads"),
    ({"engine_process": False}, "--no-engine-process"),
    ({"device": "cuda:1"}, "--device"),
    ({"exclude_padding_ids": True}, "--exclude-padding-ids"),
])
def test_native_only_flags_are_refused_with_vllm(fields, flag):
    with pytest.raises(ConfigError, match=flag):
        vllm_config(**fields).validate()


def test_vllm_arguments_need_the_vllm_backend():
    with pytest.raises(ConfigError, match="need --backend vllm"):
        EngineConfig(vllm_args=("--dtype", "float32")).validate()
    with pytest.raises(ConfigError, match="must be native"):
        EngineConfig(backend="sglang").validate()


def test_cli_takes_vllm_arguments_after_a_double_dash_for_the_engine_only(capsys):
    assert tito_main(["serve", "engine", "--backend", "vllm", "--", "--max-model-len", "7"]) == 2
    assert "--max-model-len" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        tito_main(["serve", "render", "--", "--dtype", "float32"])
    assert "only `tito serve engine --backend vllm`" in capsys.readouterr().err


def test_a_model_that_cannot_load_is_one_line_not_a_traceback(tmp_path, capsys):
    assert tito_main(["serve", "engine", "--address", "127.0.0.1:0", "--model", str(tmp_path / "missing")]) == 2
    error = capsys.readouterr().err.strip().splitlines()
    assert error[-1].startswith("tito serve engine: --model") and "Traceback" not in "\n".join(error)


def test_padding_exclusion_defaults_on_for_native_and_off_for_vllm():
    assert EngineConfig().excludes_padding_ids
    assert not EngineConfig(exclude_padding_ids=False).excludes_padding_ids
    vllm_config().validate()  # the default (None) is not an explicit request
    vllm_config(exclude_padding_ids=False).validate()
