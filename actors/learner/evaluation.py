"""Evaluation during training: every ``eval.interval_versions`` learner versions, the held-out prompts of each evaluated
source are issued to the evaluation queue (:mod:`buffer.evals`, apart from training in every key) and their scores come
back as ``eval/<source>/...`` metrics in the learner's step rows (metrics.jsonl, wandb) and in ``async-rl status``.

A *source* is the task, or one member of a mixture (``task.mix``), named as in :func:`async_rl.tasks.config.source_of`;
``eval.sources`` chooses which (default: every one). A *round* is each source's first ``eval.num_prompts`` held-out
prompts (:meth:`Task.eval_prompt`, the same ones every round, so rounds compare), issued at learner version ``v`` with
``min_version`` = the newest version already handed to the publisher (``v`` itself when it publishes every step):
generators sample them with that version or newer, ``eval.n`` samples each, greedily by default (``eval.temperature =
0``). A round is reported in the first step row after all its prompts are scored (or, if some were dead-lettered, once
a newer round is complete), per source: the mean reward and each reward component, ``mean@n``, ``pass@k`` and
``maj@k`` for each ``k`` of ``eval.k`` (:mod:`async_rl.metrics.evaluation`), how many prompts it had, its version and
the oldest and newest weight versions its tokens came from. The round bookkeeping (next round, results cursor,
partial sums) lives in the learner state's ``extra["eval"]``, saved with each checkpoint beside the rows it went
into: a restarted learner neither loses nor double-counts a result, and re-issues only the prompts of a round that
are not open already. A prompt it re-issues may have been answered already (its results not yet read when the
checkpoint was taken): each prompt of a round counts once, and a round once reported takes no more results.

``async-rl eval`` (``actors/commands/evaluate.py``) scores a checkpoint or an exported model offline on the same
prompts (:func:`held_out_specs`) with the same sums.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from async_rl.metrics.evaluation import SourceScores
from async_rl.tasks.config import TaskConfig, sources_of
from async_rl.wire.sampling import Sampling
from buffer.evals import GREEDY_KEY, ROUND_KEY

if TYPE_CHECKING:  # the learner's config imports this module: nothing heavy at import
    from actors.learner.checkpoint import LearnerState
    from async_rl.tasks.base import Task
    from async_rl.wire import PromptSpec
    from buffer.evals import EvalQueue, EvalResult


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
    sources: list[str] = field(default_factory=list)
    """The sources whose held-out splits a round evaluates, each reported as ``eval/<source>/...``: the task's source
    (``task.source``: the reasoning-gym dataset, else the task's name) or members of ``task.mix`` by their source
    (a member of weight 0 is evaluated, never trained on); empty: every source."""
    k: list[int] = field(default_factory=list)
    """The k of ``pass@k`` and ``maj@k``, each in [1, n] (empty: 1 and n)."""
    pass_threshold: float = 1.0
    """The reward from which a sample counts as correct for ``pass@k`` (1.0: the whole reward)."""

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
        if any(not 1 <= k <= self.n for k in self.k):
            raise ValueError(f"learner.eval.k must each be in [1, {self.n}] (1 to eval.n), got {self.k}")
        if len(set(self.sources)) != len(self.sources):
            raise ValueError(f"learner.eval.sources names a source twice: {self.sources}")

    @property
    def ks(self) -> tuple[int, ...]:
        """The k of ``pass@k`` and ``maj@k``: ``k``, else 1 and n."""
        return tuple(sorted(set(self.k or (1, self.n))))


def eval_sources(cfg: EvalConfig, task: TaskConfig) -> list[str]:
    """The sources a round evaluates (``eval.sources``, else every source of ``task``); ValueError naming one the
    task does not have, or one whose task has no held-out split as far as its config tells."""
    from async_rl.tasks.config import held_out_missing

    known = sources_of(task)
    for source in cfg.sources:
        if source not in known:
            raise ValueError(f"learner.eval.sources: {source!r} is not a source of the task (its sources: "
                             f"{', '.join(known)})")  # fmt: skip
    chosen = cfg.sources or list(known)
    for source in chosen:
        why = held_out_missing(known[source])
        if why is not None:
            member = f" (source {source!r} of task.mix)" if task.mix else ""
            raise ValueError(f"evaluation needs held-out prompts: task.name {known[source].name!r}{member} "
                             f"{why}")  # fmt: skip
    return chosen


def eval_sampling(cfg: EvalConfig, sampling: Sampling, task: Task) -> Sampling:
    """How a round's prompts are sampled: ``eval.n`` samples, ``eval.temperature`` (1.0 stands for greedy, which
    the prompts' metadata asks for), the evaluation's response budget."""
    budget = cfg.max_new_tokens or sampling.max_new_tokens or task.max_new_tokens
    return dataclasses.replace(sampling, n=cfg.n, max_new_tokens=budget, temperature=cfg.temperature or 1.0)


def held_out_specs(task: Task, sources: Sequence[str], num_prompts: int) -> list[PromptSpec]:
    """Each source's first ``num_prompts`` held-out prompts, labelled with their source, sources in order (ValueError
    for a source without a held-out split)."""
    from async_rl.tasks.mixture import held_out_prompt

    return [held_out_prompt(task, source, j) for source in sources for j in range(num_prompts)]


def add_result(scores: SourceScores, result: EvalResult, cfg: EvalConfig) -> None:
    """One scored prompt into its source's sums."""
    scores.add(result.rewards, result.info, result.answers or [None] * len(result.rewards), ks=cfg.ks,
               pass_threshold=cfg.pass_threshold, min_version=result.min_version, max_version=result.max_version)  # fmt: skip


