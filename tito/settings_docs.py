"""Flag tables in the READMEs, generated from the config declarations (tito.settings).

A document marks where a table goes:

    <!-- flags: tito_engine.config.EngineConfig -->
    ...generated table...
    <!-- /flags -->

`own` (the default) lists the service's own flags; `common` lists those every service shares.
`scripts/flag_tables.py` rewrites the tables; a unit test fails when one is out of date.
"""

from __future__ import annotations

import importlib
import re

from tito.env_flags import variable_of
from tito.settings import declared

#: The documents with flag tables, relative to the repository root.
DOCUMENTS = ("services/engine/README.md", "services/render/README.md", "services/derender/README.md",
             "services/gateway/README.md", "docs/deploy.md")
_TABLE = re.compile(r"(<!-- flags: ([\w.]+)(?: (own|common))? -->\n)(.*?)(<!-- /flags -->)", re.S)


def markdown_table(config_cls: type, common: bool) -> str:
    """| flag | variable | default | meaning | for the flags of `config_cls` (own or common)."""
    lines = ["| flag | variable | default | meaning |", "|---|---|---|---|"]
    for item in declared(config_cls):
        if item.setting.common != common:
            continue
        flag = f"`{item.flags}`".replace(" / ", "` / `")
        variable = f"`{variable_of(item.flag)}`"
        if item.setting.deprecated_flag:
            flag += f" (formerly `{item.setting.deprecated_flag}`, still accepted)"
            variable += f" (formerly `{variable_of(item.setting.deprecated_flag)}`)"
        shown = item.default_shown(item.default)
        default = "-" if shown is None else shown
        meaning = item.setting.help.replace("|", "\\|")
        lines.append(f"| {flag} | {variable} | {default} | {meaning} |")
    return "\n".join(lines) + "\n"


def _config_class(dotted: str) -> type:
    module, _, name = dotted.rpartition(".")
    return getattr(importlib.import_module(module), name)


def render_tables(text: str) -> str:
    """`text` with every marked flag table regenerated."""
    def table(match: re.Match) -> str:
        config_cls = _config_class(match.group(2))
        return match.group(1) + markdown_table(config_cls, match.group(3) == "common") + match.group(5)

    return _TABLE.sub(table, text)
