"""apply_corrections in SkyRL's order, hand-computed in float64: each mask alone and all together, masked and
dropped tokens with wild log ratios, all-masked rows, a wholly masked batch, ratios at ±20 and beyond.

Every expected value is derived in the comment above it from ratios chosen by hand: ρ_t = π_old/μ is given
directly (the log ratio is ln ρ), row metrics are over all rows of the batch (SkyRL divides by the batch size),
token metrics over the tokens the step looked at.
"""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algorithms import CorrectionConfig, apply_corrections

LN = math.log
F64 = torch.float64


def _metrics(cfg: CorrectionConfig, lr: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, dict[str, float]]:
    r = apply_corrections(lr, mask, cfg)
    return r.keep, {k: v.item() for k, v in r.metrics.items()}


# Five rows of three response tokens, ratios ρ:
#   row 0: 1, 1, 1        on-policy
#   row 1: 200, 1, 1      one outlier token (> 100)
#   row 2: 3, 1, 1        one token outside the token mask's [0.5, 2]
#   row 3: 1.2, 1.2, 1.2  geometric mean 1.2, inside [0.8, 1.25]
#   row 4: 0.6, 0.6, 0.6  geometric mean 0.6, below 0.8
RATIOS = torch.tensor([[1, 1, 1], [200, 1, 1], [3, 1, 1], [1.2, 1.2, 1.2], [0.6, 0.6, 0.6]], dtype=F64)
LR = RATIOS.log()
MASK = torch.ones(5, 3, dtype=torch.bool)
OUTLIER = dict(outlier_mask=True, outlier_low=1e-4, outlier_high=100.0)
TOKEN = dict(token_mask=True, token_mask_low=0.5, token_mask_high=2.0)
GEO = dict(sequence_mask="geometric", geometric_low=0.8, geometric_high=1.25)


def test_outlier_mask_alone() -> None:
    keep, m = _metrics(CorrectionConfig(**OUTLIER), LR, MASK)
    # only row 1 has a token outside [1e-4, 100]
    assert keep.all(dim=-1).tolist() == [True, False, True, True, True] and keep.sum() == 12
    assert m["outlier_seq_masked_ratio"] == pytest.approx(1 / 5)
    assert m["outlier_seq_over_high_ratio"] == pytest.approx(1 / 5) and m["outlier_seq_under_low_ratio"] == 0


def test_token_mask_alone() -> None:
    keep, m = _metrics(CorrectionConfig(**TOKEN), LR, MASK)
    # 200 and 3 are above 2; 0.6 >= 0.5 stays (the band is inclusive): 2 of 15 tokens dropped
    assert (~keep).nonzero().tolist() == [[1, 0], [2, 0]]
    assert m["token_mask_ratio"] == pytest.approx(2 / 15) and m["token_mask_over_high_ratio"] == pytest.approx(2 / 15)
    assert m["token_mask_under_low_ratio"] == 0


def test_geometric_mask_alone() -> None:
    keep, m = _metrics(CorrectionConfig(**GEO), LR, MASK)
    # geometric means: 1, 200^(1/3) = 5.85, 3^(1/3) = 1.44, 1.2, 0.6 -> rows 1, 2 over 1.25, row 4 under 0.8
    assert keep.all(dim=-1).tolist() == [True, False, False, True, False]
    assert m["geo_sequence_mask_masked_ratio"] == pytest.approx(3 / 5)
    assert m["geo_sequence_mask_over_high_ratio"] == pytest.approx(2 / 5)
    assert m["geo_sequence_mask_under_low_ratio"] == pytest.approx(1 / 5)


