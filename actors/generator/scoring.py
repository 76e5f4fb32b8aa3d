"""Scoring that fails stays small: a reward or an environment that raises costs its group, never the generator.

A task's own code runs on every sample: ``task.reward``'s function (or a built-in scorer on the prompt's metadata),
an environment's steps. When it raises on a sample (``KeyError: 'answr'`` from ``metadata["answr"]``):

* the sample scores as an error, and its whole group goes to the dead letters with the error
  (:meth:`buffer.prompts.PromptQueue.dead_letter`: the prompt acked, its fate ``dead_lettered``, one transaction):
  a group with a reward missing has no advantages to train on, and the same prompt would fail again anywhere;
* it is counted per reason (where, the exception's type and the line that raised it:
  ``task.reward='myreward:score' raised KeyError at myreward.py:7``), in :attr:`Scoring.counts` and the
  Prometheus counter ``async_rl_generator_scoring_errors_total{reason}``;
* it is logged once per reason with its first traceback, then summed every 30 s
  (:class:`~async_rl.process.repeated.RepeatedLine`);
* the generator goes on. Only when every sample of ``max_failed_groups`` groups in a row failed (the reward is
  broken, not one odd input) does it exit 1 with one line naming ``task.reward`` (``task.env``) and the error
  (:class:`ScoringFailed`).

An environment that times out is not an error of its code: its episode ends ``env_timeout`` as before
(:mod:`actors.generator.episodes`).
"""

from __future__ import annotations

import logging
import traceback
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from actors.generator.engine import Completion
from actors.generator.metrics import GeneratorMetrics
from async_rl.process.repeated import RepeatedLine
from async_rl.tasks import Task, TaskConfig
from async_rl.tasks.config import ENV_TASKS
from async_rl.tasks.mixture import SOURCE_KEY
from async_rl.wire.types import Sample
from buffer.dead_letters import error_line
from buffer.evals import ROUND_KEY, EvalResult
from buffer.prompts import PromptEntry

log = logging.getLogger(__name__)


class ScoringFailed(RuntimeError):
    """Every sample of ``max_failed_groups`` groups in a row failed to score; the message is the generator's line."""


@dataclass(slots=True)
class ScoredGroup:
    """One prompt's samples as scored, with the errors of those whose scoring raised."""

    samples: list[Sample]
    reasons: list[str] = field(default_factory=list)
    """The reason of each sample whose scoring raised (:meth:`Scoring.failed`)."""
    first_error: BaseException | None = None

    @property
    def failed(self) -> bool:
        return bool(self.reasons)

    def dead_letter_reason(self) -> str:
        """What the dead letter says: the first reason, on how many of the samples."""
        return f"scoring failed on {len(self.reasons)} of {len(self.samples)} samples: {self.reasons[0]}"


def _where(exc: BaseException) -> str:
    """``file.py:line`` of the innermost frame of ``exc``'s traceback (the code that raised)."""
    frames = traceback.extract_tb(exc.__traceback__)
    return f"{Path(frames[-1].filename).name}:{frames[-1].lineno}" if frames else "?"


