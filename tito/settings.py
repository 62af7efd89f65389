"""One declaration per setting: a config dataclass field says its flag, help and default once.

A service's typed config (a `ServerConfig` subclass) declares each field with `setting(...)`:

    max_model_len: int | None = setting(None, type=int, help="per-request context limit",
                                        default_text="the model's max_position_embeddings")

From that one declaration come the argparse flag (`--max-model-len`), its `--help` line with the
default, the `TITO_MAX_MODEL_LEN` variable (tito.env_flags reads it from the parser), and the
field's value in `config_from_args`. Validation stays in the config's `validate()`.

Rules the generator applies, so declarations stay short:

- the flag is `--` + the field name with `_` as `-`, unless `flag=` names another;
- a bool field defaulting to False is an on-switch (`--x`); one defaulting to True or None gets
  `--x/--no-x`;
- the help line ends with the default: `default_text` when given, else the value itself (on/off
  for switches); a None or empty default shows nothing unless `default_text` says what it means;
- `group` puts the flag under a titled section of `--help`; fields sharing an `exclusive` name
  form a mutually exclusive group;
- `deprecated_flag` also accepts an old name (exclusive with the new one), for `config_from_args`
  to take with a one-line warning.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from tito.env_flags import variable_of

log = logging.getLogger(__name__)

#: The dataclass field metadata key that holds a field's `Setting`.
SETTING = "tito.setting"
#: Where the deprecated form of a flag lands in the argparse namespace: `_deprecated_<field>`.
DEPRECATED_PREFIX = "_deprecated_"


@dataclass(frozen=True)
class Setting:
    """How one config field appears on the command line (see the module docstring)."""

    help: str
    flag: str | None = None
    type: Callable[[str], Any] | None = None
    choices: tuple | None = None
    group: str | None = None
    exclusive: str | None = None
    default_text: str | None = None
    metavar: str | None = None
    #: Common to every service: `tito_cli.main.add_common_arguments` adds it, the service's own
    #: `add_arguments` does not.
    common: bool = False
    deprecated_flag: str | None = None
    #: argparse's nargs for a flag that takes several values (e.g. "*"); its TITO_* variable
    #: then holds them separated by spaces.
    nargs: str | None = None


def setting(default: Any, *, help: str, **options: Any) -> Any:  # noqa: A002 - argparse's word
    """A dataclass field with `default` whose flag is described by `Setting(help, **options)`."""
    return dataclasses.field(default=default, metadata={SETTING: Setting(help=help, **options)})


@dataclass(frozen=True)
class Declared:
    """A config field that has a flag: its name, default and `Setting`."""

    name: str
    default: Any
    setting: Setting

    @property
    def flag(self) -> str:
        return self.setting.flag or "--" + self.name.replace("_", "-")

    @property
    def is_switch(self) -> bool:
        return isinstance(self.default, bool) or (self.default is None and self.setting.type is bool)

    @property
    def flags(self) -> str:
        """How --help names it: `--x`, or `--x / --no-x` for a switch that defaults to on."""
        if self.is_switch and self.default is not False:
            return f"{self.flag} / --no-{self.flag[2:]}"
        return self.flag

    def default_shown(self, default: Any) -> str | None:
        """The default as --help and the READMEs show it; None when there is nothing to show."""
        if self.setting.default_text is not None:
            return self.setting.default_text
        if self.is_switch:
            return "on" if default else "off" if default is False else None
        return None if default in (None, "") else str(default)

    def help_line(self, default: Any) -> str:
        """The help text followed by the default (escaped for argparse's %-formatting)."""
        shown = self.default_shown(default)
        text = self.setting.help if shown is None else f"{self.setting.help} (default: {shown})"
        return text.replace("%", "%%")


def declared(config_cls: type) -> Iterator[Declared]:
    """The fields of `config_cls` that have a flag, in declaration order."""
    for field in dataclasses.fields(config_cls):
        found = field.metadata.get(SETTING)
        if found is not None:
            yield Declared(field.name, field.default, found)


def add_settings(parser: argparse.ArgumentParser, config_cls: type, *, common: bool,
                 defaults: Mapping[str, Any] | None = None) -> None:
    """Add the flags of `config_cls`'s fields whose `Setting.common` is `common`; `defaults`
    overrides a field's command-line default by name (e.g. each service's own address)."""
    groups: dict[str, Any] = {}
    exclusive: dict[str, Any] = {}
    for item in declared(config_cls):
        if item.setting.common != common:
            continue
        default = (defaults or {}).get(item.name, item.default)
        where = parser
        if item.setting.group is not None:
            if item.setting.group not in groups:
                groups[item.setting.group] = parser.add_argument_group(item.setting.group)
            where = groups[item.setting.group]
        if item.setting.exclusive is not None or item.setting.deprecated_flag is not None:
            key = item.setting.exclusive or item.name
            if key not in exclusive:
                exclusive[key] = where.add_mutually_exclusive_group()
            where = exclusive[key]
        where.add_argument(item.flag, dest=item.name, default=default, help=item.help_line(default),
                           **_argparse_options(item))
        if item.setting.deprecated_flag is not None:
            options = {"metavar": item.name.upper(), **_argparse_options(item)}
            where.add_argument(item.setting.deprecated_flag, dest=DEPRECATED_PREFIX + item.name, default=None,
                               help=f"deprecated name of {item.flag}", **options)


def _argparse_options(item: Declared) -> dict[str, Any]:
    if item.is_switch:
        if item.default is False:
            return {"action": "store_true"}
        return {"action": argparse.BooleanOptionalAction}
    options: dict[str, Any] = {}
    kind = item.setting.type or (type(item.default) if item.default is not None else None)
    if kind is not None and kind is not str:
        options["type"] = kind
    if item.setting.choices is not None:
        options["choices"] = item.setting.choices
    if item.setting.metavar is not None:
        options["metavar"] = item.setting.metavar
    if item.setting.nargs is not None:
        options["nargs"] = item.setting.nargs
    return options



def config_from_args(config_cls: type, args: argparse.Namespace, **fields: Any) -> Any:
    """`config_cls` built from a parsed command line: every field with a flag from `args` (its
    default when `args` lacks it), plus `fields` for those the command line does not give."""
    values: dict[str, Any] = {}
    for item in declared(config_cls):
        values[item.name] = getattr(args, item.name, item.default)
        old = getattr(args, DEPRECATED_PREFIX + item.name, None)
        if old is not None:
            old_flag = item.setting.deprecated_flag
            log.warning("%s (%s) is deprecated: use %s (%s), same meaning", old_flag, variable_of(old_flag),
                        item.flag, variable_of(item.flag))
            values[item.name] = old
    values.update(fields)
    return config_cls(**values)
