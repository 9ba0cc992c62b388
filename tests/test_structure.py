"""The package's shape, checked: layers import downward, no import cycles, no sprawling files.

These read the source (``ast``), not the running interpreter, so a function-level import counts
as much as a top-level one: a cycle hidden inside a function is still a cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "fastload"

#: A module longer than this must say why in its docstring (a paragraph ``Why one file: ...``).
MAX_LINES = 500

#: The layers, lowest first. A module may import its own layer and the ones below it, never above.
#: ``testing`` and the top-level modules (``fastload/__init__``, ``cli``, ``demo``) may import all.
LAYERS = ("storage", "formats", "loader", "dali", "convert")
#: Leaf modules every layer may use; they import no other part of fastload but each other and errors.
LEAVES = ("fastload.errors", "fastload._units", "fastload._lazy", "fastload._fsutil",
          "fastload._plugins", "fastload._version", "fastload._os", "fastload._memo",
          "fastload._capacity")  # fmt: skip


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {_module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def _imports(name: str, path: Path) -> set[str]:
    """The fastload modules ``name`` imports anywhere in its source (resolved, relative too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            # `from pkg import mod` imports the module pkg.mod (pkg itself is loaded first, as for
            # every submodule: not an edge); `from mod import name` imports mod.
            targets = [
                f"{module}.{alias.name}" if f"{module}.{alias.name}" in MODULES else module
                for alias in node.names
            ]
        else:
            continue
        for target in targets:
            while target and target not in MODULES:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


GRAPH = {name: _imports(name, path) for name, path in MODULES.items()}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []
    for start in graph:
        if start in index:
            continue
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(sorted(component))
    return components


def test_the_checker_finds_a_cycle_and_a_clean_graph_has_none() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_no_import_cycles() -> None:
    # The root package is left out: `fastload/__init__` re-exports from every layer, and a module
    # that imports `fastload.x.y` loads `fastload` first without importing from it.
    graph = {
        n: {d for d in deps if d != "fastload"} for n, deps in GRAPH.items() if n != "fastload"
    }
    assert _cycles(graph) == []
    # Inside the layers, import from the defining module: `import fastload` there is a cycle in
    # waiting (the demo and the CLI use the public API like any user and may).
    importing_root = sorted(
        n
        for n, deps in GRAPH.items()
        if "fastload" in deps and (_layer(n) is not None or n in LEAVES)
    )
    assert importing_root == [], "import what you need from its own module, not from fastload"


def _layer(name: str) -> int | None:
    parts = name.split(".")
    if len(parts) > 1 and parts[1] in LAYERS:
        return LAYERS.index(parts[1])
    return None


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _layer(n) is not None))
def test_layers_import_downward(name: str) -> None:
    own = _layer(name)
    assert own is not None
    upward = sorted(d for d in GRAPH[name] if (_layer(d) or -1) > own)
    assert upward == [], f"{name} ({LAYERS[own]}) imports a higher layer"


#: The loader's rooms, lowest first (issue 24): the files at the package's top are the floor
#: named "" (the sample dataset, the batch stream, DataLoader); ``__init__`` re-exports all.
LOADER_ROOMS = ("order", "images", "", "tokens", "mix")


def _loader_room(name: str) -> int | None:
    """The floor of a module of ``fastload.loader``: its room's, or the top files' (``""``);
    ``None`` outside the package, and above every floor for its ``__init__``."""
    parts = name.split(".")
    if parts[:2] != ["fastload", "loader"]:
        return None
    if len(parts) == 2:
        return len(LOADER_ROOMS)
    return LOADER_ROOMS.index(parts[2] if parts[2] in LOADER_ROOMS else "")


@pytest.mark.parametrize(
    "name", sorted(n for n in MODULES if _loader_room(n) not in (None, len(LOADER_ROOMS)))
)
def test_loader_rooms_import_downward(name: str) -> None:
    own = _loader_room(name)
    assert own is not None
    upward = sorted(d for d in GRAPH[name] if (_loader_room(d) or 0) > own)
    assert upward == [], f"{name} (room {LOADER_ROOMS[own]!r}) imports a higher room of loader/"


def test_the_room_checker_places_modules() -> None:
    assert _loader_room("fastload.loader.order._cursor") == 0
    assert _loader_room("fastload.loader.images") == 1
    assert _loader_room("fastload.loader._shards") == 2
    assert _loader_room("fastload.loader.mix._tokens") == 4
    assert _loader_room("fastload.loader") == 5
    assert _loader_room("fastload.storage._base") is None


@pytest.mark.parametrize("name", LEAVES)
def test_leaf_modules_import_only_leaves(name: str) -> None:
    if name not in MODULES:
        pytest.fail(f"{name} is listed as a leaf module but does not exist")
    assert sorted(GRAPH[name] - set(LEAVES)) == []


