"""Learning-rate schedules: the lr of optimizer step ``t`` as a pure function of ``t`` (torch-free).

A pure function of the step, not a stateful scheduler object: a backend sets the lr of each step from
the number of optimizer steps it has taken, and a checkpoint only has to carry that count for a
resumed learner to continue the schedule exactly where it stopped.

    warm-up  (t <= W):        lr · t / W
    constant (t > W):         lr
    cosine   (W < t <= W+D):  lr · (m + (1 - m) · (1 + cos(π (t - W) / D)) / 2), then lr · m
    linear   (W < t <= W+D):  lr · (1 - (1 - m) (t - W) / D), then lr · m

with ``W = lr_warmup_steps``, ``D = lr_decay_steps``, ``m = lr_min_ratio``; ``t`` counts from 1.
"""

from __future__ import annotations

import math
from typing import Literal

LrSchedule = Literal["constant", "cosine", "linear"]
LR_SCHEDULES: tuple[str, ...] = ("constant", "cosine", "linear")


def lr_factor(step: int, *, schedule: str, warmup_steps: int, decay_steps: int, min_ratio: float) -> float:
    """The multiplier of the base lr at optimizer step ``step`` (1-based; see the module docstring)."""
    if step < 1:
        raise ValueError(f"optimizer step must be >= 1, got {step}")
    if warmup_steps and step <= warmup_steps:
        return step / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / decay_steps) if decay_steps > 0 else 1.0
    if schedule == "cosine":
        return min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    if schedule == "linear":
        return 1.0 - (1.0 - min_ratio) * progress
    raise ValueError(f"lr schedule must be one of {list(LR_SCHEDULES)}, got {schedule!r}")
