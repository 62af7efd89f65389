"""Each service's flags, --help lines, TITO_* variables and config come from one declaration."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from tito import settings

from tito_cli import main as cli
from tito.config import ServerConfig
from tito.env_flags import env_variables
from tito.env_flags import variable_of
from tito.settings import DEPRECATED_PREFIX, declared
from tito.settings_docs import DOCUMENTS, render_tables

ROOT = Path(__file__).resolve().parents[3]


def service_parser(service: str):
    parser = cli.build_parser()
    return parser, cli.serve_parser(parser, service)


def config_class(service: str) -> type:
    return cli._service_module(service).CONFIG


def help_text(service: str, capsys) -> str:
    parser, _ = service_parser(service)
    with pytest.raises(SystemExit):
        parser.parse_args(["serve", service, "--help"])
    return " ".join(capsys.readouterr().out.split())  # argparse wraps lines anywhere


@pytest.mark.parametrize("service", cli.SERVICES)
def test_every_declared_field_is_a_flag_with_its_variable_and_default_in_help(service, capsys):
    text = help_text(service, capsys)
    _, leaf = service_parser(service)
    variables = env_variables(leaf)
    items = list(declared(config_class(service)))
    assert {"address", "model", "log_level"} <= {item.name for item in items}
    for item in items:
        name = variable_of(item.flag)
        assert variables.get(name) == item.flag, item.name
        assert f"{item.flag} " in text and f"[env {name}]" in text, item.name
        shown = item.default_shown(cli.DEFAULT_ADDRESSES[service] if item.name == "address" else item.default)
        if shown is not None:
            assert f"(default: {' '.join(shown.split())}) [env {name}]" in text, item.name


@pytest.mark.parametrize("service", cli.SERVICES)
def test_the_parser_has_no_flag_the_config_does_not_declare(service):
    _, leaf = service_parser(service)
    fields = {field.name for field in dataclasses.fields(config_class(service))}
    dests = {action.dest for action in leaf._actions if action.option_strings and action.dest != "help"}
    undeclared = {dest for dest in dests - fields if not dest.startswith(DEPRECATED_PREFIX)}
    # --device: one command line for all three services; only the engine's config has a use for it.
    assert undeclared == (set() if service == "engine" else {"device"})


@pytest.mark.parametrize("service", cli.SERVICES)
def test_an_empty_command_line_gives_the_declared_defaults(service):
    parser, _ = service_parser(service)
    args = parser.parse_args(["serve", service])
    config = cli._service_module(service).config_from_args(args)
    expected = dataclasses.replace(config_class(service)(), address=cli.DEFAULT_ADDRESSES[service])
    assert config == expected


@pytest.mark.parametrize("service", cli.SERVICES)
def test_each_flag_reaches_its_field(service):
    """A value given for every flag lands in the field of the same declaration."""
    parser, _ = service_parser(service)
    argv, expected = ["serve", service], {}
    for item in declared(config_class(service)):
        if item.is_switch:
            argv.append(f"--no-{item.flag[2:]}" if item.default is not False else item.flag)
            expected[item.name] = item.default is False
        elif item.setting.choices:
            argv += [item.flag, str(item.setting.choices[-1])]
            expected[item.name] = item.setting.choices[-1]
        elif item.setting.exclusive is None and (item.setting.type or type(item.default)) in (int, float):
            value = (item.setting.type or type(item.default))(7)
            argv += [item.flag, str(value)]
            expected[item.name] = value
    args = parser.parse_args(argv)
    config = settings.config_from_args(config_class(service), args)
    assert {name: getattr(config, name) for name in expected} == expected


def test_common_flags_are_the_server_config_and_each_service_adds_only_its_own():
    common = {item.name for item in declared(ServerConfig)}
    assert all(item.setting.common for item in declared(ServerConfig))
    for service in cli.SERVICES:
        own = {item.name for item in declared(config_class(service)) if not item.setting.common}
        assert not own & common


@pytest.mark.parametrize("document", DOCUMENTS)
def test_readme_flag_tables_match_the_declarations(document):
    text = (ROOT / document).read_text()
    assert "<!-- flags: " in text
    assert render_tables(text) == text, f"run python scripts/flag_tables.py to update {document}"
