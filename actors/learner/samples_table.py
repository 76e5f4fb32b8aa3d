"""A few of a step's trained samples as text, every ``samples_table.every_steps`` steps (``learner.samples_table``).

The rows ride in the step's metrics row under :data:`~async_rl.metrics.sinks.SAMPLES_KEY`, so they are written when
the step is committed, with its metrics, once across restarts (:mod:`actors.learner.loop`; a learner killed between
the two writes of one step repeats that step's sample lines): to
``<run_dir>/samples.jsonl`` and as the wandb table ``samples_table`` (:class:`~async_rl.metrics.sinks.MetricsLogger`).
Each row: the step and the learner's version after it, the prompt and the response as the model read and wrote them
(:mod:`async_rl.tasks.transcript`: special tokens shown, an environment's turns marked), the reward and its
components, the advantage the sample was trained with, and the weight versions of its tokens.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from async_rl.algorithms import compute_advantages
from async_rl.algorithms.config import AlgorithmConfig
from async_rl.tasks.base import Task
from async_rl.tasks.transcript import group_rows
from async_rl.wire.types import GroupRecord


@dataclass(kw_only=True, slots=True)
class SamplesTableConfig:
    """Which trained samples the learner logs as text (``learner.samples_table``)."""

    every_steps: int = 10
    """Log a table of trained samples every this many steps (0: never): ``<run_dir>/samples.jsonl`` and the wandb
    table ``samples_table``."""
    num_samples: int = 4
    """Samples per table: the first sample of each of the step's first groups, then the second of each, and so on."""

    def __post_init__(self) -> None:
        if self.every_steps < 0:
            raise ValueError(f"learner.samples_table.every_steps must be >= 0, got {self.every_steps}")
        if self.num_samples < 1:
            raise ValueError(f"learner.samples_table.num_samples must be >= 1, got {self.num_samples}")

    def due(self, step: int) -> bool:
        """Whether step ``step`` logs a table."""
        return self.every_steps > 0 and step % self.every_steps == 0


def table_rows(groups: list[GroupRecord], task: Task, algorithm: AlgorithmConfig, *, version: int, num_samples: int
               ) -> list[dict[str, Any]]:  # fmt: skip
    """Rows of ``num_samples`` samples of ``groups`` taken across groups (sample 0 of each group, then sample 1...),
    each with the advantage it was trained with (group-relative: the group's own rewards give it exactly)."""
    picks: list[tuple[int, int]] = []
    for i in range(max((len(g.samples) for g in groups), default=0)):
        picks += [(gi, i) for gi, g in enumerate(groups) if i < len(g.samples)]
    picks = picks[:num_samples]
    rows: dict[int, list[dict[str, Any]]] = {}
    out = []
    for gi, i in picks:
        if gi not in rows:
            g = groups[gi]
            rewards = np.array([s.reward for s in g.samples], dtype=np.float64)
            [advantages], _ = compute_advantages([rewards], algorithm)
            rows[gi] = group_rows(g, task, [float(a) for a in advantages])
        out.append({"version": version, **rows[gi][i]})
    return out
