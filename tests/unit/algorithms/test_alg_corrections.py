"""Corrections (outlier mask, token mask, TIS, sequence masks) against hand-computed values, SkyRL's metric names."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algorithms import CorrectionConfig, apply_corrections

LN = math.log


def test_outlier_then_token_mask_then_token_tis() -> None:
    lr = torch.tensor([[LN(3.0), 0.0, LN(1.5), 0.0], [LN(200.0), 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
                      dtype=torch.float64)  # fmt: skip
    mask = torch.tensor([[True, True, True, False], [True, True, False, False], [False, False, False, False]])
    cfg = CorrectionConfig(outlier_mask=True, token_mask=True, tis="token", token_tis_cap=2.0)
    r = apply_corrections(lr, mask, cfg)
    # row 1 holds ratio 200 > 100: the outlier mask drops it; then ratio 3 > 2 is dropped by the token mask
    assert r.keep.tolist() == [[False, True, True, False], [False] * 4, [False] * 4]
    # token TIS: min(ratio, 2) on every loss-mask token (the masks decide which ones count)
    expected_w = torch.tensor([[2.0, 1.0, 1.5, 0.0], [2.0, 1.0, 0.0, 0.0], [0.0] * 4], dtype=torch.float64)
    torch.testing.assert_close(r.weights, expected_w)
    m = {k: v.item() for k, v in r.metrics.items()}
    # SkyRL's row metrics are over all 3 rows (the empty one included): 1 row dropped, for a ratio over high
    assert m["outlier_seq_masked_ratio"] == pytest.approx(1 / 3)
    assert m["outlier_seq_over_high_ratio"] == pytest.approx(1 / 3)
    assert m["outlier_seq_under_low_ratio"] == 0 and m["correction_rows_count"] == 3
    # the token mask looks at the 3 tokens the outlier mask left and drops 1 (over high)
    assert m["token_mask_ratio"] == pytest.approx(1 / 3) and m["token_mask_over_high_ratio"] == pytest.approx(1 / 3)
    assert m["token_mask_under_low_ratio"] == 0 and m["token_mask_tokens_count"] == 3
    # TIS looks at the 2 survivors (ratios 1 and 1.5): none above the cap, though 3 and 200 were
    assert m["tis_token_clip_high_ratio"] == 0 and m["tis_tokens_count"] == 2
    assert m["tis_weight_mean"] == pytest.approx(1.25) and m["tis_weight_max"] == 1.5 and m["tis_weight_min"] == 1.0
    # this project's fractions of the 5 response tokens: 2 to the outlier mask, 1 to the token mask, 2 kept
    assert m["outlier_masked_frac"] == pytest.approx(2 / 5) and m["outlier_masked_sequences_count"] == 1
    assert m["token_masked_frac"] == pytest.approx(1 / 5) and m["kept_frac"] == pytest.approx(2 / 5)


def test_sequence_tis_hand_computed() -> None:
    lr = torch.tensor([[0.5, 0.5, 9.0], [1.0, 1.0, 0.0], [-50.0, -60.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, False]])
    r = apply_corrections(lr, mask, CorrectionConfig(tis="sequence", sequence_tis_cap=5.0))
    # row sums of the unclamped log ratios: 1, 2, -110; exp of the sum clamped to ±20, then min(., 5):
    # e^1, min(e^2 = 7.39, 5) = 5, e^-20 (not e^-110: the clamp applies to the sum)
    expected = torch.tensor(
        [[math.e, math.e, 0.0], [5.0, 5.0, 5.0], [math.exp(-20.0)] * 2 + [0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(r.weights, expected)
    assert r.keep.equal(mask)
    # one row of three has its product above the cap
    assert r.metrics["tis_seq_clip_high_ratio"].item() == pytest.approx(1 / 3)


def test_geometric_and_product_sequence_masks() -> None:
    lr = torch.tensor([[0.1, -0.1], [0.02, 0.02], [0.5, 0.5], [0.3, 0.3]], dtype=torch.float64)
    mask = torch.ones(4, 2, dtype=torch.bool)
    geo = apply_corrections(
        lr, mask, CorrectionConfig(sequence_mask="geometric", geometric_low=0.99, geometric_high=1.01)
    )
    # geometric means exp(mean log ρ): 1, e^0.02 = 1.0202, e^0.5, e^0.3: only the first is inside [0.99, 1.01]
    assert geo.keep.all(dim=-1).tolist() == [True, False, False, False]
    assert geo.metrics["geo_sequence_mask_masked_ratio"].item() == 0.75
    assert geo.metrics["geo_sequence_mask_over_high_ratio"].item() == 0.75
    assert geo.metrics["geo_sequence_mask_under_low_ratio"].item() == 0
    prod = apply_corrections(lr, mask, CorrectionConfig(sequence_mask="product", product_low=0.5, product_high=2.0))
    # products: 1, e^0.04, e^1 = 2.72, e^0.6 = 1.82
    assert prod.keep.all(dim=-1).tolist() == [True, True, False, True]
    assert prod.metrics["product_sequence_mask_masked_ratio"].item() == 0.25
    assert prod.metrics["sequence_masked_sequences_count"].item() == 1
    assert prod.metrics["sequence_masked_frac"].item() == pytest.approx(2 / 8)


def test_sequence_statistics_ignore_masked_positions_and_empty_rows() -> None:
    # the masked position holds garbage (a NaN and a huge ratio); the empty row never NaNs
    lr = torch.tensor([[0.0, 0.0, float("nan")], [0.0, 50.0, 0.0], [float("inf"), 0.0, 0.0]])
    mask = torch.tensor([[True, True, False], [True, False, False], [False, False, False]])
    cfg = CorrectionConfig(outlier_mask=True, token_mask=True, sequence_mask="geometric")
    r = apply_corrections(lr, mask, cfg)
    assert r.keep.equal(mask)
    assert all(torch.isfinite(v).all() for v in r.metrics.values())
    assert torch.isfinite(r.weights).all()


def test_extreme_ratios_no_inf_nan() -> None:
    lr = torch.tensor([[100.0, -100.0, 100.0], [-100.0, -100.0, -100.0]])
    mask = torch.ones(2, 3, dtype=torch.bool)
    # product of row 0: exp(clamp(100, ±20)) > 2, row 1: exp(-20) < 0.5
    for tis in ("token", "sequence"):
        cfg = CorrectionConfig(tis=tis, outlier_mask=False, sequence_mask="product")  # type: ignore[arg-type]
        r = apply_corrections(lr, mask, cfg)
        assert torch.isfinite(r.weights).all() and r.weights.max() <= max(cfg.token_tis_cap, cfg.sequence_tis_cap)
        assert all(torch.isfinite(v).all() for v in r.metrics.values())
        assert not r.keep.any()  # both products are far outside [0.5, 2]


def test_all_off_is_identity_even_off_policy() -> None:
    lr = torch.tensor([[3.0, -3.0]])
    mask = torch.tensor([[True, False]])
    r = apply_corrections(lr, mask, CorrectionConfig())
    assert r.keep.equal(mask) and r.weights.tolist() == [[1.0, 0.0]] and r.metrics == {}
