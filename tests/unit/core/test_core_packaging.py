"""Every Python package in the tree is declared in pyproject.toml, so a non-editable install
(a wheel) carries the same code the tests ran against."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


# Every top-level package lives in the folder named after it (no package-dir mapping), so the
# folder a file sits in says what imports it.
TOP_LEVEL = ("tito", "tito_render", "tito_engine", "tito_derender")


def _declared() -> set[str]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert "package-dir" not in config, "packages live in folders named after them"
    return set(config["packages"])


def test_every_package_directory_is_declared():
    packages = _declared()
    roots = {name: ROOT / name for name in TOP_LEVEL}
    found = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(root).parts
            found.add(".".join((name, *relative)))
    assert found == packages


def test_one_import_style():
    """Modules import each other by absolute name, as the other packages do."""
    relative = [
        f"{path.relative_to(ROOT)}:{number}"
        for name in TOP_LEVEL
        for path in (ROOT / name).rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if line.lstrip().startswith("from .")
    ]
    assert not relative, relative
