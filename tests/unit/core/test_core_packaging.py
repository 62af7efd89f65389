"""Every Python package in the tree is declared in pyproject.toml, so a non-editable install
(a wheel) carries the same code the tests ran against."""

import tomllib

from source_tree import PACKAGE_ROOTS, ROOT

TOP_LEVEL = tuple(PACKAGE_ROOTS)


def _config() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]


def test_every_package_directory_is_declared():
    packages = set(_config()["packages"])
    found = set()
    for name, root in PACKAGE_ROOTS.items():
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
        for path in PACKAGE_ROOTS[name].rglob("*.py")
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if line.lstrip().startswith("from .")
    ]
    assert not relative, relative


def test_each_top_level_package_is_mapped_to_its_folder():
    """The wheel takes each package from the folder the tree keeps it in (services/, clients/, ...)."""
    mapping = _config().get("package-dir", {})
    for name, root in PACKAGE_ROOTS.items():
        assert ROOT / mapping.get(name, name) == root, name