def test_all_together_each_step_sees_what_the_previous_left() -> None:
    cfg = CorrectionConfig(**OUTLIER, **TOKEN, **GEO, tis="token", token_tis_cap=1.1)
    r = apply_corrections(LR, MASK, cfg)
    m = {k: v.item() for k, v in r.metrics.items()}
    # 1. outlier: row 1 goes (1 of 5 rows)
    assert m["outlier_seq_masked_ratio"] == pytest.approx(1 / 5)
    # 2. token mask on the 12 tokens left: only row 2's ratio 3 (row 1's 200 is already gone): 1 of 12
    assert m["token_mask_ratio"] == pytest.approx(1 / 12) and m["token_mask_tokens_count"] == 12
    # 3. token TIS (cap 1.1) on the 11 left: row 3's three 1.2 are above the cap: 3 of 11
    assert m["tis_token_clip_high_ratio"] == pytest.approx(3 / 11) and m["tis_tokens_count"] == 11
    # 4. geometric mask on the 11: row 2 now has ratios 1, 1 (mean 1, kept, where alone it was 1.44 and dropped);
    #    row 1 has no token left: ratio 1, kept and not counted; only row 4 (0.6) goes, under the band: 1 of 5
    assert m["geo_sequence_mask_masked_ratio"] == pytest.approx(1 / 5)
    assert m["geo_sequence_mask_under_low_ratio"] == pytest.approx(1 / 5)
    assert m["geo_sequence_mask_over_high_ratio"] == 0
    expected_keep = [[True] * 3, [False] * 3, [False, True, True], [True] * 3, [False] * 3]
    assert r.keep.tolist() == expected_keep
    # weights min(ρ, 1.1) on every response token, dropped or not (the keep mask decides what counts)
    torch.testing.assert_close(r.weights, torch.clamp(RATIOS, max=1.1))
    assert m["kept_frac"] == pytest.approx(8 / 15)


