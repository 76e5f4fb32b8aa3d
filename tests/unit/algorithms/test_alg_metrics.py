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


def test_ratio_metrics_as_skyrl_reports_them() -> None:
    lr = torch.tensor([[math.log(2.0), 0.0, 100.0], [25.0, 0.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    m = {k: v.item() for k, v in ratio_metrics(lr, mask).items()}
    # valid ratios 2, 1, e^20 (25 clamped to 20); the 3 masked entries count as 0 for std / max / min
    e20 = math.exp(20.0)
    assert m["is_ratio_mean"] == pytest.approx((3 + e20) / 3)
    entries = [2.0, 1.0, 0.0, e20, 0.0, 0.0]
    mean6 = sum(entries) / 6
    std_unbiased = math.sqrt(sum((x - mean6) ** 2 for x in entries) / 5)
    assert m["is_ratio_std"] == pytest.approx(std_unbiased)
    assert m["is_ratio_max"] == pytest.approx(e20) and m["is_ratio_min"] == 0.0
    assert m["is_ratio_sum"] == pytest.approx(3 + e20) and m["is_ratio_entries_count"] == 6
    assert m["abs_log_ratio_max"] == 25.0 and m["abs_log_ratio_mean"] == pytest.approx((math.log(2.0) + 25) / 3)
    # no masked entry: the min is the smallest ratio
    assert ratio_metrics(lr[:1, :2], mask[:1, :2])["is_ratio_min"].item() == 1.0


def test_reduce_metrics_recomputes_the_step_std_and_weights_fractions_by_their_denominators() -> None:
    lr = torch.tensor([[math.log(2.0), 0.0, 0.3], [-0.5, 0.0, 0.0], [1.0, 2.0, -1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, False, False], [True, True, True]])
    full = {k: v.item() for k, v in ratio_metrics(lr, mask).items()}
    parts = [{k: v.item() for k, v in ratio_metrics(lr[i : i + 1], mask[i : i + 1]).items()}
             | {"loss_tokens_count": float(mask[i].sum())} for i in range(3)]  # fmt: skip
    agg = reduce_metrics(parts)
    for k in ("is_ratio_mean", "is_ratio_std", "is_ratio_max", "is_ratio_min", "abs_log_ratio_mean"):
        assert agg[k] == pytest.approx(full[k], rel=1e-12), k
    # a row fraction over 2 + 1 rows: (1/2 * 2 + 1 * 1) / 3; a token fraction over its own 4 + 0 tokens
    agg = reduce_metrics([
        {"loss_tokens_count": 9.0, "correction_rows_count": 2.0, "outlier_seq_masked_ratio": 0.5,
         "tis_tokens_count": 4.0, "tis_token_clip_high_ratio": 0.25},
        {"loss_tokens_count": 1.0, "correction_rows_count": 1.0, "outlier_seq_masked_ratio": 1.0,
         "tis_tokens_count": 0.0, "tis_token_clip_high_ratio": 0.0},
    ])  # fmt: skip
    assert agg["outlier_seq_masked_ratio"] == pytest.approx(2 / 3) and agg["tis_token_clip_high_ratio"] == 0.25


def test_reduce_metrics_by_suffix() -> None:
    a = {"loss_tokens_count": 1.0, "clip_ratio": 1.0, "is_ratio_mean": 2.0, "is_ratio_sq_mean": 4.0, "loss_sum": 0.5,
         "is_ratio_max": 2.0, "is_ratio_min": 2.0}  # fmt: skip
    b = {"loss_tokens_count": 3.0, "clip_ratio": 0.0, "is_ratio_mean": 1.0, "is_ratio_sq_mean": 1.0, "loss_sum": 0.25}
    m = reduce_metrics([a, b])
    assert m["loss_tokens_count"] == 4 and m["loss_sum"] == 0.75
    assert m["clip_ratio"] == pytest.approx(0.25)
    assert m["is_ratio_mean"] == pytest.approx(1.25) and m["is_ratio_sq_mean"] == pytest.approx(1.75)
    assert m["is_ratio_std"] == pytest.approx(math.sqrt(1.75 - 1.25**2))
    assert m["is_ratio_max"] == 2.0 and m["is_ratio_min"] == 2.0
    assert reduce_metrics([]) == {}


def test_parts_to_floats_keeps_each_part_and_its_weight() -> None:
    from async_rl.algorithms.metrics import WEIGHT_KEY, parts_to_floats

    parts = [
        ({"a": torch.tensor(1.5), "x_max": torch.tensor(float("-inf")), "n": 2.0}, torch.tensor(4.0)),
        ({"a": 0.5, WEIGHT_KEY: torch.tensor(3.0)}, 9.0),  # the loss's own weight wins
        ({}, 1.0),
    ]
    out = parts_to_floats(parts)
    assert out == [{"a": 1.5, "n": 2.0, WEIGHT_KEY: 4.0}, {"a": 0.5, WEIGHT_KEY: 3.0}, {WEIGHT_KEY: 1.0}]
    assert all(type(v) is float for d in out for v in d.values())