class Evaluator:
    """The learner's side of evaluation (see the module docstring)."""

    cfg: EvalConfig
    task: Task
    sources: list[str]
    """The sources each round evaluates, in order."""
    queue: EvalQueue
    state: LearnerState
    sampling: Sampling
    latest: dict[str, float]
    """The newest reported round's metrics (for ``status``)."""

    def __init__(self, cfg: EvalConfig, task: Task, queue: EvalQueue, state: LearnerState, sampling: Sampling,
                 sources: Sequence[str] | None = None) -> None:  # fmt: skip
        """``sources``: the sources to evaluate (:func:`eval_sources`; None: the task's name, a task that is its own
        one source)."""
        if cfg.interval_versions < 1:
            raise ValueError("Evaluator needs learner.eval.interval_versions >= 1")
        self.cfg, self.task, self.queue, self.state = cfg, task, queue, state
        self.sources = list(sources or [task.name])
        held_out_specs(task, self.sources, 1)  # ValueError now, at start, for a source without a held-out split
        self.sampling = eval_sampling(cfg, sampling, task)
        self.latest = {}

    @property
    def _book(self) -> dict[str, Any]:
        """The round bookkeeping in the learner state (checkpointed with it)."""
        book = self.state.extra.setdefault("eval", {"next_round": 0, "cursor": "0-0", "rounds": {}, "reported": -1})
        rounds = book.setdefault("rounds", {})
        for v in [v for v, rd in rounds.items() if "sources" not in rd]:  # a round of an older learner's layout
            del rounds[v]
        return book

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
        for spec in held_out_specs(self.task, self.sources, self.cfg.num_prompts):
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
            # a round once, and nothing of a round already reported. A source not evaluated now (another config's
            # round) counts nowhere.
            if r.round <= reported or r.label not in self.sources:
                continue
            rd = rounds.setdefault(str(r.round), _empty_round())
            if r.prompt_id in rd["ids"]:
                continue
            rd["ids"].append(r.prompt_id)
            scores = SourceScores.from_json(rd["sources"].get(r.label) or {})
            add_result(scores, r, self.cfg)
            rd["sources"][r.label] = scores.to_json()
        done = [int(v) for v, rd in rounds.items() if self._complete(rd)]
        if not done:
            return {}
        newest = max(done)
        book["reported"] = newest
        report = rounds[str(newest)]
        for v in [v for v in rounds if int(v) <= newest]:  # older incomplete rounds (dead letters) are closed too
            del rounds[v]
        metrics: dict[str, float] = {}
        for source in self.sources:
            got = SourceScores.from_json(report["sources"].get(source) or {}).metrics()
            metrics.update({f"eval/{source}/{k}": v for k, v in got.items()})
            if got:
                metrics[f"eval/{source}/version"] = float(newest)
        self.latest = metrics
        return metrics

    def _complete(self, rd: dict[str, Any]) -> bool:
        """Every source of the round has all its prompts scored."""
        return all(rd["sources"].get(s, {}).get("prompts", 0) >= self.cfg.num_prompts for s in self.sources)


def _empty_round() -> dict[str, Any]:
    return {"sources": {}, "ids": []}
