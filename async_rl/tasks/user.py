"""A user's own task or environment by config: ``task.name=path/to/file.py:Class`` or ``task.name=module:Class``.

The class is a concrete subclass of :class:`~async_rl.tasks.base.Task` (one answer per prompt, scored by its
``score``) or of :class:`~async_rl.tasks.envs.base.EnvTask` (episodes of several turns), with a ``name`` class
attribute. It is built as ``Class(seed=task.seed, tokenizer=<task.tokenizer loaded, or None>, **task.args)`` by the
learner (its prompts) and by every generator (its scores and episodes), so both must reach the same file or module.

Where it is found: a name with ``/`` or ending in ``.py`` is a file, relative to the working directory (its own
directory is appended to ``sys.path`` while it loads, so it imports its neighbours); otherwise a module, imported from
the working directory, then ``sys.path``, as ``task.reward``'s ``module:function`` is. The class is loaded and checked
when the config is (:func:`load_task_class`, from ``TaskConfig``): a missing file, module or class, something that is
not a ``Task``, an abstract class, or ``task.args`` its constructor does not take end the process before any server
is touched, in one line naming ``task.name`` (or ``task.args``).
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import importlib.util
import inspect
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from types import ModuleType
from typing import Any

from async_rl.tasks.base import Task


def is_user_task(name: str) -> bool:
    """Whether ``task.name`` names a user's class (``file.py:Class`` or ``module:Class``) rather than a built-in."""
    return ":" in name


def load_task_class(spec: str) -> type[Task]:
    """The class ``spec`` names, checked (see the module docstring); ValueError naming ``task.name`` otherwise."""
    return _load(spec, os.getcwd())


@functools.cache
def _load(spec: str, cwd: str) -> type[Task]:  # once per process and directory: a file's module is executed once
    target, _, attr = spec.rpartition(":")
    if not target or not attr or not attr.isidentifier():
        raise ValueError(f"task.name {spec!r} must be a built-in task, 'path/to/file.py:Class' or 'module:Class'")
    module = _file_module(spec, target, cwd) if target.endswith(".py") or "/" in target else _module(spec, target, cwd)
    if not hasattr(module, attr):
        defined = sorted(k for k, v in vars(module).items() if _is_task_class(v) and v.__module__ == module.__name__)
        also = f" (its Task classes: {', '.join(defined)})" if defined else " (it defines no Task class)"
        raise ValueError(f"task.name {spec!r}: {target} has no {attr!r}{also}")
    cls = getattr(module, attr)
    if not _is_task_class(cls):
        what = f"the class {cls.__name__}" if isinstance(cls, type) else f"the {type(cls).__name__} {cls!r:.60}"
        raise ValueError(f"task.name {spec!r}: {attr} is {what}, not a subclass of async_rl.tasks.Task (or "
                         "async_rl.tasks.envs.EnvTask)")  # fmt: skip
    if inspect.isabstract(cls):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise ValueError(f"task.name {spec!r}: {attr} is abstract: it does not implement {missing}")
    name = getattr(cls, "name", None)  # Task only annotates it: the class (or a base of its own) must set it
    if not isinstance(name, str) or not name:
        raise ValueError(f"task.name {spec!r}: {attr} has no name (a class attribute, e.g. name = \"guess\": it "
                         "labels its prompts and evaluation metrics)")  # fmt: skip
    return cls


def check_task_args(spec: str, cls: type[Task], args: Mapping[str, Any]) -> None:
    """ValueError naming ``task.args`` when ``cls(seed=..., tokenizer=..., **args)`` does not fit its constructor."""
    reserved = sorted({"seed", "tokenizer"} & set(args))
    if reserved:
        raise ValueError(f"task.args cannot set {reserved}: the task is given task.seed and task.tokenizer")
    try:
        inspect.signature(cls).bind(seed=0, tokenizer=None, **dict(args))
    except TypeError as exc:
        raise ValueError(f"task.args {dict(args)} for task.name {spec!r}: {cls.__name__}(seed=..., tokenizer=..., "
                         f"**task.args) does not fit its constructor: {exc}") from exc  # fmt: skip


def has_held_out(cls: type[Task]) -> bool:
    """Whether the class has a held-out split (its own ``eval_prompt``), which evaluation needs."""
    return cls.eval_prompt is not Task.eval_prompt


def build_user_task(spec: str, *, seed: int, tokenizer: str, args: Mapping[str, Any]) -> Task:
    """``Class(seed=seed, tokenizer=<tokenizer loaded, or None>, **args)`` of the class ``spec`` names."""
    cls = load_task_class(spec)
    check_task_args(spec, cls, args)
    tok = None
    if tokenizer:
        from async_rl.model.presets import load_tokenizer

        tok = load_tokenizer(tokenizer)
    return cls(seed=seed, tokenizer=tok, **dict(args))  # type: ignore[call-arg]


def _is_task_class(value: Any) -> bool:
    return isinstance(value, type) and issubclass(value, Task)


def _file_module(spec: str, target: str, cwd: str) -> ModuleType:
    path = (Path(cwd) / Path(target).expanduser()).resolve()
    if not path.is_file():
        raise ValueError(f"task.name {spec!r}: no file {target} (from the working directory {cwd})")
    # A name of its own per file (two files may share a stem), in sys.modules while it runs, as an import would be.
    name = f"async_rl_user_task_{path.stem}_{hashlib.sha1(str(path).encode()).hexdigest()[:8]}"
    if name in sys.modules:
        return sys.modules[name]
    module_spec = importlib.util.spec_from_file_location(name, path)
    if module_spec is None or module_spec.loader is None:
        raise ValueError(f"task.name {spec!r}: {target} is not a Python file (name it path/to/file.py:Class)")
    module = importlib.util.module_from_spec(module_spec)
    sys.modules[name] = module
    if str(path.parent) not in sys.path:
        sys.path.append(str(path.parent))  # after everything else: its neighbours never shadow an installed package
    try:
        module_spec.loader.exec_module(module)
    except Exception as exc:  # whatever the user's file raises while it loads is this config key's error, in one line
        del sys.modules[name]
        raise ValueError(f"task.name {spec!r}: {target} does not load: {type(exc).__name__}: {exc}") from exc
    return module


def _module(spec: str, target: str, cwd: str) -> ModuleType:
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # after everything else: a file here never shadows an installed package
    try:
        return importlib.import_module(target)
    except ModuleNotFoundError as exc:
        if exc.name is not None and target.startswith(exc.name):
            raise ValueError(f"task.name {spec!r}: no module {target!r} in the working directory {cwd} or on sys.path "
                             "(run from its directory, add that to PYTHONPATH, or name the file: "
                             "path/to/file.py:Class)") from exc  # fmt: skip
        raise ValueError(f"task.name {spec!r}: module {target!r} does not load: {type(exc).__name__}: {exc}") from exc
    except Exception as exc:  # whatever the user's module raises while it loads is this config key's error, one line
        raise ValueError(f"task.name {spec!r}: module {target!r} does not load: {type(exc).__name__}: {exc}") from exc
