"""Every `tito serve` flag can also come from an environment variable.

The variable of `--max-model-len` is `TITO_MAX_MODEL_LEN`: the first long option, without its
dashes, upper-cased, `-` turned into `_`, after `TITO_`. The rules:

- a flag given on the command line wins over its variable;
- an empty variable counts as unset;
- on/off flags take 1/true/yes/on or 0/false/no/off (any case);
- a value is converted and checked exactly like the flag's (type, choices) before the typed
  config validates it; a bad one is a `ConfigError` naming the variable;
- a variable of a flag the service does not have is ignored, so one environment can serve
  several services (`tito serve all` passes its environment on to the three it starts).

The environment is read when a command line is parsed (`apply_env`), never at import time.
"""

from __future__ import annotations

import argparse
from collections.abc import Iterable, Mapping, Sequence

from tito.errors import ConfigError

ENV_PREFIX = "TITO_"
_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}


def variable_of(flag: str) -> str:
    """The TITO_* variable of a long flag: `--max-model-len` is `TITO_MAX_MODEL_LEN`."""
    return ENV_PREFIX + flag[2:].upper().replace("-", "_")


def env_name(action: argparse.Action) -> str | None:
    """The variable of an optional argument (None for positionals and --help)."""
    longs = [option for option in action.option_strings if option.startswith("--")]
    if not longs or isinstance(action, (argparse._HelpAction, argparse._VersionAction)):
        return None
    return variable_of(longs[0])


def _settable(parser: argparse.ArgumentParser) -> Iterable[tuple[argparse.Action, str]]:
    for action in parser._actions:
        name = env_name(action)
        if name is not None:
            yield action, name


def env_variables(parser: argparse.ArgumentParser) -> dict[str, str]:
    """{variable: flag} for every flag of `parser` that a variable can set."""
    return {name: action.option_strings[0] for action, name in _settable(parser)}


# The newline keeps the line short where a parser shows its description raw (the engine's).
ENV_HELP = ("Every flag can also be set by the environment variable shown beside it, e.g. TITO_MODEL;\n"
            "a flag on the command line wins (docs/deploy.md).")


def document_env(parser: argparse.ArgumentParser) -> None:
    """Append each flag's variable to its --help line, and say so in the description."""
    parser.description = f"{parser.description}\n\n{ENV_HELP}" if parser.description else ENV_HELP
    for action, name in _settable(parser):
        note = f"[env {name}]"
        action.help = f"{action.help} {note}" if action.help else note


def flags_given(parser: argparse.ArgumentParser, leaf: argparse.ArgumentParser, argv: Sequence[str]) -> set[str]:
    """The `dest`s of `leaf`'s flags that `argv` sets (parsed again with every default suppressed,
    so what is left in the namespace is exactly what the command line said)."""
    saved = [(action, action.default) for action in leaf._actions]
    try:
        for action in leaf._actions:
            action.default = argparse.SUPPRESS
        return set(vars(parser.parse_args(list(argv))))
    finally:
        for action, default in saved:
            action.default = default


def parse_env_value(action: argparse.Action, name: str, raw: str):
    """`raw` converted like the flag's own value; ConfigError naming `name` when it is not one."""
    if action.nargs == 0:  # on/off flags: store_true/false, --x/--no-x
        word = raw.strip().lower()
        if word not in _TRUE | _FALSE:
            raise ConfigError(f"{name}={raw!r}: use 1/true/yes/on or 0/false/no/off ({action.option_strings[0]})")
        on = word in _TRUE
        if isinstance(action, argparse._StoreConstAction) and not isinstance(action, argparse.BooleanOptionalAction):
            return action.const if on else action.default
        return on
    if action.nargs in ("*", "+"):  # several values: separated by spaces
        return [parse_env_value_one(action, name, word) for word in raw.split()]
    return parse_env_value_one(action, name, raw)


def parse_env_value_one(action: argparse.Action, name: str, raw: str):
    """One value of a flag's, converted and checked like the flag's own."""
    value = raw
    if action.type is not None:
        try:
            value = action.type(raw)
        except (TypeError, ValueError, argparse.ArgumentTypeError):
            kind = getattr(action.type, "__name__", "value")
            raise ConfigError(f"{name}={raw!r} is not a valid {kind} (it sets {action.option_strings[0]})") from None
    if action.choices is not None and value not in action.choices:
        choices = ", ".join(str(choice) for choice in action.choices)
        raise ConfigError(f"{name}={raw!r}: must be one of {choices} (it sets {action.option_strings[0]})")
    return value


def apply_env(parser: argparse.ArgumentParser, leaf: argparse.ArgumentParser, argv: Sequence[str],
              args: argparse.Namespace, environ: Mapping[str, str]) -> list[str]:
    """Set on `args` the flags of `leaf` (the subcommand's parser) that `environ` gives and the
    command line does not; returns the variables used. `parser` parsed `argv` into `args`."""
    given = flags_given(parser, leaf, argv)
    taken: dict[int, str] = {}  # mutually exclusive group (by id) -> the variable that set one of it
    groups = {id(action): group for group in leaf._mutually_exclusive_groups for action in group._group_actions}
    used = []
    for action, name in _settable(leaf):
        raw = environ.get(name, "")
        if not raw or action.dest in given:
            continue
        group = groups.get(id(action))
        if group is not None:
            if any(other.dest in given for other in group._group_actions):
                continue  # the command line chose another member of the group
            if id(group) in taken:
                raise ConfigError(f"{taken[id(group)]} and {name} cannot both be set (their flags exclude each other)")
            taken[id(group)] = name
        setattr(args, action.dest, parse_env_value(action, name, raw))
        used.append(name)
    return used
