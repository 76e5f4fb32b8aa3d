"""The scaling policy (async_rl/metrics/scaling.py): up on a starved learner, down on a backlog that stays, clamps."""

from __future__ import annotations

import pytest

from async_rl.metrics.scaling import ScalingConfig, StarvationWindow, suggest

CFG = ScalingConfig(wait_share_high=0.2, wait_share_low=0.05, backlog_high_batches=1.0, min_generators=1)


def test_a_starved_learner_asks_for_enough_generators_to_stop_waiting() -> None:
    # Waiting half the time: generators must be twice as fast.
    s = suggest(CFG, generators=4, wait_share=0.5, min_backlog_batches=0.0)
    assert (s.generators, s.decision) == (8, "up") and "50%" in s.reason
    # 25 % waiting: 4 / 0.75 = 5.33 -> 6.
    assert suggest(CFG, generators=4, wait_share=0.25, min_backlog_batches=0.0).generators == 6
    # Never more than doubling per decision, and at least one more.
    assert suggest(CFG, generators=3, wait_share=0.95, min_backlog_batches=0.0).generators == 6
    assert suggest(CFG, generators=10, wait_share=0.21, min_backlog_batches=0.0).generators == 13
    # No generator at all and a waiting learner: the minimum.
    assert suggest(CFG, generators=0, wait_share=1.0, min_backlog_batches=0.0).generators == 1


def test_a_backlog_that_stays_above_the_threshold_sheds_one_generator() -> None:
    s = suggest(CFG, generators=5, wait_share=0.01, min_backlog_batches=1.5)
    assert (s.generators, s.decision) == (4, "down") and "backlog stayed above 1" in s.reason
    # The learner still waits a little more than the low threshold: hold.
    assert suggest(CFG, generators=5, wait_share=0.1, min_backlog_batches=3.0).decision == "hold"
    # The backlog dipped below the threshold once in the window: hold.
    assert suggest(CFG, generators=5, wait_share=0.0, min_backlog_batches=0.5).decision == "hold"
    # Never below the minimum.
    s = suggest(CFG, generators=1, wait_share=0.0, min_backlog_batches=4.0)
    assert (s.generators, s.decision) == (1, "hold") and "clamped" in s.reason


def test_the_cap_holds() -> None:
    capped = ScalingConfig(max_generators=6)
    s = suggest(capped, generators=5, wait_share=0.9, min_backlog_batches=0.0)
    assert (s.generators, s.decision) == (6, "up")
    assert suggest(capped, generators=6, wait_share=0.9, min_backlog_batches=0.0).decision == "hold"


def test_the_window_averages_time_not_steps() -> None:
    w = StarvationWindow(3)
    w.add(waited_s=3.0, trained_s=1.0, backlog_batches=2.0)  # startup: long wait; falls out of the window
    for _ in range(3):
        w.add(waited_s=1.0, trained_s=3.0, backlog_batches=1.5)
    assert w.wait_share == pytest.approx(0.25)
    assert w.min_backlog_batches == 1.5
    w.add(waited_s=0.0, trained_s=4.0, backlog_batches=0.25)
    assert w.wait_share == pytest.approx(2 / 12) and w.min_backlog_batches == 0.25
    assert StarvationWindow(2).wait_share == 0.0


def test_bad_thresholds_name_the_field() -> None:
    with pytest.raises(ValueError, match="wait_share_low <= wait_share_high"):
        ScalingConfig(wait_share_high=0.1, wait_share_low=0.2)
    with pytest.raises(ValueError, match="learner.scaling.max_generators"):
        ScalingConfig(min_generators=3, max_generators=2)
    with pytest.raises(ValueError, match="learner.scaling.window_steps"):
        ScalingConfig(window_steps=0)
