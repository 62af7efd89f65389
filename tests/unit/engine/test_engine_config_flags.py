"""--max-running-sequences (it counts choices) and its former name --max-running-requests."""

from __future__ import annotations

import logging

import pytest

from tito_cli import main as cli
from tito.config import ConfigError
from tito.env_flags import apply_env
from tito_engine.config import EngineConfig
from tito_engine.limits import (DEFAULT_MAX_PREFILL_TOKENS, DEFAULT_MAX_PREFILL_TOKENS_CPU,
                                DEFAULT_MAX_RUNNING_SEQUENCES, SchedulerLimits)
from tito_engine.server import config_from_args
from tito_engine.startup_plan import plan_startup, scheduler_limits
from tito_models.paths import resolve_model

DEPRECATION = ("--max-running-requests (TITO_MAX_RUNNING_REQUESTS) is deprecated: use --max-running-sequences "
               "(TITO_MAX_RUNNING_SEQUENCES), same meaning")


def engine_config(argv: list[str], environ: dict[str, str] | None = None) -> EngineConfig:
    parser = cli.build_parser()
    argv = ["serve", "engine", *argv]
    args = parser.parse_args(argv)
    apply_env(parser, cli.serve_parser(parser, "engine"), argv, args, environ or {})
    return config_from_args(args)


def deprecations(caplog) -> list[str]:
    return [record.getMessage() for record in caplog.records if DEPRECATION in record.getMessage()]


def test_the_new_name_sets_the_limit_without_a_warning(caplog):
    with caplog.at_level(logging.WARNING):
        assert engine_config(["--max-running-sequences", "32"]).max_running_sequences == 32
        assert engine_config([], {"TITO_MAX_RUNNING_SEQUENCES": "48"}).max_running_sequences == 48
        assert engine_config([]).max_running_sequences == DEFAULT_MAX_RUNNING_SEQUENCES
    assert deprecations(caplog) == []


@pytest.mark.parametrize(("argv", "environ"), [(["--max-running-requests", "32"], {}),
                                               ([], {"TITO_MAX_RUNNING_REQUESTS": "32"})])
def test_the_old_name_still_works_and_warns_once(argv, environ, caplog):
    with caplog.at_level(logging.WARNING):
        assert engine_config(argv, environ).max_running_sequences == 32
    assert deprecations(caplog) == [DEPRECATION]


def test_both_names_on_the_command_line_is_one_clear_error(capsys):
    with pytest.raises(SystemExit) as exit_info:
        engine_config(["--max-running-sequences", "32", "--max-running-requests", "24"])
    assert exit_info.value.code == 2
    assert "--max-running-requests: not allowed with argument --max-running-sequences" in capsys.readouterr().err


def test_both_variables_is_one_clear_error():
    with pytest.raises(ConfigError, match="TITO_MAX_RUNNING_SEQUENCES and TITO_MAX_RUNNING_REQUESTS cannot both"):
        engine_config([], {"TITO_MAX_RUNNING_SEQUENCES": "32", "TITO_MAX_RUNNING_REQUESTS": "24"})


def test_a_name_on_the_command_line_wins_over_the_other_names_variable(caplog):
    with caplog.at_level(logging.WARNING):
        assert engine_config(["--max-running-sequences", "32"],
                             {"TITO_MAX_RUNNING_REQUESTS": "24"}).max_running_sequences == 32
    assert deprecations(caplog) == []
    assert engine_config(["--max-running-requests", "24"],
                         {"TITO_MAX_RUNNING_SEQUENCES": "32"}).max_running_sequences == 24


def test_validation_names_the_new_flag_and_counts_choices():
    with pytest.raises(ConfigError, match="max_running_sequences=0 must be between 1 and 65536"):
        EngineConfig(max_running_sequences=0).validate()
    with pytest.raises(ConfigError, match="each choice is a sequence"):
        EngineConfig(max_running_sequences=4, max_choices_per_request=8).validate()


def test_the_scheduler_gets_its_settings_as_one_object():
    config = engine_config(["--max-running-sequences", "32", "--max-prefill-tokens-per-step", "512",
                            "--no-prefix-caching"])
    assert scheduler_limits(config, on_cpu=False) == SchedulerLimits(max_running_sequences=32, max_prefill_tokens=512,
                                                                     prefix_caching=False)
    assert plan_startup(EngineConfig(device="cpu")).limits == SchedulerLimits(
        max_prefill_tokens=DEFAULT_MAX_PREFILL_TOKENS_CPU)
    assert SchedulerLimits().max_prefill_tokens == DEFAULT_MAX_PREFILL_TOKENS
    assert EngineConfig.max_prefill_tokens_per_step is None  # chosen by device


