"""Every error reason the code can raise is listed in the contract's ErrorReason enum.

The scan reads the source: `reason=` arguments (string literals, or module-level constants
holding one), `reason` parameter defaults, and the second argument of the `...ValueError`
classes that carry a reason until a service turns them into a TitoError. tests/conftest.py also
records every reason actually raised during the run and fails the session on one that is not
listed, for reasons computed at run time."""

from __future__ import annotations

import ast
from pathlib import Path

from source_tree import PACKAGE_ROOTS, ROOT
from tito.contract import ERROR_REASONS


def _sources() -> dict[Path, ast.Module]:
    return {path: ast.parse(path.read_text())
            for root in PACKAGE_ROOTS.values() for path in root.rglob("*.py")
            if "v1" not in path.relative_to(ROOT).parts}


def _string_constants(trees: dict[Path, ast.Module]) -> dict[str, str]:
    constants = {}
    for tree in trees.values():
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) \
                    and isinstance(node.value.value, str):
                constants.update({target.id: node.value.value for target in node.targets
                                  if isinstance(target, ast.Name)})
    return constants


def _reason_values(node: ast.expr, constants: dict[str, str]) -> list[str]:
    if isinstance(node, ast.IfExp):  # reason="A" if ... else "B"
        return _reason_values(node.body, constants) + _reason_values(node.orelse, constants)
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [node.value]
    name = node.id if isinstance(node, ast.Name) else node.attr if isinstance(node, ast.Attribute) else None
    return [constants[name]] if name in constants else []


def raised_reasons() -> dict[str, str]:
    """reason -> first place in the source that raises it."""
    trees = _sources()
    constants = _string_constants(trees)
    found: dict[str, str] = {}
    for path, tree in trees.items():
        where = str(path.relative_to(ROOT))
        for node in ast.walk(tree):
            candidates: list[ast.expr] = []
            if isinstance(node, ast.Call):
                candidates += [keyword.value for keyword in node.keywords if keyword.arg == "reason"]
                callee = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", "")
                if callee.endswith("ValueError") and len(node.args) >= 2:
                    candidates.append(node.args[1])
            elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                arguments = node.args.args + node.args.kwonlyargs
                defaults = [None] * (len(node.args.args) - len(node.args.defaults)) \
                    + list(node.args.defaults) + list(node.args.kw_defaults)
                candidates += [default for argument, default in zip(arguments, defaults)
                               if argument.arg == "reason" and default is not None]
            for candidate in candidates:
                for reason in _reason_values(candidate, constants):
                    if reason.isupper():
                        found.setdefault(reason, f"{where}:{node.lineno}")
    return found


def test_the_scan_sees_the_reasons_it_should():
    reasons = raised_reasons()
    # One of each way a reason is written: a literal, a constant, a parameter default, a
    # ValueError's positional reason.
    assert {"PROMPT_TOO_LONG", "MALFORMED_REQUEST", "INVALID_REQUEST", "STRUCT_TOO_DEEP"} <= reasons.keys()
    assert len(reasons) >= 80


def test_every_raised_reason_is_in_the_contract():
    missing = {reason: where for reason, where in raised_reasons().items() if reason not in ERROR_REASONS}
    assert not missing, f"add these to enum ErrorReason in proto/tito/v1/errors.proto: {missing}"

