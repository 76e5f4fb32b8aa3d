"""Every key of a config, from the dataclasses themselves: ``--help-keys`` and "did you mean" across sections.

A config's keys are the dotted paths of its dataclass fields (``torch.model.name``); each field's description is
the string literal under it in the class body (read from the source with ``ast``, so the documentation and the
help cannot drift apart). :func:`render_keys` prints them grouped by section with type and default;
:func:`unknown_keys` names every key a user gave that the config does not have, and offers the key of the same
name in another section (a generator's ``model.name`` is ``torch.model.name`` or ``vllm.model.name``).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import functools
import inspect
import json
import re
import textwrap
import types
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

_FIRST_SENTENCE = re.compile(r"(?<!e\.g)(?<!i\.e)(?<!etc)\.\s")
"""The end of a docstring's first sentence (not the dot of an "e.g.")."""
_ROLE = re.compile(r":(?:py:)?(?:data|meth|class|func|mod|attr|obj|exc|const):`(~?)([^`]+)`")
"""A Sphinx cross-reference (``:func:`a.b` ``, ``:class:`~a.B` ``): the docstrings are written for Sphinx too."""
_LITERAL = re.compile(r"``([^`]+)``")
"""A reST inline literal (two backticks each side)."""


def plain(text: str) -> str:
    """A docstring's line as a terminal shows it: a Sphinx role becomes its target (``:data:`SCHEMES` `` ->
    `SCHEMES`; with ``~`` only the last name, ``:meth:`~a.B.c` `` -> `c`), a reST literal takes one backtick."""

    def role(m: re.Match[str]) -> str:
        target = m.group(2).split(".")[-1] if m.group(1) else m.group(2)
        return f"`{target}`"

    return _LITERAL.sub(r"`\1`", _ROLE.sub(role, text))


@dataclass(frozen=True, slots=True)
class Key:
    """One leaf key of a config."""

    path: str
    """Dotted path (``run.prefix``)."""
    type: str
    """The field's type, as a user writes values (``int``, ``str | None``, ``torch|vllm``)."""
    default: str
    """The default, as TOML would write it."""
    doc: str
    """First line of the field's docstring."""


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> its docstring (the string literal right under the field in the class body)."""
    out: dict[str, str] = {}
    for klass in reversed(cls.__mro__):
        if not dataclasses.is_dataclass(klass):
            continue
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(klass)))
        except (OSError, TypeError, SyntaxError):
            continue
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for node, nxt in zip(body, [*body[1:], None], strict=True):
            if (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and isinstance(nxt, ast.Expr)
                    and isinstance(nxt.value, ast.Constant) and isinstance(nxt.value.value, str)):  # fmt: skip
                out[node.target.id] = inspect.cleandoc(nxt.value.value)
    return out


def _dataclass_of(tp: Any) -> type | None:
    return tp if isinstance(tp, type) and dataclasses.is_dataclass(tp) else None


def type_name(tp: Any) -> str:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return "|".join(str(a) for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join("None" if a is type(None) else type_name(a) for a in args)
    if origin in (list, tuple):
        return f"list of {type_name(args[0])}" if args else "list"
    if origin is dict or tp is dict:
        return "table"
    if tp is Path:
        return "path"
    return tp.__name__ if isinstance(tp, type) else str(tp)


def _toml(value: Any) -> str:
    if value is None:
        return "(unset)"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (str, Path)):
        return json.dumps(str(value))  # a TOML basic string: a newline shows as \n, on the key's one line
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(_toml(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k} = {_toml(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default(f: dataclasses.Field) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    return None


def config_keys(cls: type, prefix: str = "") -> list[Key]:
    """Every leaf key of ``cls`` (nested dataclasses flattened), in declaration order."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    out: list[Key] = []
    for f in dataclasses.fields(cls):
        if not f.init:
            continue
        path = f"{prefix}{f.name}"
        nested = _dataclass_of(hints[f.name])
        if nested is not None:
            out += config_keys(nested, path + ".")
        else:
            doc = plain(docs.get(f.name, "").split("\n\n")[0].replace("\n", " "))
            first = _FIRST_SENTENCE.split(doc, maxsplit=1)[0].rstrip(".") + "." if doc else ""
            out.append(Key(path, type_name(hints[f.name]), _toml(_default(f)), first))
    return out