@pytest.mark.parametrize("name", sorted(MODULES))
def test_long_modules_say_why(name: str) -> None:
    path = MODULES[name]
    lines = path.read_text().count("\n")
    if lines <= MAX_LINES:
        return
    doc = ast.get_docstring(ast.parse(path.read_text())) or ""
    assert "Why one file:" in doc, (
        f"{path.relative_to(ROOT.parent)} has {lines} lines (> {MAX_LINES}): split it by "
        "responsibility, or give its docstring a paragraph 'Why one file: ...'"
    )


# ---- seams: what one package takes from another ---------------------------------------------


def _package(name: str) -> str:
    """The package a module belongs to for the seam rule: ``fastload.<layer>``, ``fastload.cli``,
    ``fastload.testing``, else ``fastload`` (the top-level modules)."""
    parts = name.split(".")
    if len(parts) > 1 and (parts[1] in LAYERS or parts[1] in ("cli", "testing")):
        return ".".join(parts[:2])
    return "fastload"


def _private(name: str) -> bool:
    """Whether ``name`` is a private module of its package (a ``_`` component below it)."""
    inside = name[len(_package(name)) :].strip(".")
    return any(part.startswith("_") for part in inside.split(".") if part)


def private_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(importer, imported) where a module takes from another package's private module. The
    leaf modules are shared by design and not counted."""
    return {
        (name, dep)
        for name, deps in graph.items()
        for dep in deps
        if _package(name) != _package(dep) and _private(dep) and dep not in LEAVES
    }


#: The private imports across packages that remain (issue 24: 65 when the rule came, 7 now).
#: It may only shrink: export what another package needs from its package's ``__init__``.
PRIVATE_IMPORTS_ALLOWED = {
    ("fastload.convert._guard", "fastload.formats.lmdb._writer"),
    ("fastload.demo", "fastload.cli._common"),
    ("fastload.testing.executors", "fastload.convert._plan"),
    ("fastload.testing.executors", "fastload.convert._pool"),
    ("fastload.testing.executors", "fastload.convert._progress"),
    ("fastload.testing.executors", "fastload.convert._state"),
    ("fastload.testing.executors", "fastload.convert._worker"),
}


def test_the_seam_checker_sees_a_private_import_across_packages() -> None:
    graph = {
        "fastload.loader._a": {"fastload.storage._b", "fastload.storage", "fastload._os"},
        "fastload.storage._b": {"fastload.storage._c"},
        "fastload.storage._c": set(),
    }
    assert private_imports(graph) == {("fastload.loader._a", "fastload.storage._b")}


def test_no_new_private_imports_across_packages() -> None:
    new = sorted(private_imports(GRAPH) - PRIVATE_IMPORTS_ALLOWED)
    assert new == [], (
        "import what another package offers from its package (export it from its __init__), "
        f"not from its private modules: {new}"
    )


def test_the_private_import_allow_list_only_shrinks() -> None:
    gone = sorted(PRIVATE_IMPORTS_ALLOWED - private_imports(GRAPH))
    assert gone == [], f"these private imports are gone: remove them from the allow-list: {gone}"


# ---- optional dependencies: who may import them ---------------------------------------------


def third_party_imports(source: str) -> set[str]:
    """The top-level names of the packages ``source`` imports anywhere (relative imports are
    fastload's own and not counted): ``import a.b``, ``from a.b import c``, and the string
    given to ``importlib.import_module``, ``__import__`` or fastload's ``require``."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            found.add(node.module)
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (getattr(node.func, "id", None) or getattr(node.func, "attr", None))
            in ("import_module", "__import__", "require")
        ):
            found.add(node.args[0].value)
    return {name.partition(".")[0] for name in found}


#: Optional packages (pyproject.toml's extras) and the only modules that may import them. A user
#: without the extra can import every other module of fastload.
OPTIONAL_IMPORTERS = {"webdataset": {"fastload.wds"}}


def test_the_optional_import_checker_sees_imports() -> None:
    source = (
        "import webdataset.tenbin\nfrom .webdataset import x\n"
        "def f():\n    from webdataset import autodecode\n"
        "    importlib.import_module('webdataset.compat')\n    require('boto3', extra='s3')\n"
        "from fastload.formats.webdataset import reader\n"
    )
    assert third_party_imports(source) == {"webdataset", "boto3", "fastload"}
    assert third_party_imports("from . import webdataset\nimport os.path") == {"os"}


@pytest.mark.parametrize("package", sorted(OPTIONAL_IMPORTERS))
def test_optional_packages_are_imported_only_where_allowed(package: str) -> None:
    importers = sorted(
        n for n, p in MODULES.items() if package in third_party_imports(p.read_text())
    )
    assert importers == sorted(OPTIONAL_IMPORTERS[package]), (
        f"only {sorted(OPTIONAL_IMPORTERS[package])} may import {package} (an optional extra); "
        f"found in {importers}"
    )