def test_a_token_dropped_by_the_token_mask_enters_no_sequence_statistic() -> None:
    # row: ρ = 1.5, e^15 (dropped by the token mask), 0.8
    lr = torch.tensor([[LN(1.5), 15.0, LN(0.8)]], dtype=F64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    cfg = CorrectionConfig(**TOKEN, tis="sequence", sequence_tis_cap=5.0, sequence_mask="geometric",
                           geometric_low=0.9, geometric_high=1.1)  # fmt: skip
    r = apply_corrections(lr, mask, cfg)
    # sequence TIS over the two survivors: 1.5 · 0.8 = 1.2 (with e^15 in, it would be capped at 5)
    torch.testing.assert_close(r.weights, torch.full((1, 3), 1.2, dtype=F64))
    assert r.metrics["tis_seq_clip_high_ratio"].item() == 0
    # geometric mean over the survivors: sqrt(1.2) = 1.095 inside [0.9, 1.1] (with e^15 in: e^5.06, dropped)
    assert r.keep.tolist() == [[True, False, True]]


def test_masked_tokens_with_wild_log_ratios_change_nothing() -> None:
    mask = torch.tensor([[True, True, False, False], [True, False, True, False], [False] * 4])
    tame = torch.tensor([[LN(1.5), LN(0.7), 0.0, 0.0], [LN(1.1), 0.0, LN(0.9), 0.0], [0.0] * 4], dtype=F64)
    wild = tame.clone()
    wild[~mask] = torch.tensor([80.0, float("nan"), -90.0, float("inf"), 1e30, -float("inf"), 55.0, -1e30], dtype=F64)
    cfg = CorrectionConfig(**OUTLIER, **TOKEN, tis="sequence", sequence_mask="product", product_low=0.5,
                           product_high=2.0)  # fmt: skip
    a, b = apply_corrections(tame, mask, cfg), apply_corrections(wild, mask, cfg)
    assert a.keep.equal(b.keep) and a.weights.equal(b.weights)
    assert {k: v.item() for k, v in a.metrics.items()} == {k: v.item() for k, v in b.metrics.items()}
    # and the values: products 1.5 · 0.7 = 1.05 and 1.1 · 0.9 = 0.99, the empty row 1; nothing is dropped
    assert a.keep.equal(mask)
    expected_w = torch.tensor([[1.05, 1.05, 0, 0], [0.99, 0, 0.99, 0], [0.0] * 4], dtype=F64)
    torch.testing.assert_close(a.weights, expected_w)


def test_a_wholly_masked_batch() -> None:
    none = torch.zeros(2, 3, dtype=torch.bool)
    lr = torch.full((2, 3), 50.0, dtype=F64)
    cfg = CorrectionConfig(**OUTLIER, **TOKEN, tis="sequence", sequence_mask="geometric")
    r = apply_corrections(lr, none, cfg)
    assert not r.keep.any() and not r.weights.any()
    m = {k: v.item() for k, v in r.metrics.items()}
    # two rows, no token: nothing is over or under anything (empty rows count as ratio 1); every fraction is 0
    assert m["correction_rows_count"] == 2 and m["token_mask_tokens_count"] == 0 and m["tis_tokens_count"] == 0
    for key in ("outlier_seq_masked_ratio", "token_mask_ratio", "tis_seq_clip_high_ratio", "kept_frac",
                "geo_sequence_mask_masked_ratio", "outlier_masked_frac", "sequence_masked_frac"):  # fmt: skip
        assert m[key] == 0.0, key
    assert "tis_weight_max" in m and math.isinf(m["tis_weight_max"])  # no token: dropped by to_floats


def test_ratios_at_and_beyond_the_clamp() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    # a token at log ratio 25: its ratio is e^20 = 4.85e8 (the clamp), so an outlier bound of 1e9 never fires ...
    lr = torch.tensor([[25.0, 0.0]], dtype=F64)
    assert apply_corrections(lr, mask, CorrectionConfig(outlier_mask=True, outlier_high=1e9)).keep.all()
    # ... and one of 4e8 does
    assert not apply_corrections(lr, mask, CorrectionConfig(outlier_mask=True, outlier_high=4e8)).keep.any()
    # token TIS has no lower clip: log ratio -30 gives weight e^-20, 20 gives the cap 2
    r = apply_corrections(torch.tensor([[-30.0, 20.0]], dtype=F64), mask, CorrectionConfig(tis="token"))
    torch.testing.assert_close(r.weights, torch.tensor([[math.exp(-20.0), 2.0]], dtype=F64))
    # sums take the unclamped log ratios, clamped once: 25 - 10 = 15, product e^15 = 3.3e6 > 1e6 -> dropped
    # (clamping each token first would give e^(20 - 10) = 22026 and keep it)
    lr = torch.tensor([[25.0, -10.0]], dtype=F64)
    prod = CorrectionConfig(sequence_mask="product", product_low=0.5, product_high=1e6)
    assert not apply_corrections(lr, mask, prod).keep.any()
    # sequence TIS: 30 + 30 = 60 clamped to 20: min(e^20, 1e9 cap) = e^20
    r = apply_corrections(torch.tensor([[30.0, 30.0]], dtype=F64), mask,
                          CorrectionConfig(tis="sequence", sequence_tis_cap=1e9))  # fmt: skip
    torch.testing.assert_close(r.weights, torch.full((1, 2), math.exp(20.0), dtype=F64))


def test_one_sided_outlier_band() -> None:
    lr = torch.tensor([[LN(1e-6), 0.0], [LN(500.0), 0.0]], dtype=F64)
    mask = torch.ones(2, 2, dtype=torch.bool)
    # only the low side: the 1e-6 row goes, the 500 row (above any usual high) stays
    keep, m = _metrics(CorrectionConfig(outlier_mask=True, outlier_low=1e-4, outlier_high=None), lr, mask)
    assert keep.all(dim=-1).tolist() == [False, True]
    assert m["outlier_seq_under_low_ratio"] == 0.5 and m["outlier_seq_over_high_ratio"] == 0
    keep, m = _metrics(CorrectionConfig(outlier_mask=True, outlier_low=None, outlier_high=100.0), lr, mask)
    assert keep.all(dim=-1).tolist() == [True, False] and m["outlier_seq_over_high_ratio"] == 0.5


def test_a_one_sided_token_mask_is_off() -> None:
    with pytest.warns(UserWarning, match="needs both bounds"):
        cfg = CorrectionConfig(token_mask=True, token_mask_low=0.5, token_mask_high=None)
    r = apply_corrections(torch.tensor([[LN(0.1), LN(10.0)]], dtype=F64), torch.ones(1, 2, dtype=torch.bool), cfg)
    assert r.keep.all() and r.metrics == {}  # as in SkyRL: nothing enabled, nothing reported
