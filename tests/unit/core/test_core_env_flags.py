"""Every `tito serve` flag from a TITO_* variable: naming, precedence, conversion, errors, --help."""

from __future__ import annotations

import pytest

from tito_cli import main as cli
from tito.config import ConfigError
from tito.env_flags import apply_env, env_variables

SERVE_FORMS = (*cli.SERVICES, "all")


def parse(argv: list[str], environ: dict[str, str]):
    parser = cli.build_parser()
    args = parser.parse_args(argv)
    used = apply_env(parser, cli.serve_parser(parser, args.service), argv, args, environ)
    return args, used


def test_a_variable_sets_its_flag_converted_like_the_flag():
    args, used = parse(["serve", "engine"], {"TITO_MAX_MODEL_LEN": "4096", "TITO_MODEL": "/models/m",
                                              "TITO_GRACE_SECONDS": "2.5", "TITO_BACKEND": "vllm"})
    assert (args.max_model_len, args.model, args.grace_seconds, args.backend) == (4096, "/models/m", 2.5, "vllm")
    assert sorted(used) == ["TITO_BACKEND", "TITO_GRACE_SECONDS", "TITO_MAX_MODEL_LEN", "TITO_MODEL"]


def test_the_command_line_wins_over_the_environment():
    args, used = parse(["serve", "engine", "--max-model-len", "64", "--no-engine-process"],
                       {"TITO_MAX_MODEL_LEN": "4096", "TITO_ENGINE_PROCESS": "true"})
    assert (args.max_model_len, args.engine_process, used) == (64, False, [])


@pytest.mark.parametrize(("raw", "expected"), [("1", True), ("TRUE", True), ("on", True), ("yes", True),
                                               ("0", False), ("false", False), ("Off", False), ("no", False)])
def test_on_off_flags_take_the_usual_words(raw, expected):
    args, _ = parse(["serve", "engine"], {"TITO_REQUIRE_SIGNED_FEATURES": raw, "TITO_PREFIX_CACHING": raw})
    assert args.require_signed_features is expected and args.prefix_caching is expected


def test_an_empty_variable_counts_as_unset_and_foreign_ones_are_ignored():
    args, used = parse(["serve", "derender"], {"TITO_MAX_MODEL_LEN": "12", "TITO_ADDRESS": "",
                                                "TITO_CACHE_DIR": "/tmp/x"})
    assert used == [] and args.address == cli.DEFAULT_ADDRESSES["derender"]


@pytest.mark.parametrize(("environ", "message"), [
    ({"TITO_MAX_MODEL_LEN": "lots"}, "TITO_MAX_MODEL_LEN='lots' is not a valid int (it sets --max-model-len)"),
    ({"TITO_BACKEND": "tgi"}, "TITO_BACKEND='tgi': must be one of native, vllm"),
    ({"TITO_ENGINE_PROCESS": "maybe"}, "TITO_ENGINE_PROCESS='maybe': use 1/true/yes/on or 0/false/no/off"),
    ({"TITO_KV_BLOCKS": "8", "TITO_KV_CACHE_BYTES": "9"}, "TITO_KV_BLOCKS and TITO_KV_CACHE_BYTES cannot both"),
])
def test_a_bad_value_names_its_variable(environ, message):
    with pytest.raises(ConfigError) as info:
        parse(["serve", "engine"], environ)
    assert message in str(info.value)


def test_a_flag_on_the_command_line_beats_a_variable_of_an_exclusive_sibling():
    args, used = parse(["serve", "engine", "--kv-cache-bytes", "1048576"], {"TITO_KV_BLOCKS": "8"})
    assert (args.kv_cache_bytes, args.kv_blocks, used) == (1048576, None, [])


def test_serve_all_takes_its_own_flags_from_the_environment():
    args, _ = parse(["serve", "all"], {"TITO_ENGINE_ADDRESS": "unix:/run/e.sock", "TITO_LOG_LEVEL": "debug"})
    assert (args.engine_address, args.log_level) == ("unix:/run/e.sock", "debug")


@pytest.mark.parametrize("form", SERVE_FORMS)
def test_help_names_the_variable_of_every_flag(form, capsys):
    parser = cli.build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", form, "--help"])
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere
    variables = env_variables(cli.serve_parser(parser, form))
    assert "TITO_MODEL" in variables and "TITO_LOG_LEVEL" in variables
    for name in variables:
        assert f"[env {name}]" in text, name


def test_tito_main_answers_a_bad_variable_with_one_line_and_status_2(monkeypatch, capsys):
    monkeypatch.setenv("TITO_MAX_MODEL_LEN", "many")
    assert cli.main(["serve", "engine", "--address", "127.0.0.1:0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == "tito serve engine: TITO_MAX_MODEL_LEN='many' is not a valid int (it sets --max-model-len)"


def test_the_typed_config_still_validates_values_from_the_environment(monkeypatch, capsys):
    monkeypatch.setenv("TITO_ADDRESS", "nowhere")
    assert cli.main(["serve", "derender"]) == 2
    assert "address 'nowhere' is not valid" in capsys.readouterr().err
