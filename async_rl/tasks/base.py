"""The task interface: where prompts come from and how a response is scored.

A :class:`Task` makes prompts as :class:`~async_rl.wire.PromptSpec` (id, token ids, and the
metadata its scorer needs, e.g. ``{"task": "copy", "target": "12345"}``), deterministically
from ``(seed, index)`` so the learner can resume its prompt stream by index. Generators score
each sample with :meth:`Task.score`, which decodes the response (cut at the first end token)
and returns a :class:`Score`: the scalar reward plus named components for logging.

A user's own reward is named ``module:function`` (see :func:`load_reward_fn`) and called as
``fn(response_text, metadata)``; it returns a float, or a mapping with a ``"reward"`` key and
other float components.
"""

from __future__ import annotations

import abc
import importlib
import math
import os
import sys
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from async_rl.wire import PromptSpec

RewardFn = Callable[[str, Mapping[str, Any]], "float | Mapping[str, float]"]
"""``fn(response_text, metadata) -> reward`` or ``{"reward": r, "<component>": x, ...}``."""


@dataclass(slots=True)
class Score:
    """A scored response."""

    reward: float
    """The scalar the advantages are computed from."""
    info: dict[str, float] = field(default_factory=dict)
    """Named components / task metrics (e.g. ``{"exact": 1.0}``), for logging."""


class Task(abc.ABC):
    """Prompts and a verifiable reward."""

    name: str
    """Short task name (stored in each prompt's metadata under ``"task"``)."""

    @property
    @abc.abstractmethod
    def num_prompts(self) -> int | None:
        """Distinct prompts per epoch (None: an endless generated stream)."""

    @property
    @abc.abstractmethod
    def max_new_tokens(self) -> int:
        """A response budget that fits every answer of this task (end token included)."""

    @abc.abstractmethod
    def prompt(self, index: int) -> PromptSpec:
        """The ``index``-th prompt of the stream (same seed and index -> same prompt)."""

    @abc.abstractmethod
    def score(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> Score:
        """Score one response (token ids as generated, possibly ending in an end token)."""

    def eval_prompt(self, index: int) -> PromptSpec:
        """The ``index``-th prompt of the held-out split (evaluation; disjoint from the training stream).
        Default: a task without one raises ValueError."""
        raise ValueError(f"task {self.name!r} has no held-out split for evaluation")

    def answer(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> str | None:
        """The final answer a response gives, as a string equal for equal answers: evaluation's ``maj@k`` votes on
        it. Default: None, answers do not compare (no ``maj@k``)."""
        return None

    def task_for(self, metadata: Mapping[str, Any]) -> Task:
        """The task that scores (or runs the episodes of) the prompt whose metadata is ``metadata``: this one; a
        mixture's member (:mod:`async_rl.tasks.mixture`)."""
        return self

    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        """A prompt as the model reads it, special tokens shown (the learner logs its first prompt with it). Default:
        the token ids; a task with a tokenizer decodes them."""
        return f"token ids {np.asarray(prompt_ids).tolist()}"

    def prompts(self, start: int = 0) -> Iterator[PromptSpec]:
        """Prompts ``start, start + 1, ...`` (endless; a finite task cycles through reshuffled epochs)."""
        index = start
        while True:
            yield self.prompt(index)
            index += 1


def row_of(index: int, num_rows: int, seed: int, shuffle: bool) -> int:
    """Which of ``num_rows`` rows prompt ``index`` asks: epoch after epoch over the rows, each epoch in an order drawn
    from ``(seed, epoch)`` when ``shuffle`` (so the stream resumes by index alone)."""
    if index < 0:
        raise ValueError(f"prompt index must be >= 0, got {index}")
    epoch, pos = divmod(index, num_rows)
    if shuffle:
        pos = int(np.random.default_rng([seed, epoch]).permutation(num_rows)[pos])
    return pos


def load_reward_fn(spec: str) -> RewardFn:
    """Import ``module:function`` from the working directory or ``sys.path`` (a ``myreward.py`` beside the command
    is found without ``PYTHONPATH=.``); ValueError saying what is wrong."""
    module_name, sep, attr = spec.partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward function must be named 'module:function', got {spec!r}")
    cwd = os.getcwd()
    if cwd not in sys.path and "" not in sys.path:
        sys.path.append(cwd)  # after everything else: a file here never shadows an installed package
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"task.reward {spec!r}: cannot import module {module_name!r} from the working directory "
                         f"{cwd} or sys.path ({exc}); run from the directory holding {module_name.split('.')[0]}.py, "
                         "or add its directory to PYTHONPATH") from exc  # fmt: skip
    obj: Any = module
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise ValueError(f"task.reward {spec!r}: {module_name!r} has no attribute {attr!r}")
        obj = getattr(obj, part)
    if not callable(obj):
        raise ValueError(f"task.reward {spec!r} is not callable (it is a {type(obj).__name__})")
    return obj


def call_reward_fn(fn: RewardFn, text: str, metadata: Mapping[str, Any], name: str = "reward") -> Score:
    """Call a user's reward function and check what it returns."""
    out = fn(text, metadata)
    if isinstance(out, Mapping):
        if "reward" not in out:
            raise ValueError(f"{name} returned a mapping without a 'reward' key: {sorted(out)}")
        info = {str(k): _finite(v, f"{name}[{k!r}]") for k, v in out.items() if k != "reward"}
        return Score(reward=_finite(out["reward"], f"{name}['reward']"), info=info)
    return Score(reward=_finite(out, name))


def _finite(value: Any, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float, np.integer, np.floating)):
        raise ValueError(f"{what} must be a number, got {type(value).__name__} {value!r}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{what} must be finite, got {v}")
    return v


def positional_credit(response: str, target: str, *, strict_length: bool) -> Score:
    """Share of target positions the response gets right, the end of the answer counted as one more position.

    Strict (the default of every toy task): ``reward = (matches + length_ok) / (max(len(target), len(response))
    + 1)``, so 1.0 exactly when ``response == target``; a missing or extra character costs one position, and
    ending at the right place earns one position whatever the digits, which a policy can learn from the first
    step. Not strict: ``reward = matches / len(target)``: whatever follows a right prefix is ignored, so a
    response that never stops gets full credit. Components (logged as ``reward/<name>``): ``exact`` (1.0 when
    ``response == target``: the rate at which the task is solved) and ``length_ok`` (1.0 when the lengths match).
    """
    if not target:
        raise ValueError("positional_credit needs a non-empty target")
    matches = sum(1 for a, b in zip(response, target, strict=False) if a == b)
    length_ok = float(len(response) == len(target))
    if strict_length:
        reward = (matches + length_ok) / (max(len(target), len(response)) + 1)
    else:
        reward = matches / len(target)
    return Score(reward=reward, info={"exact": float(response == target), "length_ok": length_ok})
