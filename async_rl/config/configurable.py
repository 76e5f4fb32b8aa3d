"""Building nested config dataclasses from TOML files, dicts and ``a.b=c`` overrides.

Every component owns a ``@dataclass(kw_only=True, slots=True)`` config beside it, each
field documented, bounds checked in ``__post_init__`` with a ``ValueError`` naming the
dotted field. This module only turns user input into those dataclasses: unknown keys are
rejected, values are coerced to the field's type, and the error names the dotted path.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import re
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from async_rl.config.keys import unknown_keys

T = TypeVar("T")


class ConfigError(ValueError):
    """A user's config is wrong; the message names the dotted field."""


def _coerce(value: Any, tp: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors = []
        for arg in args:
            if arg is type(None):
                continue
            try:
                return _coerce(value, arg, path)
            except (ConfigError, ValueError, TypeError) as exc:
                errors.append(str(exc))
        raise ConfigError(f"{path}: {value!r} matches none of {tp} ({'; '.join(errors)})")
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{path} must be one of {list(args)}, got {value!r}")
        return value
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        if isinstance(value, tp):
            return value
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a table of {tp.__name__} fields, got {value!r}")
        return from_dict(tp, value, path)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{path} must be a list, got {value!r}")
        item_tp = args[0] if args else Any
        items = [_coerce(v, item_tp, f"{path}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{path} must be a table, got {value!r}")
        return dict(value)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        raise ConfigError(f"{path} must be true or false, got {value!r}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        if isinstance(value, float) and value.is_integer():
            return int(value)
        if isinstance(value, str):
            try:
                return int(float(value)) if "e" in value.lower() else int(value, 0)
            except ValueError:
                pass
        raise ConfigError(f"{path} must be an integer, got {value!r}")
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{path} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path} must be a number, got {value!r}") from None
    if tp is str:
        if not isinstance(value, str):
            raise ConfigError(f"{path} must be a string, got {value!r}")
        return value
    if tp is Path:
        return Path(value)
    return value


def from_dict(cls: type[T], data: dict[str, Any], path: str = "") -> T:
    """Build ``cls`` from ``data``; unknown keys and wrong types raise :class:`ConfigError`."""
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}  # type: ignore[arg-type]
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f" in {path}" if path else ""
        guesses = [f"{k} (did you mean {m[0]}?)" if (m := difflib.get_close_matches(k, fields, n=1)) else k
                   for k in unknown]  # fmt: skip
        raise ConfigError(f"unknown config key(s){where}: {', '.join(guesses)}; known: {', '.join(sorted(fields))}")
    kwargs = {}
    for name, value in data.items():
        dotted = f"{path}.{name}" if path else name
        kwargs[name] = _coerce(value, hints[name], dotted)
    try:
        return cls(**kwargs)
    except ValueError as exc:
        if isinstance(exc, ConfigError):
            raise
        message = user_key_message(cls, str(exc), path) if path else None  # the root's own: load_config's call
        if message is not None:
            raise ConfigError(message) from exc
        raise ConfigError(f"{path}: {exc}" if path else str(exc)) from exc
    except TypeError as exc:
        raise ConfigError(f"{path or cls.__name__}: {exc}") from exc


_LEADING_KEY = re.compile(r"([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(.*)", re.S)


def _has_path(cls: type, dotted: str) -> bool:
    for part in dotted.split("."):
        if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
            return False
        hints = typing.get_type_hints(cls)
        if part not in hints or part not in {f.name for f in dataclasses.fields(cls)}:
            return False
        cls = hints[part]
    return True


def user_key_message(cls: type, message: str, path: str) -> str | None:
    """``message`` of a validation error with its leading key written as the user sets it: a config's own name for
    its field (``engine.device``, ``buffer.staleness.max_staleness``) becomes the path from the root
    (``torch.device``, ``staleness.max_staleness``). None when the message does not start with a key of ``cls``."""
    m = _LEADING_KEY.match(message)
    if m is None:
        return None
    head, rest = m.group(1).split("."), m.group(2)
    for i in range(len(head)):
        suffix = ".".join(head[i:])
        if _has_path(cls, suffix):
            if i and not path:  # the same config-internal prefix further on ("a.x and a.y"): the user's keys too
                dropped = re.escape(".".join(head[:i]) + ".")
                rest = re.sub(rf"\b{dropped}([A-Za-z_][\w.]*)",
                              lambda k: k.group(1) if _has_path(cls, k.group(1)) else k.group(0), rest)  # fmt: skip
            return f"{path}.{suffix}{rest}" if path else f"{suffix}{rest}"
    return None


def to_dict(cfg: Any) -> dict[str, Any]:
    """A JSON-friendly dict of a config dataclass (paths as strings)."""

    def conv(v: Any) -> Any:
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {f.name: conv(getattr(v, f.name)) for f in dataclasses.fields(v)}
        if isinstance(v, (list, tuple)):
            return [conv(x) for x in v]
        if isinstance(v, dict):
            return {k: conv(x) for k, x in v.items()}
        if isinstance(v, Path):
            return str(v)
        return v

    return conv(cfg)


def parse_overrides(items: list[str]) -> dict[str, Any]:
    """Turn ``["a.b=1", "c=x"]`` into a nested dict; values parse as JSON when they can."""
    out: dict[str, Any] = {}
    for item in items:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like key.sub=value")
        key, raw = item.split("=", 1)
        try:
            value: Any = json.loads(raw)
        except json.JSONDecodeError:
            value = raw
        node = out
        parts = key.strip().split(".")
        for part in parts[:-1]:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ConfigError(f"override {item!r} conflicts with another override")
        node[parts[-1]] = value
    return out


def deep_merge(base: dict[str, Any], extra: dict[str, Any]) -> dict[str, Any]:
    out = dict(base)
    for k, v in extra.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = deep_merge(out[k], v)
        else:
            out[k] = v
    return out


def load_config(cls: type[T], file: str | Path | None = None, overrides: list[str] | None = None) -> T:
    """Load ``cls`` from an optional TOML file plus ``key=value`` overrides."""
    data: dict[str, Any] = {}
    if file is not None:
        p = Path(file)
        if not p.is_file():
            raise ConfigError(f"config file {p} does not exist")
        with p.open("rb") as fh:
            try:
                data = tomllib.load(fh)
            except tomllib.TOMLDecodeError as exc:
                raise ConfigError(f"config file {p}: {exc}") from exc
    if overrides:
        data = deep_merge(data, parse_overrides(overrides))
    return config_from_data(cls, data)


def config_from_data(cls: type[T], data: dict[str, Any]) -> T:
    """``cls`` from the merged user data of :func:`load_config`: every unknown key named at once, and validation
    messages naming keys as the user writes them."""
    unknown = unknown_keys(cls, data)  # every unknown key at once, each with the key it probably meant
    if unknown:
        raise ConfigError(unknown)
    try:
        return from_dict(cls, data)
    except ConfigError as exc:  # "learner.batch_groups must be >= 1": the key as the user writes it, batch_groups
        message = user_key_message(cls, str(exc), "")
        if message is None or message == str(exc):
            raise
        raise ConfigError(message) from exc
