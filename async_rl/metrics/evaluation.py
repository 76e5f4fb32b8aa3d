"""Scores of an evaluation, per source: ``mean@n``, ``pass@k`` (unbiased) and ``maj@k`` from each prompt's samples.

A prompt's ``n`` samples each have a reward (and its components) and, where the task extracts one
(:meth:`~async_rl.tasks.base.Task.answer`), an answer. Per prompt, then averaged over the source's prompts:

* ``mean@n``: the mean reward of its ``n`` samples (verl's ``mean@N``); beside it ``reward`` and each reward
  component, means over all samples (equal to ``mean@n`` when every prompt has ``n``);
* ``pass@k``: the chance that ``k`` samples drawn from the ``n`` without replacement hold a correct one, a sample
  being correct when its reward reaches the pass threshold (``eval.pass_threshold``, 1.0: the whole reward): the
  unbiased estimator ``1 - C(n - c, k) / C(n, k)`` of Chen et al. (2021, "Evaluating Large Language Models Trained
  on Code"), ``c`` the correct samples among the ``n``;
* ``maj@k``: the reward of the majority answer among the first ``k`` samples (the answer given most often, a tie
  going to the one given first; a sample without an answer does not vote), scored by the reward of the first sample
  that gave it; 0 when none of the ``k`` has an answer. Reported only for a source some of whose samples had
  answers (a task whose answers do not compare has none).

The learner's evaluation rounds (``actors/learner/evaluation.py``) and ``async-rl eval`` accumulate with the same
:class:`SourceScores`, so both report the same numbers for the same samples.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any


def pass_at_k(n: int, c: int, k: int) -> float:
    """``1 - C(n - c, k) / C(n, k)``: the chance that ``k`` of ``n`` samples, ``c`` of them correct, drawn without
    replacement, hold a correct one."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def majority(answers: Sequence[str | None], rewards: Sequence[float], k: int) -> float:
    """The reward of the majority answer among the first ``k`` samples (module docstring); 0.0 when none votes."""
    votes: dict[str, int] = {}
    first: dict[str, float] = {}
    for answer, reward in zip(answers[:k], rewards[:k], strict=True):
        if answer is not None:
            votes[answer] = votes.get(answer, 0) + 1
            first.setdefault(answer, reward)
    if not votes:
        return 0.0
    winner = max(votes, key=lambda a: votes[a])  # max keeps the first of equal counts: the answer given first
    return first[winner]


@dataclass(slots=True)
class SourceScores:
    """The running sums of one source's scored prompts (JSON-able: a learner keeps them in its checkpoint)."""

    prompts: int = 0
    """Prompts scored."""
    samples: int = 0
    """Samples scored."""
    voted: int = 0
    """Prompts some of whose samples had an answer."""
    per_sample: dict[str, float] = field(default_factory=dict)
    """Sums over samples: ``reward`` and each component."""
    per_prompt: dict[str, float] = field(default_factory=dict)
    """Sums over prompts: ``mean@n``, ``pass@k``, ``maj@k``."""
    min_version: int = -1
    """Oldest weight version among the samples' tokens (-1: none yet)."""
    max_version: int = -1
    """Newest weight version among the samples' tokens."""

    def add(self, rewards: Sequence[float], info: Mapping[str, Sequence[float]], answers: Sequence[str | None], *,
            ks: Sequence[int], pass_threshold: float, min_version: int = -1, max_version: int = -1) -> None:  # fmt: skip
        """One prompt's samples: their rewards, reward components and answers (None: no answer)."""
        n = len(rewards)
        if not n or len(answers) != n:
            raise ValueError(f"a scored prompt needs rewards and one answer per sample, got {n} and {len(answers)}")
        self.prompts += 1
        self.samples += n
        _add(self.per_sample, "reward", sum(rewards))
        for name, values in info.items():
            _add(self.per_sample, name, sum(values))
        _add(self.per_prompt, f"mean@{n}", sum(rewards) / n)
        correct = sum(r >= pass_threshold for r in rewards)
        has_answers = any(a is not None for a in answers)
        self.voted += has_answers
        for k in ks:
            if k <= n:
                _add(self.per_prompt, f"pass@{k}", pass_at_k(n, correct, k))
                _add(self.per_prompt, f"maj@{k}", majority(answers, rewards, k))
        if min_version >= 0:
            self.min_version = min_version if self.min_version < 0 else min(self.min_version, min_version)
            self.max_version = max(self.max_version, max_version)

    def metrics(self) -> dict[str, float]:
        """The source's scores by name (``reward``, components, ``mean@n``, ``pass@k``, ``maj@k``, ``num_prompts``,
        ``weights_version_min``, ``weights_version_max``); empty before any prompt."""
        if not self.prompts:
            return {}
        out = {k: s / self.samples for k, s in self.per_sample.items()}
        out.update({k: s / self.prompts for k, s in self.per_prompt.items() if self.voted or not k.startswith("maj@")})
        out.update({"num_prompts": float(self.prompts), "weights_version_min": float(self.min_version),
                    "weights_version_max": float(self.max_version)})  # fmt: skip
        return out

    def to_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> SourceScores:
        return cls(**data)


def _add(sums: dict[str, float], key: str, value: float) -> None:
    sums[key] = sums.get(key, 0.0) + float(value)
