"""Corrections (outlier mask, token mask, TIS, sequence masks) against hand-computed values."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algorithms import CorrectionConfig, apply_corrections

LN = math.log


def test_outlier_then_token_mask_then_token_tis() -> None:
    lr = torch.tensor([[LN(3.0), 0.0, LN(1.5), 0.0], [LN(200.0), 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    mask = torch.tensor([[True, True, True, False], [True, True, False, False], [False, False, False, False]])
    cfg = CorrectionConfig(outlier_mask=True, token_mask=True, tis="token", token_tis_cap=2.0)
    r = apply_corrections(lr, mask, cfg)
    assert r.keep.tolist() == [[False, True, True, False], [False] * 4, [False] * 4]
    torch.testing.assert_close(r.weights, torch.tensor([[2.0, 1.0, 1.5, 0.0], [2.0, 1.0, 0.0, 0.0], [0.0] * 4]))
    m = {k: v.item() for k, v in r.metrics.items()}
    # 5 response tokens: the outlier mask removes 2, the token mask 1 of the rest
    assert m["outlier_masked_frac"] == pytest.approx(2 / 5) and m["outlier_masked_sequences_count"] == 1
    assert m["token_masked_frac"] == pytest.approx(1 / 5)
    assert m["tis_clipped_frac"] == pytest.approx(2 / 5)
    assert m["kept_frac"] == pytest.approx(2 / 5)
    assert m["tis_weight_max"] == 2.0 and m["tis_weight_min"] == 1.0


def test_sequence_tis_hand_computed() -> None:
    lr = torch.tensor([[0.5, 0.5, 9.0], [1.0, 1.0, 0.0], [-50.0, -60.0, 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, False], [True, True, True], [True, True, False]])
    r = apply_corrections(lr, mask, CorrectionConfig(tis="sequence", sequence_tis_cap=5.0))
    expected = torch.tensor(
        [[math.e, math.e, 0.0], [5.0, 5.0, 5.0], [math.exp(-110.0)] * 2 + [0.0]], dtype=torch.float64
    )
    torch.testing.assert_close(r.weights, expected)
    assert r.keep.equal(mask)
    assert r.metrics["tis_clipped_sequences_count"].item() == 1
    assert r.metrics["tis_clipped_frac"].item() == 3 / 7


def test_geometric_and_product_sequence_masks() -> None:
    lr = torch.tensor([[0.1, -0.1], [0.02, 0.02], [0.5, 0.5], [0.3, 0.3]])
    mask = torch.ones(4, 2, dtype=torch.bool)
    geo = apply_corrections(
        lr, mask, CorrectionConfig(sequence_mask="geometric", geometric_low=0.99, geometric_high=1.01)
    )
    assert geo.keep.all(dim=-1).tolist() == [True, False, False, False]
    prod = apply_corrections(lr, mask, CorrectionConfig(sequence_mask="product", product_low=0.5, product_high=2.0))
    # products: 1, e^0.04, e^1 = 2.72, e^0.6 = 1.82
    assert prod.keep.all(dim=-1).tolist() == [True, True, False, True]
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
