"""The house points one way (STYLE.md): ``async_rl/`` <- ``buffer/`` <- ``actors/`` <- ``actors/commands/``.

An import-graph check over the source: every ``import`` / ``from ... import`` statement, at module
level or inside a function, is read with ``ast`` and its target package compared with the layer of
the importing file. An import that runs back up the list fails with the file, line and target named.
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