def test_the_prefill_budget_defaults_by_device_and_the_flag_wins(monkeypatch):
    import torch

    def budget(config: EngineConfig) -> int:
        return plan_startup(config).limits.max_prefill_tokens

    assert budget(EngineConfig(device="cpu")) == DEFAULT_MAX_PREFILL_TOKENS_CPU == 512
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # choose_device("auto") picks CUDA
    assert budget(EngineConfig()) == DEFAULT_MAX_PREFILL_TOKENS == 2048
    assert budget(EngineConfig(device="cpu", max_prefill_tokens_per_step=96)) == 96
    with pytest.raises(ConfigError, match="max_prefill_tokens_per_step=0 must be >= 1 .*512 on CPU"):
        EngineConfig(max_prefill_tokens_per_step=0).validate()


def test_the_core_process_spec_is_built_from_the_config_whole():
    config = EngineConfig(model="tiny-qwen2", device="cpu", max_model_len=256, cpu_threads=2, encoder_cache_bytes=0,
                          exclude_padding_ids=False, max_running_sequences=8, log_level="debug")
    plan = plan_startup(config)
    spec = plan.core_spec(config)
    assert (spec.model_dir, spec.model_id, spec.device, spec.max_model_len, spec.cpu_plan.threads) == (
        str(resolve_model("tiny-qwen2")), "tiny-qwen2", "cpu", 256, 2)
    assert (spec.limits, spec.log_level, spec.encoder_cache_bytes, spec.exclude_padding_ids) == (
        plan.limits, "debug", 0, False)


def test_the_shared_encoder_store_flags_teach_their_use(tmp_path):
    from tito_engine.config import EngineConfig

    with pytest.raises(ConfigError, match="needs an encoder cache"):
        EngineConfig(encoder_store_dir=str(tmp_path), encoder_cache_bytes=0).validate()
    with pytest.raises(ConfigError, match="native backend only"):
        config = EngineConfig(encoder_store_dir=str(tmp_path), backend="vllm", exclude_padding_ids=None)
        config._validate_encoder_store()
    with pytest.raises(ConfigError, match="at least 1 MiB"):
        EngineConfig(encoder_store_dir=str(tmp_path), encoder_store_bytes=1000).validate()
    a_file = tmp_path / "file"
    a_file.write_text("x")
    with pytest.raises(ConfigError, match="is not a directory"):
        EngineConfig(encoder_store_dir=str(a_file)).validate()
    EngineConfig(encoder_store_dir=str(tmp_path / "new" / "store")).validate()  # created by the engine


def test_the_lora_flags_reach_the_core_and_refuse_what_cannot_serve(tmp_path):
    (tmp_path / "sql").mkdir()
    config = engine_config(["--model", "tiny-qwen2", "--device", "cpu", "--lora-dir", str(tmp_path), "--lora-modules",
                            "sql=sql", "chat=chat/v2", "--max-loras", "2"])
    spec = plan_startup(config).core_spec(config)
    assert (spec.lora_dir, spec.lora_modules, spec.max_loras, spec.max_lora_rank) == (
        str(tmp_path), (("sql", "sql"), ("chat", "chat/v2")), 2, 16)
    from_env = engine_config([], {"TITO_LORA_DIR": str(tmp_path), "TITO_LORA_MODULES": "a=x b=y"})
    assert from_env.lora_module_pairs() == (("a", "x"), ("b", "y"))
    for settings, message in (({"lora_modules": ("a=x",)}, "--lora-modules needs --lora-dir"),
                              ({"lora_dir": str(tmp_path), "lora_modules": ("a",)}, "must be NAME=DIR"),
                              ({"lora_dir": str(tmp_path), "lora_modules": ("a=x", "a=y")}, "names an adapter twice"),
                              ({"lora_dir": str(tmp_path / "missing")}, "is not a directory"),
                              ({"lora_dir": str(tmp_path), "max_loras": 0}, "max_loras=0 must be between 1"),
                              ({"lora_dir": str(tmp_path), "max_lora_rank": 0}, "max_lora_rank=0 must be between 1")):
        with pytest.raises(ConfigError, match=message):
            EngineConfig(**settings).validate()
