"""Every Python package in the tree is declared in pyproject.toml, so a non-editable install
(a wheel) carries the same code the tests ran against."""

import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def _declared() -> tuple[set[str], dict[str, str]]:
    config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
    return set(config["packages"]), config["package-dir"]


def test_every_package_directory_is_declared():
    packages, package_dir = _declared()
    roots = {"tito": ROOT / "tito", **{name: ROOT / path for name, path in package_dir.items()}}
    found = set()
    for name, root in roots.items():
        for init in root.rglob("__init__.py"):
            if "__pycache__" in init.parts:
                continue
            relative = init.parent.relative_to(root).parts
            found.add(".".join((name, *relative)))
    assert found == packages
