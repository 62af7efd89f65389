"""Module docstrings name files and modules that exist.

A docstring that still names a module after it moved or was renamed sends its reader looking for
a file that is gone. Two kinds of reference can be checked without guessing: a Python file named
by its file name or path (`admission.py`, `multimodal/encoder_store.py`), and a dotted name rooted
at one of tito's own packages (`tito_models.tiny.ensure_model`). A short dotted name such as
`engine.Engine` is not checked: it cannot be told from a library's name (`torch.Tensor`).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from source_tree import PACKAGE_ROOTS, ROOT

#: Where the project's Python files are: the packages, and the benchmarks, scripts and tests.
SOURCE_DIRS = tuple(PACKAGE_ROOTS.values()) + (ROOT / "bench", ROOT / "scripts", ROOT / "tests")

#: Python files a docstring names that are not in this tree, each with where it lives.
OUTSIDE_THE_TREE = {
    "_tito_torchvision_cpu.py": "written into site-packages by tito/torchvision_cpu.py",
    "vllm/distributed/kv_events.py": "vLLM's own module",
    "vllm/entrypoints/scale_out/token_in_token_out/protocol.py": "vLLM's own module",
    "tests/tool_parsers/test_qwen3coder_tool_parser.py": "vLLM's own tests, ported as data",
    "test_kimi_k2_tool_parser.py": "vLLM's own tests, ported as data",
    "test_glm4_moe_tool_parser.py": "vLLM's own tests, ported as data",
}

PY_FILE = re.compile(r"(?<![\w./-])([\w./-]*\w\.py)\b")
TITO_NAME = re.compile(r"\b((?:%s)(?:\.\w+)+)" % "|".join(sorted(PACKAGE_ROOTS, key=len, reverse=True)))


def python_files() -> list[Path]:
    return sorted(path for directory in SOURCE_DIRS for path in directory.rglob("*.py"))


def module_docstring(path: Path) -> str:
    return ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or ""


def top_level_names(module: Path) -> set[str]:
    """What `module` defines or imports at its top level, inside `if` and `try` blocks too."""
    names: set[str] = set()
    statements = list(ast.parse(module.read_text(encoding="utf-8")).body)
    while statements:
        node = statements.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((alias.asname or alias.name).split(".")[0] for alias in node.names)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names.update(name.id for target in targets for name in ast.walk(target) if isinstance(name, ast.Name))
        elif isinstance(node, (ast.If, ast.Try)):
            statements += node.body + node.orelse + getattr(node, "finalbody", [])
            statements += [line for handler in getattr(node, "handlers", []) for line in handler.body]
    return names


def resolves(dotted: str) -> bool:
    """Whether `dotted` (rooted at a tito package) is a module, a package, or a name one defines."""
    package, *parts = dotted.split(".")
    path = PACKAGE_ROOTS[package]
    for index, part in enumerate(parts):
        if (path / part).is_dir():
            path = path / part
        elif (path / f"{part}.py").is_file():
            return index + 1 == len(parts) or parts[index + 1] in top_level_names(path / f"{part}.py")
        else:
            return part in top_level_names(path / "__init__.py")
    return True


def test_python_files_named_in_module_docstrings_exist():
    files = python_files()
    names = {path.name for path in files}
    paths = {path.relative_to(ROOT).as_posix() for path in files}
    missing = []
    for path in files:
        for reference in PY_FILE.findall(module_docstring(path)):
            found = reference in names if "/" not in reference else \
                any(tree_path == reference or tree_path.endswith("/" + reference) for tree_path in paths)
            if not found and reference not in OUTSIDE_THE_TREE:
                missing.append(f"{path.relative_to(ROOT)}: {reference}")
    assert missing == []


def test_tito_names_in_module_docstrings_resolve():
    missing = []
    for path in python_files():
        for dotted in TITO_NAME.findall(module_docstring(path)):
            # tito.v1 is also the contract's proto package: `tito.v1.Tensor` names a message.
            if not dotted.startswith("tito.v1.") and not resolves(dotted):
                missing.append(f"{path.relative_to(ROOT)}: {dotted}")
    assert missing == []
