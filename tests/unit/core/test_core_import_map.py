"""The tree's import map: which package may import which, no cycles, and the engine's layers.

Every `import` of the project's own modules counts, at module level or inside a function (a
function-level import still ties the two modules together; hiding a cycle behind one is the
thing this test exists to catch). Imports under `if TYPE_CHECKING:` are annotations only and do
not count.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from source_tree import PACKAGE_ROOTS

#: Which top-level packages each one may import (besides itself). The runtime is the ground floor;
#: a service never imports another service, the client or the command; the command sits on top.
ALLOWED = {
    "tito": set(),
    "tito_models": {"tito"},
    "tito_render": {"tito", "tito_models"},
    "tito_engine": {"tito", "tito_models"},
    "tito_derender": {"tito", "tito_models"},
    "tito_client": {"tito"},
    # The gateway is the reference router: an HTTP layer over the client, never over a service.
    "tito_gateway": {"tito", "tito_client"},
    "tito_cli": set(PACKAGE_ROOTS),
}

#: The engine's layers, top first (services/engine/README.md, "Layers"): a module may import its own
#: layer and the layers below it. The backend interface is the port both backends plug into and
#: both protocol faces (service, smg) call.
ENGINE_LAYERS = (
    ("entry", ("tito_engine.server", "tito_engine.startup_plan", "tito_engine.config")),
    ("backends", ("tito_engine.core", "tito_engine.vllm")),
    ("service", ("tito_engine.service", "tito_engine.smg")),
    ("backend interface", ("tito_engine.backend",)),
    ("model execution", ("tito_engine.model",)),
    ("model identity", ("tito_engine.model_info",)),
    ("multimodal", ("tito_engine.multimodal",)),
    ("scheduling", ("tito_engine.scheduling",)),
    ("shared types", ("tito_engine.request", "tito_engine.limits", "tito_engine")),
)

#: The services whose domain never sees a message, and their wire edge: the only modules of theirs
#: (server, servicer, conversion) that may import generated stubs, protobuf or grpc. Below the edge
#: the domain works on plain values, so a second protocol face adds a converter, never a path.
WIRE_EDGES = {
    "tito_render": ("tito_render.server", "tito_render.servicer", "tito_render.convert"),
    "tito_derender": ("tito_derender.server", "tito_derender.servicer", "tito_derender.convert"),
}
#: What only the wire edge imports (SMG's generated stubs included: the engine's second face).
WIRE_PACKAGES = ("tito.v1", "google.protobuf", "google.rpc", "grpc", "grpc_status", "grpc_health", "grpc_reflection",
                 "smg_grpc_proto")
#: The engine's packages below its two protocol faces (`service/`, `smg/`) that never see a
#: message: the backend interface both faces call, both backends, and the domain they share.
#: (`multimodal/` still names the contract's enum numbers, so it is not listed yet.)
ENGINE_WIRE_FREE = ("tito_engine.backend", "tito_engine.core", "tito_engine.vllm", "tito_engine.scheduling",
                    "tito_engine.model", "tito_engine.request", "tito_engine.limits", "tito_engine.kv_events",
                    "tito_engine.kv_publisher", "tito_engine.model_info")

#: Layers that must not import torch (or anything that needs it), so either side of a seam can use them.
TORCH_FREE = ("tito_engine.scheduling", "tito_engine.request", "tito_engine.limits", "tito_engine.model_info",
              "tito_engine.multimodal.specs", "tito_engine.multimodal.domain")


def _module_name(package: str, root: Path, path: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join((package, *parts))


def _is_type_checking(node: ast.If) -> bool:
    test = node.test
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def _imports(tree: ast.Module, module: str, is_package: bool, module_level: bool = False) -> set[str]:
    """The absolute names `tree` imports (for `from X import y`: X.y when that is a module, else X);
    `module_level`: only what importing the module runs (not imports inside functions)."""
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        if module_level and isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            return
        if isinstance(node, ast.If) and _is_type_checking(node):
            for child in node.orelse:
                visit(child)
            return
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module if is_package else module.rpartition(".")[0]
                for _ in range(node.level - 1):
                    package = package.rpartition(".")[0]
                base = f"{package}.{base}" if base else package
            found.add(base)
            found.update(f"{base}.{alias.name}" for alias in node.names)
        for child in ast.iter_child_nodes(node):
            visit(child)

    visit(tree)
    return found


def _sources() -> dict[str, tuple[ast.Module, bool]]:
    sources: dict[str, tuple[ast.Module, bool]] = {}
    for package, root in PACKAGE_ROOTS.items():
        for path in root.rglob("*.py"):
            if "__pycache__" in path.parts or "v1" in path.relative_to(root).parts:
                continue
            sources[_module_name(package, root, path)] = (ast.parse(path.read_text()), path.name == "__init__.py")
    return sources


SOURCES = _sources()


def _graph(module_level: bool = False) -> dict[str, set[str]]:
    return {module: {name for name in _imports(tree, module, is_package, module_level)
                     if name in SOURCES and name != module}
            for module, (tree, is_package) in SOURCES.items()}


GRAPH = _graph()


def _top(module: str) -> str:
    return module.split(".")[0]


def test_packages_import_only_what_sits_below_them():
    wrong = sorted(f"{module} imports {target}" for module, targets in GRAPH.items() for target in targets
                   if _top(target) != _top(module) and _top(target) not in ALLOWED[_top(module)])
    assert not wrong, wrong


def test_no_import_cycles():
    """Tarjan's strongly connected components over the whole tree: every component is one module."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def connect(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for target in GRAPH[node]:
            if target not in index:
                connect(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for node in sorted(GRAPH):
        if node not in index:
            connect(node)
    # A package's __init__ importing its own submodule is not a cycle of two concerns: ignore it.
    cycles = [c for c in cycles if not (len(c) == 2 and c[1].startswith(c[0] + "."))]
    assert not cycles, cycles


def _engine_layer(module: str) -> int:
    best = None
    for rank, (_, prefixes) in enumerate(ENGINE_LAYERS):
        for prefix in prefixes:
            if module == prefix or module.startswith(prefix + "."):
                if best is None or len(prefix) > best[1]:
                    best = (rank, len(prefix))
    assert best is not None, module
    return best[0]


def test_engine_layers_import_only_downwards():
    upward = []
    for module, targets in GRAPH.items():
        if _top(module) != "tito_engine":
            continue
        for target in targets:
            if _top(target) == "tito_engine" and _engine_layer(target) < _engine_layer(module):
                upward.append(f"{module} ({ENGINE_LAYERS[_engine_layer(module)][0]}) imports {target} "
                              f"({ENGINE_LAYERS[_engine_layer(target)][0]})")
    assert not upward, sorted(upward)


@pytest.mark.parametrize("prefix", TORCH_FREE)
def test_torch_free_layers_reach_no_torch_module(prefix):
    """Importing these modules imports no module of the tree that imports torch when imported
    (a function that imports torch lazily, as tito.tensors.to_torch does, is not reached)."""
    torch_modules = {module for module, (tree, is_package) in SOURCES.items()
                     if any(name == "torch" or name.startswith("torch.")
                            for name in _imports(tree, module, is_package, module_level=True))}
    loaded = _graph(module_level=True)
    start = [module for module in loaded if module == prefix or module.startswith(prefix + ".")]
    assert start, prefix
    seen, todo = set(), list(start)
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(loaded[module])
    assert not seen & torch_modules, sorted(seen & torch_modules)


def _within(name: str, prefixes) -> bool:
    return any(name == prefix or name.startswith(prefix + ".") for prefix in prefixes)


def _domain_modules(package: str) -> list[str]:
    modules = [module for module in SOURCES if _top(module) == package and not _within(module, WIRE_EDGES[package])]
    assert modules, package
    return sorted(modules)


@pytest.mark.parametrize("package", sorted(WIRE_EDGES))
def test_domain_modules_import_no_stubs_protobuf_or_grpc(package):
    """Only the wire edge converts: every other module of the service takes and returns domain values."""
    wrong = sorted(f"{module} imports {name}" for module in _domain_modules(package)
                   for name in _imports(SOURCES[module][0], module, SOURCES[module][1])
                   if _within(name, WIRE_PACKAGES))
    assert not wrong, wrong


def test_the_engine_readme_layer_table_names_every_folder():
    """The README's layer table and the package's folders agree."""
    readme = (PACKAGE_ROOTS["tito_engine"].parent / "README.md").read_text()
    table = readme[readme.index("## Layers"):].split("\n## ")[0]
    folders = {path.name for path in PACKAGE_ROOTS["tito_engine"].iterdir()
               if path.is_dir() and (path / "__init__.py").is_file()}
    for folder in folders:
        assert f"`{folder}/`" in table, folder
    named = {name for _, prefixes in ENGINE_LAYERS for prefix in prefixes
             for name in [prefix.removeprefix("tito_engine.")] if "." not in name and name != "tito_engine"}
    assert folders <= named | {"server", "config"}, folders - named


@pytest.mark.parametrize("prefix", ENGINE_WIRE_FREE)
def test_engine_domain_packages_import_no_stubs_protobuf_or_grpc(prefix):
    """Below the engine's faces everything works on domain values: a third protocol face adds a
    converter and a servicer, never a change here."""
    modules = sorted(module for module in SOURCES if _within(module, (prefix,)))
    assert modules, f"{prefix}: no such module (moved? update ENGINE_WIRE_FREE)"
    wrong = sorted(f"{module} imports {name}" for module in modules
                   for name in _imports(SOURCES[module][0], module, SOURCES[module][1])
                   if _within(name, WIRE_PACKAGES))
    assert not wrong, wrong
