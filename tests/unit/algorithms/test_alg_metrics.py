"""Staleness histogram, ratio statistics and micro-batch metric aggregation."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algorithms import ratio_metrics, reduce_metrics, staleness_metrics


def test_staleness_histogram_hand_computed() -> None:
    versions = torch.tensor([[10, 9, 9, 0], [7, 1, 0, 11]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False]])
    m = staleness_metrics(versions, mask, learner_version=10, hist_max=4)
    # staleness 0, 1, 1, 3, 9 (masked positions, garbage versions included, are ignored)
    assert m["staleness_mean"] == pytest.approx(14 / 5) and m["staleness_max"] == 9 and m["staleness_min"] == 0
    assert [m[f"staleness_hist_{k}_count"] for k in range(4)] == [1, 2, 0, 1]
    assert m["staleness_hist_ge4_count"] == 1 and m["staleness_hist_neg_count"] == 0


def test_staleness_empty_and_newer_than_learner() -> None:
    none = torch.zeros(1, 3, dtype=torch.bool)
    m = staleness_metrics(torch.zeros(1, 3, dtype=torch.long), none, learner_version=2)
    assert m["staleness_mean"] == 0 and "staleness_max" not in m and "staleness_min" not in m
    assert sum(v for k, v in m.items() if k.endswith("_count")) == 0
    # tokens newer than the learner (learner restarted from an older checkpoint) are counted, not fatal
    m = staleness_metrics(torch.tensor([[5, 2]]), torch.tensor([[True, True]]), learner_version=2)
    assert m["staleness_hist_neg_count"] == 1 and m["staleness_hist_0_count"] == 1 and m["staleness_min"] == -3


def test_ratio_metrics() -> None:
    lr = torch.tensor([[math.log(2.0), 0.0, 100.0]])
    mask = torch.tensor([[True, True, False]])
    m = {k: v.item() for k, v in ratio_metrics(lr, mask).items()}
    assert m["is_ratio_mean"] == pytest.approx(1.5) and m["is_ratio_sq_mean"] == pytest.approx(2.5)
    assert m["is_ratio_max"] == pytest.approx(2.0) and m["is_ratio_min"] == 1.0
    assert m["abs_log_ratio_max"] == pytest.approx(math.log(2.0))


def test_reduce_metrics_by_suffix() -> None:
    a = {"loss_tokens_count": 1.0, "clip_frac": 1.0, "is_ratio_mean": 2.0, "is_ratio_sq_mean": 4.0, "loss_sum": 0.5,
         "is_ratio_max": 2.0, "is_ratio_min": 2.0}  # fmt: skip
    b = {"loss_tokens_count": 3.0, "clip_frac": 0.0, "is_ratio_mean": 1.0, "is_ratio_sq_mean": 1.0, "loss_sum": 0.25}
    m = reduce_metrics([a, b])
    assert m["loss_tokens_count"] == 4 and m["loss_sum"] == 0.75
    assert m["clip_frac"] == pytest.approx(0.25)
    assert m["is_ratio_mean"] == pytest.approx(1.25) and m["is_ratio_sq_mean"] == pytest.approx(1.75)
    assert m["is_ratio_std"] == pytest.approx(math.sqrt(1.75 - 1.25**2))
    assert m["is_ratio_max"] == 2.0 and m["is_ratio_min"] == 2.0
    assert reduce_metrics([]) == {}
