"""Evaluation during training: every ``eval.interval_versions`` learner versions, the task's held-out prompts are
issued to the evaluation queue (:mod:`buffer.evals`, apart from training in every key) and their scores come back
as ``eval/<task>/...`` metrics in the learner's step rows (metrics.jsonl, wandb) and in ``async-rl status``.

A *round* is the task's first ``eval.num_prompts`` held-out prompts (:meth:`Task.eval_prompt`, the same ones every
round, so rounds compare), issued at learner version ``v`` with ``min_version`` = the newest version already handed
to the publisher (``v`` itself when it publishes every step): generators sample them with that version or newer,
greedily by default (``eval.temperature = 0``). A round is reported in the first step row
after all its prompts are scored (or, if some were dead-lettered, once a newer round is complete): the mean reward
and each reward component over its samples, how many prompts it had, its version and the oldest weight version
its tokens came from. The round bookkeeping (next round, results cursor, partial sums) lives in the learner
state's ``extra["eval"]``, saved with each checkpoint beside the rows it went into: a restarted learner neither
loses nor double-counts a result, and re-issues only the prompts of a round that are not open already. A prompt it
re-issues may have been answered already (its results not yet read when the checkpoint was taken): each prompt of a
round counts once, and a round once reported takes no more results.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from async_rl.wire.sampling import Sampling
from buffer.evals import GREEDY_KEY, ROUND_KEY

if TYPE_CHECKING:  # the learner's config imports this module: nothing heavy at import
    from actors.learner.checkpoint import LearnerState
    from async_rl.tasks.base import Task
    from buffer.evals import EvalQueue


@dataclass(kw_only=True, slots=True)
class EvalConfig:
    """Evaluation on held-out prompts during training (off while ``interval_versions`` is 0)."""

    interval_versions: int = 0
    """Issue an evaluation round at every learner version that is a multiple of this (0: no evaluation); the
    first round is at the start (version 0 or the resumed version's next multiple)."""
    num_prompts: int = 32
    """Held-out prompts per round (the task's first ``num_prompts`` of its held-out split)."""
    n: int = 1
    """Samples per evaluation prompt."""
    temperature: float = 0.0
    """Sampling temperature of evaluation (0: greedy)."""
    max_new_tokens: int = 0
    """Response budget (0: the training prompts' ``sampling.max_new_tokens``, else the task's own)."""

    def __post_init__(self) -> None:
        if self.interval_versions < 0:
            raise ValueError("learner.eval.interval_versions must be >= 0")
        if self.num_prompts < 1:
            raise ValueError("learner.eval.num_prompts must be >= 1")
        if self.n < 1:
            raise ValueError("learner.eval.n must be >= 1")
        if self.temperature < 0:
            raise ValueError("learner.eval.temperature must be >= 0 (0: greedy)")
        if self.max_new_tokens < 0:
            raise ValueError("learner.eval.max_new_tokens must be >= 0")


class Evaluator:
    """The learner's side of evaluation (see the module docstring)."""

    cfg: EvalConfig
    task: Task
    queue: EvalQueue
    state: LearnerState
    sampling: Sampling
    latest: dict[str, float]
    """The newest reported round's metrics (for ``status``)."""

    def __init__(self, cfg: EvalConfig, task: Task, queue: EvalQueue, state: LearnerState, sampling: Sampling) -> None:
        if cfg.interval_versions < 1:
            raise ValueError("Evaluator needs learner.eval.interval_versions >= 1")
        task.eval_prompt(0)  # ValueError now, at start, for a task without a held-out split
        self.cfg, self.task, self.queue, self.state = cfg, task, queue, state
        budget = cfg.max_new_tokens or sampling.max_new_tokens or task.max_new_tokens
        self.sampling = dataclasses.replace(sampling, n=cfg.n, max_new_tokens=budget,
                                            temperature=cfg.temperature or 1.0)  # fmt: skip
        self.latest = {}

    @property
    def _book(self) -> dict[str, Any]:
        """The round bookkeeping in the learner state (checkpointed with it)."""
        return self.state.extra.setdefault("eval", {"next_round": 0, "cursor": "0-0", "rounds": {}, "reported": -1})

    async def maybe_issue(self, version: int, min_version: int | None = None) -> int:
        """Issue a round when ``version`` has reached the next one due; returns the prompts issued.

        ``min_version``: the oldest weights its prompts may be sampled with (default ``version``). The learner passes
        the newest version already handed to the publisher: one that becomes visible without another step, so a
        generator waiting for it can never wait on training it is itself holding up."""
        book = self._book
        if version < book["next_round"]:
            return 0
        interval = self.cfg.interval_versions
        book["next_round"] = (version // interval + 1) * interval
        specs = []
        for j in range(self.cfg.num_prompts):
            spec = self.task.eval_prompt(j)
            meta = {**spec.metadata, ROUND_KEY: version, GREEDY_KEY: self.cfg.temperature == 0}
            specs.append(dataclasses.replace(spec, prompt_id=f"{spec.prompt_id}@v{version}", metadata=meta,
                                             sampling=self.sampling,
                                             min_version=version if min_version is None else min_version))  # fmt: skip
        book["rounds"].setdefault(str(version), _empty_round())
        return await self.queue.issue(specs, version)

    async def collect(self) -> dict[str, float]:
        """Read new results; the metrics of the newest round now complete (empty when none is)."""
        book = self._book
        results, book["cursor"] = await self.queue.results(book["cursor"])
        rounds: dict[str, dict[str, Any]] = book["rounds"]
        reported = int(book.get("reported", -1))
        for r in results:
            # A learner restarted from a checkpoint taken before its round's prompts were answered issues them again
            # (answered prompts are not open any more), so the same prompt can be answered twice: count each prompt of
            # a round once, and nothing of a round already reported.
            if r.round <= reported:
                continue
            rd = rounds.setdefault(str(r.round), _empty_round())
            seen = rd.setdefault("ids", [])
            if r.prompt_id in seen:
                continue
            seen.append(r.prompt_id)
            rd["label"] = r.label
            rd["prompts"] += 1
            rd["samples"] += len(r.rewards)
            rd["sums"]["reward"] = rd["sums"].get("reward", 0.0) + sum(r.rewards)
            for k, xs in r.info.items():
                rd["sums"][k] = rd["sums"].get(k, 0.0) + sum(xs)
            rd["min_version"] = r.min_version if rd["min_version"] < 0 else min(rd["min_version"], r.min_version)
        done = [int(v) for v, rd in rounds.items() if rd["prompts"] >= self.cfg.num_prompts]
        if not done:
            return {}
        newest = max(done)
        book["reported"] = newest
        report = rounds[str(newest)]
        for v in [v for v in rounds if int(v) <= newest]:  # older incomplete rounds (dead letters) are closed too
            del rounds[v]
        label = report["label"] or self.task.name
        n = max(report["samples"], 1)
        metrics = {f"eval/{label}/{k}": s / n for k, s in report["sums"].items()}
        metrics.update({f"eval/{label}/num_prompts": float(report["prompts"]), f"eval/{label}/version": float(newest),
                        f"eval/{label}/weights_version_min": float(report["min_version"])})  # fmt: skip
        self.latest = metrics
        return metrics


def _empty_round() -> dict[str, Any]:
    return {"label": "", "prompts": 0, "samples": 0, "sums": {}, "min_version": -1, "ids": []}
