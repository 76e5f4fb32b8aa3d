"""End to end with episodes of several turns: the ``tool_copy`` environment (call a tool for hidden digits, then
copy them) trains with a real learner and generator process against real Redis and NATS, and its reward rises.

The rollouts the learner trained on carry loss masks (environment tokens in the sequence, out of the loss), and
every episode ended because the environment said so (``reward/episode/end_done``)."""

from __future__ import annotations

import numpy as np
import pytest

from tests.integration.procs import Procs

pytestmark = pytest.mark.slow

STEPS = 30
TASK = ["task.name=tool_copy", "task.min_digits=2", "task.max_digits=2"]


def test_tool_copy_reward_rises(procs: Procs) -> None:
    """Threshold: the mean reward of the last 5 of 30 steps beats the first 5 by 0.1. A random policy calls the
    tool in about a fifth of its first turns (reward ~0.15); calling it is worth 0.5, learnt within a few dozen
    steps of 8 groups x 8 episodes."""
    procs.learner(f"max_steps={STEPS}", *TASK)
    procs.generator("gen-0", *TASK, "episode.max_turns=4", "episode.max_tokens=32")
    procs.wait_for(f"{STEPS} learner steps", lambda: procs.procs["learner"].poll() is not None, timeout_s=300)
    assert procs.procs["learner"].returncode == 0, procs.tails()
    rows = procs.metrics()
    assert len(rows) == STEPS
    rewards = [r["reward"] for r in rows]
    first, last = float(np.mean(rewards[:5])), float(np.mean(rewards[-5:]))
    assert last > first + 0.1, f"reward did not improve: first {first:.3f} last {last:.3f}\n{rewards}"
    called = [r["reward/called"] for r in rows]
    assert np.mean(called[-5:]) > np.mean(called[:5]), called
    assert all(r["reward/episode/end_done"] == 1.0 for r in rows)  # every episode ran to the environment's end
    assert all(r["reward/episode/turns"] == 2.0 and r["reward/episode/env_tokens"] >= 1.0 for r in rows)
    # Environment tokens are out of the loss: each step trains on fewer tokens than its sequences' responses.
    assert all(r["loss/loss_tokens_count"] < r["tokens"] - r["samples"] * 2 for r in rows)
