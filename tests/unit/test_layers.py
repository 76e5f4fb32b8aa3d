"""The house points one way (STYLE.md): ``async_rl/`` <- ``buffer/`` <- ``actors/`` <- ``actors/commands/``.

An import-graph check over the source: every ``import`` / ``from ... import`` statement, at module
level or inside a function, is read with ``ast`` and its target package compared with the layer of
the importing file. An import that runs back up the list fails with the file, line and target named. Within the weights room
(``async_rl/weights/``) no two modules import each other, directly or around a loop: transports are reached
through the scheme registry, which imports none of them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

# Layer of a module path prefix, lowest first; a module may import its own layer and any lower one.
LAYERS: list[tuple[str, int]] = [("async_rl", 0), ("buffer", 1), ("actors", 2), ("actors.commands", 3)]


def _layer(module: str) -> int | None:
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for prefix, layer in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > best[0]:
                best = (len(prefix), layer)
    return None if best is None else best[1]


def _imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), filename=str(path))
    out: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.append((node.lineno, node.module))
    return out


def upward_imports() -> list[str]:
    bad = []
    for package in ("async_rl", "buffer", "actors"):
        for path in sorted((ROOT / package).rglob("*.py")):
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            own = _layer(module)
            assert own is not None
            for lineno, target in _imports(path):
                layer = _layer(target)
                if layer is not None and layer > own:
                    bad.append(f"{path.relative_to(ROOT)}:{lineno} imports {target}")
    return bad


def test_layers_point_one_way() -> None:
    bad = upward_imports()
    assert not bad, "imports that run back up the layers (async_rl <- buffer <- actors <- actors.commands):\n" + (
        "\n".join(bad)
    )


def test_the_check_sees_an_upward_import(tmp_path: Path) -> None:
    """The checker itself: an upward import inside a function body is found."""
    f = tmp_path / "m.py"
    f.write_text("def f():\n    from actors.learner.loop import Learner\n    import buffer.rollouts\n")
    targets = [t for _, t in _imports(f)]
    assert targets == ["actors.learner.loop", "buffer.rollouts"]
    assert _layer("actors.learner.loop") == 2 and _layer("actors.commands.cli") == 3 and _layer("async_rl.wire") == 0


def _module_imports(path: Path, package: str) -> set[str]:
    """Modules under ``package`` that ``path`` imports, anywhere but under ``if TYPE_CHECKING:`` (never run)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    skip = {
        id(n)
        for node in ast.walk(tree)
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"
        for n in ast.walk(node)
    }
    out: set[str] = set()
    for node in ast.walk(tree):
        if id(node) in skip:
            continue
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            out.add(node.module)
            out |= {f"{node.module}.{a.name}" for a in node.names}  # ``from pkg import submodule``
    return {m for m in out if m.startswith(package + ".")}


def import_cycle(package: str, root: Path = ROOT) -> list[str]:
    """One import cycle among the modules of ``package`` under ``root`` (a path of module names), or []."""
    files = {
        ".".join(p.relative_to(root).with_suffix("").parts).removesuffix(".__init__"): p
        for p in (root / package.replace(".", "/")).rglob("*.py")
    }
    graph = {m: sorted(_module_imports(p, package) & set(files)) for m, p in files.items()}
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(m: str) -> list[str]:
        state[m] = 1
        path.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                return path[path.index(t) :] + [t]
            if t not in state and (found := visit(t)):
                return found
        state[m] = 2
        path.pop()
        return []

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return []


def test_no_import_cycle_in_the_weights_room() -> None:
    cycle = import_cycle("async_rl.weights")
    assert len(_module_imports(ROOT / "async_rl/weights/reader.py", "async_rl.weights")) >= 3  # the check reads
    assert not cycle, "modules of async_rl.weights import each other: " + " -> ".join(cycle)


def test_the_cycle_check_sees_a_cycle(tmp_path: Path) -> None:
    """The checker itself, on the old shape: ``transport`` importing ``peer.transport`` inside a function."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg.a import A\n")
    (pkg / "a.py").write_text("def f():\n    from pkg.b import B\n")
    (pkg / "b.py").write_text("from pkg import c\n")
    (pkg / "c.py").write_text("import os\n")
    assert import_cycle("pkg", tmp_path) == []  # the TYPE_CHECKING import is never run
    (pkg / "c.py").write_text("import pkg.a\n")
    assert import_cycle("pkg", tmp_path) == ["pkg.a", "pkg.b", "pkg.c", "pkg.a"]
