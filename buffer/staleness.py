"""Staleness policy: which groups a batch at learner version ``v`` may take.

A group's staleness is ``v - min_version`` (its oldest token's weight version). With bound ``S``:

* mode ``"drop"``: groups with ``min_version < v - S`` go to :attr:`Selection.drop`; the learner
  acks them with :meth:`buffer.rollouts.RolloutReader.ack_dropped` (counted as ``dropped_stale``),
  never silently;
* mode ``"keep"``: every group is kept for truncated IS to correct; those over the bound are
  counted (``Selection.metrics["num_over_bound"]``, and ``kept_stale`` when the learner records it).

Admission control (:class:`buffer.prompts.PromptQueue`) keeps staleness within ``S`` at the source
in normal running; this policy catches what slips past it (slow generators, a restarted learner).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Generic, Literal, Protocol, TypeVar

import numpy as np

from async_rl.wire.types import GroupRecord


@dataclass(kw_only=True, slots=True)
class StalenessConfig:
    """How stale a group may be when the learner trains on it."""

    max_staleness: int = 4
    """S: groups whose oldest token is more than S versions behind the learner are over the bound."""
    mode: Literal["drop", "keep"] = "drop"
    """``drop``: ack and count groups over the bound; ``keep``: train on them (TIS corrects) and count them."""
    sync: bool = False
    """Synchronous RL on the same processes (the baseline of ``async-rl bench async``): prompts are stamped with the
    learner's version and generators sample them only with that version, so nothing is stale and nothing overlaps:
    generators wait while the learner trains and publishes, the learner waits while they generate. Needs S = 0."""

    def __post_init__(self) -> None:
        if self.max_staleness < 0:
            raise ValueError("buffer.staleness.max_staleness must be >= 0")
        if self.sync and self.max_staleness != 0:
            raise ValueError(f"staleness.sync needs staleness.max_staleness=0, got {self.max_staleness}")
        if self.mode not in ("drop", "keep"):
            raise ValueError(f"buffer.staleness.mode must be 'drop' or 'keep', got {self.mode!r}")


class _HasRecord(Protocol):
    record: GroupRecord


E = TypeVar("E", bound=_HasRecord)


@dataclass(slots=True)
class Selection(Generic[E]):
    """Result of :meth:`StalenessPolicy.select`."""

    keep: list[E]
    """Entries to train on, in input order."""
    drop: list[E]
    """Entries over the bound in drop mode (to be acked as dropped)."""
    metrics: dict[str, float] = field(default_factory=dict)
    """num_groups, num_kept, num_dropped_stale, num_over_bound, staleness_max/mean (groups, by min_version)."""


class StalenessPolicy:
    """Applies a :class:`StalenessConfig` to entries that carry a ``record`` (e.g. RolloutEntry)."""

    cfg: StalenessConfig

    def __init__(self, cfg: StalenessConfig | None = None) -> None:
        self.cfg = cfg or StalenessConfig()

    def staleness(self, record: GroupRecord, learner_version: int) -> int:
        return learner_version - record.min_version

    def select(self, entries: Sequence[E], learner_version: int) -> Selection[E]:
        if learner_version < 0:
            raise ValueError(f"learner_version must be >= 0, got {learner_version}")
        floor = learner_version - self.cfg.max_staleness
        keep: list[E] = []
        drop: list[E] = []
        stale = np.array([learner_version - e.record.min_version for e in entries], dtype=np.int64)
        over = 0
        for e in entries:
            if e.record.min_version >= floor:
                keep.append(e)
                continue
            over += 1
            (drop if self.cfg.mode == "drop" else keep).append(e)
        metrics = {
            "num_groups": float(len(entries)),
            "num_kept": float(len(keep)),
            "num_dropped_stale": float(len(drop)),
            "num_over_bound": float(over),
            "staleness_max": float(stale.max()) if stale.size else 0.0,
            "staleness_mean": float(stale.mean()) if stale.size else 0.0,
        }
        return Selection(keep, drop, metrics)


def token_staleness(records: Sequence[GroupRecord], learner_version: int) -> np.ndarray:
    """Per-token staleness (``v - token version``) of every response token, for the histogram the learner logs."""
    parts = [learner_version - s.versions.astype(np.int64) for r in records for s in r.samples]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)
