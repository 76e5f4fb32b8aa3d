"""The scaling signal: how starved the learner is for rollouts, and how many generators would keep it busy.

The learner measures, per step, the time it waited for its batch (reading the rollout stream, issuing
prompts) and the time it trained, and the rollout backlog (groups appended and not yet read) when the step
ended, i.e. what waits for its next batch. Over the last ``window_steps`` steps:

* ``wait_share = waited / (waited + trained)``. Generators make ``B`` groups per learner cycle; for the
  learner never to wait they must make them in the training time alone, i.e. ``1 / (1 - wait_share)`` times
  as fast: **up** to ``ceil(N / (1 - wait_share))`` (at most doubling per decision) when
  ``wait_share > wait_share_high``.
* the smallest backlog of the window, in batches: when even that stays above ``backlog_high_batches`` and
  the learner hardly waits (``wait_share < wait_share_low``), generators are ahead of the learner (admission
  control then idles them): **down** by one generator.
* otherwise **hold**. The result is clamped to ``[min_generators, max_generators]``.

The learner sends it on NATS (:class:`~async_rl.servers.control.ScalingSignal`), keeps it in Redis for ``async-rl
status`` and exports it on ``/metrics``; docs/deploy.md wires it to KEDA, Ray and Slurm.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass


@dataclass(kw_only=True, slots=True)
class ScalingConfig:
    """The learner's scaling policy (thresholds of the signal it publishes; it scales nothing itself)."""

    window_steps: int = 10
    """Steps the wait share and the backlog are taken over."""
    wait_share_high: float = 0.2
    """Suggest more generators when the learner waits for rollouts more than this share of its time."""
    wait_share_low: float = 0.05
    """Suggest fewer only while it waits less than this share ..."""
    backlog_high_batches: float = 1.0
    """... and the rollout backlog stays above this many batches over the whole window."""
    min_generators: int = 1
    """Never suggest fewer."""
    max_generators: int = 0
    """Never suggest more (0: no cap)."""
    heartbeat_timeout_s: float = 10.0
    """A generator counts as alive while its last heartbeat is younger than this."""

    def __post_init__(self) -> None:
        if self.window_steps < 1:
            raise ValueError("learner.scaling.window_steps must be >= 1")
        if not 0 <= self.wait_share_low <= self.wait_share_high <= 1:
            raise ValueError("learner.scaling: need 0 <= wait_share_low <= wait_share_high <= 1")
        if self.backlog_high_batches < 0:
            raise ValueError("learner.scaling.backlog_high_batches must be >= 0")
        if self.min_generators < 0:
            raise ValueError("learner.scaling.min_generators must be >= 0")
        if self.max_generators and self.max_generators < self.min_generators:
            raise ValueError("learner.scaling.max_generators must be 0 (no cap) or >= min_generators")
        if self.heartbeat_timeout_s <= 0:
            raise ValueError("learner.scaling.heartbeat_timeout_s must be > 0")


@dataclass(frozen=True, slots=True)
class Suggestion:
    generators: int
    decision: str
    """'up' | 'down' | 'hold'."""
    reason: str


def suggest(cfg: ScalingConfig, *, generators: int, wait_share: float, min_backlog_batches: float) -> Suggestion:
    """The policy of the module docstring, for ``generators`` alive now."""
    n = max(generators, 0)
    if wait_share > cfg.wait_share_high:
        want = max(math.ceil(n / max(1.0 - wait_share, 1e-6)), n + 1)
        want = min(want, max(2 * n, 1))
        reason = f"learner waits {wait_share:.0%} of its time > {cfg.wait_share_high:.0%}"
    elif wait_share < cfg.wait_share_low and min_backlog_batches > cfg.backlog_high_batches and n > 0:
        want = n - 1
        reason = (f"backlog stayed above {cfg.backlog_high_batches:g} batches (min {min_backlog_batches:.2f}) and "
                  f"the learner waits {wait_share:.0%} < {cfg.wait_share_low:.0%}")  # fmt: skip
    else:
        want = n
        reason = f"learner waits {wait_share:.0%}, backlog min {min_backlog_batches:.2f} batches"
    clamped = max(want, cfg.min_generators)
    if cfg.max_generators:
        clamped = min(clamped, cfg.max_generators)
    if clamped != want:
        reason += f" (clamped to [{cfg.min_generators}, {cfg.max_generators or 'no cap'}])"
    return Suggestion(generators=clamped, decision="up" if clamped > n else "down" if clamped < n else "hold",
                      reason=reason)  # fmt: skip


class StarvationWindow:
    """Wait and train times and backlogs of the last ``window_steps`` steps."""

    __slots__ = ("waited_s", "trained_s", "backlogs")

    waited_s: deque[float]
    trained_s: deque[float]
    backlogs: deque[float]

    def __init__(self, window_steps: int) -> None:
        self.waited_s = deque(maxlen=window_steps)
        self.trained_s = deque(maxlen=window_steps)
        self.backlogs = deque(maxlen=window_steps)

    def add(self, waited_s: float, trained_s: float, backlog_batches: float) -> None:
        self.waited_s.append(max(waited_s, 0.0))
        self.trained_s.append(max(trained_s, 0.0))
        self.backlogs.append(max(backlog_batches, 0.0))

    @property
    def wait_share(self) -> float:
        total = sum(self.waited_s) + sum(self.trained_s)
        return sum(self.waited_s) / total if total > 0 else 0.0

    @property
    def min_backlog_batches(self) -> float:
        return min(self.backlogs, default=0.0)