def sections(cls: type) -> list[tuple[str, str]]:
    """``(name, docstring's first line)`` of the top-level sections (the fields that are configs themselves)."""
    hints, docs = typing.get_type_hints(cls), field_docs(cls)
    return [(f.name, plain(docs.get(f.name, "").split("\n")[0])) for f in dataclasses.fields(cls)
            if f.init and _dataclass_of(hints[f.name]) is not None]  # fmt: skip


def render_keys(cls: type, prog: str) -> str:
    """Every key of ``cls``, grouped by section, one line each: path, type, default, description."""
    keys = config_keys(cls)
    tops = [k for k in keys if "." not in k.path]
    lines = [f"{prog}: every config key ({len(keys)}). Set them as KEY=VALUE arguments or in a TOML file given "
             "to --config ([section] tables for dotted keys).", ""]  # fmt: skip
    col = min(max(len(k.path) for k in keys) + 2, 44)
    tcol = min(max(len(f"{k.type} = {k.default}") for k in keys) + 2, 40)

    def row(k: Key) -> str:
        spec = f"{k.type} = {k.default}"
        return f"  {k.path:<{col}}{spec:<{tcol}}{k.doc}" if len(spec) < tcol else f"  {k.path:<{col}}{spec}  {k.doc}"

    if tops:
        lines.append("general")
        lines += [row(k) for k in tops]
    for name, doc in sections(cls):
        lines += ["", f"[{name}]  {doc}".rstrip()]
        lines += [row(k) for k in keys if k.path.startswith(name + ".")]
    return "\n".join(lines)


def _leaves(value: Any, path: str) -> list[str]:
    if isinstance(value, dict) and value:
        return [leaf for k, v in value.items() for leaf in _leaves(v, f"{path}.{k}")]
    return [path]


def _unknown(cls: type, data: dict[str, Any], path: str) -> list[tuple[str, Any, list[str]]]:
    """(dotted key, its value, the sibling field names) of every unknown key in ``data``."""
    hints = typing.get_type_hints(cls)
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    out = []
    for k, v in data.items():
        dotted = f"{path}{k}"
        if k not in fields:
            out.append((dotted, v, fields))
            continue
        nested = _dataclass_of(hints[k])
        if nested is not None and isinstance(v, dict):
            out += _unknown(nested, v, dotted + ".")
    return out


def unknown_keys(cls: type, data: dict[str, Any]) -> str | None:
    """None when every key of ``data`` is a key of ``cls``; otherwise the message naming each unknown key, with the
    key it probably meant: a sibling of a similar name, else the same key in another section, else the closest."""
    unknown = _unknown(cls, data, "")
    if not unknown:
        return None
    all_paths = [k.path for k in config_keys(cls)]
    role = cls.__name__.removesuffix("Config").lower()
    parts = []
    for dotted, value, siblings in unknown:
        if dotted == role and isinstance(value, dict):  # a [generator] table in a generator's own file
            parts.append(f"{role} (a {role}'s keys are at the top of its file: [vllm], not [{role}.vllm])")
            continue
        parent, _, name = dotted.rpartition(".")
        leaves = _leaves(value, dotted)
        moved = [p for p in all_paths if any(p.endswith("." + leaf) for leaf in leaves)]  # in another section
        near = difflib.get_close_matches(name, siblings, n=1)
        if near and not moved:  # a typo of a sibling
            parts.append(f"{dotted} (did you mean {parent + '.' if parent else ''}{near[0]}?)")
            continue
        if not moved:
            moved = difflib.get_close_matches(leaves[0], all_paths, n=2, cutoff=0.75)
        shown = ", ".join(leaves) if len(leaves) > 1 else leaves[0]
        parts.append(f"{shown} (did you mean {' or '.join(moved[:3])}?)" if moved else shown)
    return f"unknown config key(s): {', '.join(parts)}"


def keys_overview(cls: type, width: int = 100) -> str:
    """Every key of ``cls`` by name only, one wrapped paragraph per section (what ``--help`` shows; ``--help-keys``
    adds types, defaults and descriptions)."""
    keys = [k.path for k in config_keys(cls)]
    groups = [("general", [k for k in keys if "." not in k])]
    groups += [(name, [k for k in keys if k.startswith(name + ".")]) for name, _ in sections(cls)]
    lines = []
    for name, members in groups:
        lines += textwrap.wrap(", ".join(members), width=width, initial_indent=f"  {name}: ",
                               subsequent_indent="    ", break_on_hyphens=False)  # fmt: skip
    return "\n".join(lines)