class Scoring:
    """The scoring errors of one generator: counted, logged once per reason, judged group by group."""

    key: str
    """The config key to fix: ``task.reward``, or ``task.env`` for environment tasks."""
    what: str
    """The code that scores, as the user set it (``task.reward='myreward:score'``)."""
    max_failed_groups: int
    counts: dict[str, int]
    """Samples whose scoring raised, per reason."""
    failed_in_row: int
    """Groups in a row whose every sample failed."""
    _lines: dict[str, RepeatedLine]
    _metrics: GeneratorMetrics | None

    def __init__(self, task: TaskConfig, max_failed_groups: int, metrics: GeneratorMetrics | None = None) -> None:
        if task.mix:
            self.key, self.what = "task.mix", "the scorer or environment of a task.mix member"
        elif task.name in ENV_TASKS:
            self.key = "task.env"
            self.what = f"the environment of task.name={task.name}" + (f" (task.env.id={task.env.id!r})"
                                                                         if task.env.id else "")  # fmt: skip
        else:
            self.key = "task.reward"
            self.what = (f"task.reward={task.reward!r}" if task.reward
                         else f"task.reward='' (the {task.name} task's own scorer)")  # fmt: skip
        self.max_failed_groups = max_failed_groups
        self.counts, self.failed_in_row, self._lines, self._metrics = {}, 0, {}, metrics

    def failed(self, exc: BaseException) -> str:
        """Count a sample whose scoring raised ``exc`` and log it (once per reason, then summed); its reason."""
        reason = f"{self.what} raised {type(exc).__name__} at {_where(exc)}"
        self.counts[reason] = self.counts.get(reason, 0) + 1
        line = self._lines.get(reason)
        if line is None:  # its first error's message stands for the reason's (same code, same exception type)
            first = error_line(exc).replace("{", "{{").replace("}", "}}")
            line = self._lines[reason] = RepeatedLine(
                log, f"scoring raised on {{n}} sample(s): {reason}: {first}; their groups go to the dead letters, "
                     "the generator goes on", level=logging.WARNING)  # fmt: skip
        line.add(exc_info=exc)  # the traceback goes with the first line of this reason only
        if self._metrics is not None:
            self._metrics.scoring_error(reason)
        return reason

    def flush(self) -> None:
        """Log what each reason counted since its last line (the generator's last words)."""
        for line in self._lines.values():
            line.flush()

    def score(self, task: Task, metadata: Mapping[str, Any], completions: list[Completion]) -> ScoredGroup:
        """Score a single-turn group: one sample per completion, an error costing only its own score."""
        group = ScoredGroup(samples=[])
        for c in completions:
            try:
                score = task.score(metadata, c.token_ids)
                reward, info = float(score.reward), dict(score.info)
            except Exception as exc:  # the task's code: the group is dead-lettered, the generator goes on
                group.reasons.append(self.failed(exc))
                group.first_error = group.first_error or exc
                reward, info = 0.0, {}
            group.samples.append(Sample(
                response_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions, reward=reward,
                finish_reason=c.finish_reason, routes=c.routes, reward_info=info,
            ))  # fmt: skip
        return group

    def eval_result(self, task: Task, entry: PromptEntry, samples: list[Sample], generator_id: str) -> EvalResult:
        """The result of an evaluation prompt: its samples' rewards, components and answers, under its source."""
        meta = entry.spec.metadata
        versions = [int(v) for s in samples for v in np.asarray(s.versions).tolist()] or [-1]
        return EvalResult(
            prompt_id=entry.spec.prompt_id, round=int(meta.get(ROUND_KEY, entry.issued_version)),
            label=str(meta.get(SOURCE_KEY) or meta.get("dataset") or meta.get("task") or task.name),
            rewards=[float(s.reward) for s in samples], answers=self.answers(task, meta, samples),
            info={k: [float(s.reward_info.get(k, 0.0)) for s in samples] for k in samples[0].reward_info},
            min_version=min(versions), max_version=max(versions), generator_id=generator_id,
        )  # fmt: skip

    def answers(self, task: Task, metadata: Mapping[str, Any], samples: list[Sample]) -> list[str | None]:
        """Each evaluated sample's answer (:meth:`Task.answer`, evaluation's ``maj@k``); an ``answer`` that raises
        costs the prompt's votes only, counted and logged as a scoring error."""
        try:
            return [task.answer(metadata, s.response_ids) for s in samples]
        except Exception as exc:  # the task's code: no votes for this prompt, the generator goes on
            self.failed(exc)
            return [None] * len(samples)

    def episodes(self, samples: list[Sample], errors: list[BaseException]) -> ScoredGroup:
        """A group of episodes, with the errors its environment raised (one at most per episode: it ends there)."""
        reasons = [self.failed(exc) for exc in errors]
        return ScoredGroup(samples=samples, reasons=reasons, first_error=errors[0] if errors else None)

    def judge(self, group: ScoredGroup) -> None:
        """After a group is pushed or dead-lettered: count it towards the limit, and raise :class:`ScoringFailed`
        once every sample of ``max_failed_groups`` groups in a row failed."""
        whole = group.failed and len(group.reasons) == len(group.samples)
        self.failed_in_row = self.failed_in_row + 1 if whole else 0
        if self.max_failed_groups and self.failed_in_row >= self.max_failed_groups:
            first = group.first_error
            raise ScoringFailed(
                f"every sample of the last {self.failed_in_row} groups failed to score: {group.reasons[0]}: "
                f"{error_line(first) if first is not None else '?'} (fix {self.key}; the groups are in the dead "
                f"letters, and max_failed_groups={self.max_failed_groups} sets this limit)")  # fmt: skip
