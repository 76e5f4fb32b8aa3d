"""Several tasks in one run (``task.mix``): each prompt drawn from one member by weight, labelled with its source.

* **Drawn by weight, from the seed alone.** Which member serves prompt ``i`` is drawn in chunks of :data:`CHUNK`
  prompts, chunk ``c`` from ``numpy.random.default_rng([seed, c, MIX_STREAM])`` with the members' weights as
  probabilities; a member's own prompt index is how many prompts it served before ``i``. Both depend only on the
  seed and ``i``, so the learner resumes its prompt stream by index, as with one task (counting what came before
  costs one draw per chunk, once). A member of weight 0 serves no training prompt; its held-out split can still be
  evaluated (``learner.eval.sources``).
* **Labelled.** Every prompt carries its member's source in its metadata (:data:`SOURCE_KEY`) and in its id
  (``<source>/<member's id>``, unique across members); generators hand it to that member
  (:meth:`MixtureTask.task_for`: its scorer, its episodes), the groups carry the source back, and the learner reports
  them per source (``train/<source>/...``).
* **One response budget.** The mixture's ``max_new_tokens`` is its members' largest (a prompt's sampling is the
  run's); each member's scorer reads its answer as it would alone.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from async_rl.tasks.base import Score, Task
from async_rl.wire import PromptSpec

SOURCE_KEY = "source"
"""Metadata key of a prompt (and of its group record): the source it was drawn from."""
CHUNK = 4096
"""Prompts whose members are drawn at once (one generator call each): resuming at prompt i draws i / CHUNK chunks."""
MIX_STREAM = 0x6D6978
"""Third word of a chunk's seed sequence ("mix"): the draw is a stream of its own beside the members' seeds."""
SOURCE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.+-]*")
"""What a source may be called: it becomes a piece of metric names (``eval/<source>/pass@1``)."""


def check_members(sources: Sequence[str], weights: Sequence[float]) -> None:
    """ValueError naming the member (``task.mix[j]``) unless every source is a name of its own and the weights are
    finite, >= 0, and not all 0."""
    if not sources:
        raise ValueError("task.mix needs at least one member")
    for j, (source, weight) in enumerate(zip(sources, weights, strict=True)):
        if not SOURCE_NAME.fullmatch(source):
            raise ValueError(f"task.mix[{j}].source {source!r} must be letters, digits, '_', '.', '+' or '-' (it "
                             "names metrics)")  # fmt: skip
        if list(sources).index(source) != j:
            raise ValueError(f"task.mix[{j}].source {source!r} is task.mix[{list(sources).index(source)}]'s too: "
                             "give each member a source of its own (task.mix[j].source)")  # fmt: skip
        if not (weight >= 0 and math.isfinite(weight)):
            raise ValueError(f"task.mix[{j}].weight must be a finite number >= 0, got {weight}")
    if not sum(weights) > 0:
        raise ValueError("task.mix: every member has weight 0; at least one must serve training prompts")


def labelled(source: str, spec: PromptSpec) -> PromptSpec:
    """``spec`` of ``source``'s task with the source in its metadata (a copy)."""
    spec.metadata = {**spec.metadata, SOURCE_KEY: source}
    return spec


class MixtureTask(Task):
    """Prompts from several tasks by weight (see the module docstring)."""

    name = "mix"
    seed: int
    sources: tuple[str, ...]
    """The members' source names, in order."""
    members: dict[str, Task]
    """Source -> its task."""
    probabilities: np.ndarray
    """Each member's share of the training prompts (the weights, normalized)."""
    _served_before: list[np.ndarray]
    """``[c]``: prompts each member served before chunk ``c`` (grown as far as asked)."""
    _chunk: tuple[int, np.ndarray]
    """The chunk drawn last and its members (the learner asks for prompts in order)."""

    def __init__(self, members: Sequence[tuple[str, float, Task]], *, seed: int = 0) -> None:
        """``members``: (source, weight, task) of each member."""
        sources = [s for s, _, _ in members]
        check_members(sources, [w for _, w, _ in members])
        weights = np.asarray([w for _, w, _ in members], dtype=np.float64)
        self.seed, self.sources = seed, tuple(sources)
        self.members = {s: t for s, _, t in members}
        self.probabilities = weights / weights.sum()
        self._served_before = [np.zeros(len(members), dtype=np.int64)]
        self._chunk = (-1, np.zeros(0, dtype=np.int64))

    @property
    def num_prompts(self) -> int | None:
        return None

    @property
    def max_new_tokens(self) -> int:
        return max(t.max_new_tokens for t in self.members.values())

    def _draw(self, c: int) -> np.ndarray:
        """The member of each prompt of chunk ``c``."""
        rng = np.random.default_rng([self.seed, c, MIX_STREAM])
        return rng.choice(len(self.sources), size=CHUNK, p=self.probabilities)

    def member_index(self, index: int) -> tuple[int, int]:
        """Which member serves prompt ``index`` of the mixture, and that member's own prompt index."""
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        c, pos = divmod(index, CHUNK)
        while len(self._served_before) <= c:
            k = len(self._served_before) - 1
            self._served_before.append(self._served_before[k] + np.bincount(self._draw(k), minlength=len(self.sources)))
        if self._chunk[0] != c:
            self._chunk = (c, self._draw(c))
        drawn = self._chunk[1]
        j = int(drawn[pos])
        return j, int(self._served_before[c][j] + np.count_nonzero(drawn[:pos] == j))

    def prompt(self, index: int) -> PromptSpec:
        j, k = self.member_index(index)
        source = self.sources[j]
        spec = self.members[source].prompt(k)
        spec.prompt_id = f"{source}/{spec.prompt_id}"
        return labelled(source, spec)

    def eval_prompt_of(self, source: str, index: int) -> PromptSpec:
        """Held-out prompt ``index`` of member ``source``, labelled (ValueError when the member has no held-out
        split)."""
        spec = self.member(source).eval_prompt(index)
        spec.prompt_id = f"{source}/{spec.prompt_id}"
        return labelled(source, spec)

    def eval_prompt(self, index: int) -> PromptSpec:
        raise ValueError("a mixture has no held-out split of its own: evaluation takes each source's "
                         "(learner.eval.sources)")  # fmt: skip

    def member(self, source: str) -> Task:
        """The task of ``source``; ValueError naming the sources when there is none."""
        task = self.members.get(source)
        if task is None:
            raise ValueError(f"task.mix has no source {source!r} (its sources: {', '.join(self.sources)})")
        return task

    def task_for(self, metadata: Mapping[str, Any]) -> Task:
        source = metadata.get(SOURCE_KEY)
        if not isinstance(source, str):
            raise ValueError(f"a prompt of task.mix has no {SOURCE_KEY!r} in its metadata: {dict(metadata)}")
        return self.member(source).task_for(metadata)

    def score(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> Score:
        return self.task_for(metadata).score(metadata, response_ids)

    def answer(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> str | None:
        return self.task_for(metadata).answer(metadata, response_ids)

    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        """As the first member shows it (the members share the model's tokenizer)."""
        return self.members[self.sources[0]].prompt_text(prompt_ids)


def held_out_prompt(task: Task, source: str, index: int) -> PromptSpec:
    """Held-out prompt ``index`` of ``source``: a mixture's member's, or the task's own (its one source), labelled."""
    if isinstance(task, MixtureTask):
        return task.eval_prompt_of(source, index)
    return labelled(source, task.eval_prompt(index))
