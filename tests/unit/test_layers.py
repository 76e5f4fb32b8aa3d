"""The house's layers, read from the code: every room says in its docstring what it may import, and does no more.

A room is a top-level package or module of ``async_rl`` (``model``, ``wire``, ``weights``, ``entry``...) or one of
the outer floors (``buffer``, ``actors.generator``, ``actors.learner``, ``actors.commands``; STYLE.md's
``async_rl/`` <- ``buffer/`` <- ``actors/`` <- ``actors/commands/``). Its docstring (the package's ``__init__``, or
the module's own) has one line ``May import: a, b.`` naming the rooms it may import (``nothing of async_rl`` or
``anything``): that line is the one place each direction is written. Every ``import`` / ``from ... import``, at
module level or inside a function (not under ``if TYPE_CHECKING:``, which never runs), is read with ``ast`` and
checked against it; the declared rooms must point one way; and no module of the three packages may import itself
back through others.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGES = ("async_rl", "buffer", "actors")
OUTER = ("buffer", "actors.generator", "actors.learner", "actors.commands")
MAY_IMPORT = re.compile(r"^May import: (.+?)\.?$", re.M)


def modules_of(root: Path, packages: tuple[str, ...]) -> dict[str, Path]:
    out = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            out[".".join(path.relative_to(root).with_suffix("").parts).removesuffix(".__init__")] = path
    return out


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The modules of ``modules`` that ``name`` imports, anywhere in the file but under ``if TYPE_CHECKING:``."""
    tree = ast.parse(path.read_text())
    skip = {id(n) for node in ast.walk(tree) if isinstance(node, ast.If) and isinstance(node.test, ast.Name)
            and node.test.id == "TYPE_CHECKING" for n in ast.walk(node)}  # fmt: skip
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*parts, base] if base else parts)
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            targets = subs or [base]
        for target in targets:
            while target and target not in modules:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(root: Path, packages: tuple[str, ...]) -> dict[str, set[str]]:
    modules = modules_of(root, packages)
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The groups of modules that import each other around a loop (Tarjan's strongly connected components)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in sorted(graph[v]):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            connect(v)
    return found


def room_of(module: str) -> str:
    parts = module.split(".")
    if parts[0] == "async_rl":
        return "async_rl" if len(parts) == 1 else parts[1]
    if parts[0] == "actors" and len(parts) > 1:
        return ".".join(parts[:2])
    return parts[0]


def declared(docstring: str, room: str) -> set[str] | None:
    """The rooms ``room`` may import, from its docstring (None: anything)."""
    found = MAY_IMPORT.findall(docstring)
    assert len(found) == 1, f"{room}: its docstring needs exactly one line 'May import: ...' (found {len(found)})"
    text = re.sub(r"\([^)]*\)", "", found[0]).strip()
    if text == "anything":
        return None
    if text.startswith("nothing"):
        return set()
    return {part.strip() for part in text.split(",")}


def undeclared(graph: dict[str, set[str]], room: str, allowed: set[str]) -> list[str]:
    """``module -> target`` for every import of ``room`` into a room it does not declare."""
    wrong = []
    for module, targets in graph.items():
        if room_of(module) != room:
            continue
        for target in targets:
            # seen from an outer floor, all of async_rl is one room
            other = "async_rl" if room in OUTER and target.startswith("async_rl") else room_of(target)
            if other != room and other not in allowed:
                wrong.append(f"{module} -> {target}")
    return sorted(wrong)


MODULES = modules_of(ROOT, PACKAGES)
GRAPH = import_graph(ROOT, PACKAGES)
ROOMS = sorted({room_of(m) for m in MODULES} - {"actors", "async_rl"})


def _docstring(room: str) -> str:
    module = room if room in OUTER else f"async_rl.{room}"
    return ast.get_docstring(ast.parse(MODULES[module].read_text())) or ""


@pytest.mark.parametrize("room", ROOMS)
def test_a_room_imports_only_what_its_docstring_allows(room: str) -> None:
    allowed = declared(_docstring(room), room)
    if allowed is None:
        return
    known = set(ROOMS) | {"async_rl"}
    assert allowed <= known, f"{room}: 'May import' names rooms that do not exist: {sorted(allowed - known)}"
    wrong = undeclared(GRAPH, room, allowed)
    assert not wrong, f"{room} may import {sorted(allowed) or 'nothing'}, but: " + "; ".join(wrong)


def test_the_declared_rooms_point_one_way() -> None:
    layers = {room: declared(_docstring(room), room) for room in ROOMS}
    graph = {room: set(allowed or ()) & set(layers) for room, allowed in layers.items()}
    assert not cycles(graph), f"the declared rooms import each other around a loop: {cycles(graph)}"


def test_no_module_imports_itself_back() -> None:
    assert len(GRAPH["async_rl.weights.reader"]) >= 3  # the check reads
    assert not cycles(GRAPH), f"modules that import each other around a loop: {cycles(GRAPH)}"


def test_every_package_says_what_it_holds() -> None:
    bare = [name for name, path in MODULES.items()
            if path.name == "__init__.py" and not ast.get_docstring(ast.parse(path.read_text()))]  # fmt: skip
    assert not bare, f"packages with no docstring: {bare}"


def test_async_rl_keeps_few_modules_at_its_root() -> None:
    loose = sorted(p.name for p in (ROOT / "async_rl").glob("*.py") if p.name != "__init__.py")
    assert len(loose) <= 6, f"async_rl/ holds {len(loose)} modules at its root: {loose}"


def test_the_checks_see_an_undeclared_import_and_a_cycle(tmp_path: Path) -> None:
    """The checkers themselves, on a small tree: an import inside a function counts, one under TYPE_CHECKING not."""
    pkg = tmp_path / "async_rl"
    for room in ("low", "high"):
        (pkg / room).mkdir(parents=True)
        (pkg / room / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "low" / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from async_rl.high import b\n")
    (pkg / "high" / "b.py").write_text("def f():\n    from async_rl.low import a\n")
    graph = import_graph(tmp_path, ("async_rl",))
    assert cycles(graph) == [] and undeclared(graph, "low", set()) == []
    assert undeclared(graph, "high", set()) == ["async_rl.high.b -> async_rl.low.a"]
    assert undeclared(graph, "high", {"low"}) == []
    (pkg / "low" / "a.py").write_text("import async_rl.high.b\n")
    graph = import_graph(tmp_path, ("async_rl",))
    assert cycles(graph) == [["async_rl.high.b", "async_rl.low.a"]]
    assert undeclared(graph, "low", set()) == ["async_rl.low.a -> async_rl.high.b"]


def test_the_architecture_page_names_every_room() -> None:
    page = (ROOT / "docs" / "architecture.md").read_text()
    missing = [room for room in ROOMS if f"`{room}/`" not in page and f"`{room}.py`" not in page
               and f"{room.replace('.', '/')}/" not in page]  # fmt: skip
    assert not missing, f"docs/architecture.md does not name {missing}"
