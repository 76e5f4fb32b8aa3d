"""The environment interface: episodes of several turns, spoken in token ids.

An :class:`EnvTask` is a :class:`~async_rl.tasks.base.Task` whose prompts open episodes: the learner
issues its prompts as for any task, and a generator runs one :class:`Episode` per sample
(``actors/generator/episodes.py``): model turn, :meth:`Episode.step` with the model's tokens, the
environment's reply appended to the context, model turn, ... until the environment says ``done`` or
a limit ends it. What reaches the rollout stream is one sample per episode: every token in the
sequence, the environment's masked out of the loss (:attr:`async_rl.wire.types.Sample.loss_mask`).

Episodes speak token ids, so that the generator's sequence is exactly what the model saw; an
environment that speaks text encodes its replies with the tokenizer of the model (the adapters in
this package do). The episode's reward is the sum of the rewards its steps return; its ``info``
components (last value wins) go to the learner's metrics as ``reward/<name>`` like a task's score.
An exception from :meth:`Episode.step` (or from :meth:`EnvTask.episode`) ends that episode (``episode/end_env_error``)
and costs its group, which the generator dead-letters with the error (``actors/generator/scoring.py``); the generator
goes on.
"""

from __future__ import annotations

import abc
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from async_rl.tasks.base import Score, Task, row_of
from async_rl.wire import PromptSpec


@dataclass(slots=True)
class EnvReply:
    """What an environment answers to one model turn."""

    tokens: np.ndarray
    """int32 ``[k]``: token ids appended to the context before the next model turn (ignored when ``done``)."""
    reward: float = 0.0
    """Added to the episode's reward (most environments give it all on the last step)."""
    done: bool = False
    """The episode is over: no further model turn."""
    info: dict[str, float] = field(default_factory=dict)
    """Named components / task metrics (e.g. ``{"exact": 1.0}``), logged as ``reward/<name>``."""


class Episode(abc.ABC):
    """One running episode (one sample of a prompt's group); a fresh instance per episode."""

    @abc.abstractmethod
    async def step(self, action_ids: np.ndarray) -> EnvReply:
        """The environment's reply to the model's turn ``action_ids`` (int32, as sampled, end token included)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release what the episode holds (a sandbox, a connection); called once, however the episode ended."""


class EnvTask(Task):
    """A task whose prompts open episodes (see the module docstring)."""

    @abc.abstractmethod
    def episode(self, metadata: Mapping[str, Any]) -> Episode:
        """A new episode for the prompt whose metadata is ``metadata``."""

    def score(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> Score:
        raise TypeError(f"task {self.name!r} is an environment: its episodes are scored by their steps "
                        "(the generator runs them with actors/generator/episodes.py)")  # fmt: skip


class RowsEnvTask(EnvTask):
    """An environment task whose prompts are rows read up front (the adapters' JSONL files and datasets): prompt
    ``i`` is row ``i mod len(rows)``, reshuffled every epoch from ``(seed, epoch)`` when ``shuffle``."""

    rows: list[tuple[np.ndarray, dict[str, Any]]]
    """(prompt ids, metadata) per row."""
    eval_rows: Sequence[tuple[np.ndarray, dict[str, Any]]] = ()
    """The held-out split's rows, in order (evaluation: :meth:`eval_prompt`); none: evaluation is refused."""
    no_held_out: str = "set task.eval_jsonl_path"
    """What the line refusing evaluation without held-out rows says after the task's name."""
    seed: int
    shuffle: bool
    _max_new_tokens: int

    @property
    def num_prompts(self) -> int | None:
        return len(self.rows)

    @property
    def max_new_tokens(self) -> int:
        return self._max_new_tokens

    def prompt(self, index: int) -> PromptSpec:
        pos = row_of(index, len(self.rows), self.seed, self.shuffle)
        ids, meta = self.rows[pos]
        return PromptSpec(prompt_id=f"{self.name}-{self.seed}-{index}", prompt_ids=ids.copy(), metadata=dict(meta))

    def eval_prompt(self, index: int) -> PromptSpec:
        """Held-out row ``index`` (cycling through :attr:`eval_rows` in order); ValueError when there are none."""
        if not self.eval_rows:
            raise ValueError(f"task {self.name!r} has no held-out split: {self.no_held_out}")
        if index < 0:
            raise ValueError(f"eval prompt index must be >= 0, got {index}")
        ids, meta = self.eval_rows[index % len(self.eval_rows)]
        return PromptSpec(prompt_id=f"{self.name}-eval-{index}", prompt_ids=ids.copy(), metadata=dict(meta))


def as_tokens(ids: Any, what: str) -> np.ndarray:
    """``ids`` as a 1-D int32 array; ValueError naming ``what`` when it is not one."""
    arr = np.asarray(ids)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int32)
    if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
        raise ValueError(f"{what} must be a 1-D sequence of token ids, got {arr.dtype} {arr.shape}")
    return arr.astype(np.int32, copy=False)
