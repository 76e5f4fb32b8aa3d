"""The M2 mask (M2PO-style second-moment trust region): hand-computed cases, its invariants, and the loss."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algorithms import AlgorithmConfig, CorrectionConfig, LossConfig, apply_corrections, make_loss_fn
from async_rl.algorithms.corrections import second_moment_keep
from tests.unit.algorithms._alg_batches import micro_batch


def test_drops_the_largest_squared_log_ratios_until_the_mean_is_within_the_bound() -> None:
    # squared: 0, 0.01, 0.04, 1.0 (+ a padded slot): running means 0, 0.005, 0.0167, 0.2625 -> keep 3, drop 1.0
    lr = torch.tensor([[0.0, 0.1, -0.2, 1.0, 50.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    r = apply_corrections(lr, mask, CorrectionConfig(m2_mask=True, m2_threshold=0.04))
    assert r.keep.tolist() == [[True, True, True, False, False]]
    m = {k: v.item() for k, v in r.metrics.items()}
    assert m["m2_mask_ratio"] == pytest.approx(1 / 4) and m["m2_mask_tokens_count"] == 4
    assert m["m2_before"] == pytest.approx((0.01 + 0.04 + 1.0) / 4)
    assert m["m2_after"] == pytest.approx(0.05 / 3)
    assert m["m2_masked_frac"] == pytest.approx(1 / 4) and m["kept_frac"] == pytest.approx(3 / 4)
    # a tighter bound drops more, largest first: 0.005 <= 0.01 < 0.0167 -> keep the two smallest
    tight = apply_corrections(lr, mask, CorrectionConfig(m2_mask=True, m2_threshold=0.01))
    assert tight.keep.tolist() == [[True, True, False, False, False]]


def test_on_policy_and_within_bound_batches_are_untouched() -> None:
    mask = torch.tensor([[True, True, False], [True, False, False]])
    assert apply_corrections(torch.zeros(2, 3), mask, CorrectionConfig(m2_mask=True)).keep.tolist() == mask.tolist()
    small = torch.full((2, 3), 0.1)  # (log ρ)² = 0.01 everywhere <= 0.04
    assert second_moment_keep(small, mask, 0.04).tolist() == mask.tolist()
    assert not second_moment_keep(small, torch.zeros(2, 3, dtype=torch.bool), 0.04).any()


@pytest.mark.parametrize("seed", range(5))
def test_kept_set_is_within_bound_maximal_and_drops_only_the_largest(seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    lr = torch.randn(6, 9, generator=g, dtype=torch.float64) * 0.4
    mask = torch.rand(6, 9, generator=g) < 0.8
    keep = second_moment_keep(lr, mask, 0.04)
    sq = lr.square()
    assert not (keep & ~mask).any()
    assert sq[keep].mean() <= 0.04 + 1e-12
    dropped = mask & ~keep
    if dropped.any() and keep.any():
        assert sq[dropped].min() >= sq[keep].max()
        # maximal: adding back the smallest dropped token would break the bound
        with_next = torch.cat([sq[keep], sq[dropped].min().reshape(1)])
        assert with_next.mean() > 0.04


def test_loss_gives_no_gradient_to_dropped_tokens_and_config_is_checked() -> None:
    cfg = AlgorithmConfig(loss=LossConfig(type="cispo", cispo_eps_clip_high=100.0),
                          correction=CorrectionConfig(m2_mask=True, anchor="current"))  # fmt: skip
    assert not cfg.needs_proximal_logprobs
    mask = torch.ones(1, 4, dtype=torch.bool)
    behaviour = torch.tensor([[math.log(0.5), math.log(0.5), math.log(0.5), math.log(0.05)]])
    logp = torch.full((1, 4), math.log(0.5), requires_grad=True)  # the last token: log ρ = log 10, far off
    mb = micro_batch(mask, behaviour, torch.ones(1, 4))
    from async_rl.algorithms.batch import ForwardOutput

    loss, metrics = make_loss_fn(cfg)(ForwardOutput(logprobs=logp, entropy=None), mb)
    loss.backward()
    assert logp.grad is not None
    assert logp.grad[0, 3] == 0 and (logp.grad[0, :3] != 0).all()
    assert metrics["m2_mask_ratio"] == pytest.approx(0.25)
    with pytest.raises(ValueError, match="algorithm.correction.m2_threshold must be > 0"):
        CorrectionConfig(m2_mask=True, m2_threshold=0.0)
