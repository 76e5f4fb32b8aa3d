"""PPO clip (dual clip), rollout_is, CISPO and KL estimators: hand-computed values, gradients, gradcheck."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algorithms import kl_penalty, ppo_clip_loss, rollout_is_loss
from async_rl.algorithms.policy_losses import cispo_loss

LN = math.log


def test_ppo_clip_hand_computed() -> None:
    # tokens: (ratio, A) = (1.5, +1) (1.5, -1) (4, -1) (0.5, +1) (0.5, -1) | masked
    ratio = torch.tensor([[1.5, 1.5, 4.0, 0.5, 0.5, 7.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -1.0, -1.0, 1.0, -1.0, 5.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, True, False]])
    old = torch.full_like(ratio, -1.0)
    logp = (old + ratio.log()).requires_grad_()
    loss, clipped, dual = ppo_clip_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0)
    torch.testing.assert_close(loss, torch.tensor([[-1.2, 1.5, 3.0, -0.5, 0.8, 0.0]], dtype=torch.float64))
    assert clipped.tolist() == [[True, False, False, False, True, False]]
    assert dual.tolist() == [[False, False, True, False, False, False]]
    loss.sum().backward()
    # gradient -A r where the unclipped term is active, 0 where a clip is active, 0 when masked
    torch.testing.assert_close(logp.grad, torch.tensor([[0.0, 1.5, 0.0, -0.5, 0.0, 0.0]], dtype=torch.float64))


def test_ppo_without_dual_clip_and_asymmetric_bounds() -> None:
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.tensor([[LN(4.0), LN(1.25)]], dtype=torch.float64)
    adv = torch.tensor([[-1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    loss, clipped, dual = ppo_clip_loss(logp, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.28, dual_clip=0.0)
    torch.testing.assert_close(loss, torch.tensor([[4.0, -1.25]], dtype=torch.float64))
    assert not clipped.any() and not dual.any()


def test_rollout_is_hand_computed() -> None:
    # SkyRL's rollout_is: weight sg(ρ · 1[0.8 < ρ < 1.2]), ρ = π/μ; loss -w · A · log π, gradient -w · A
    mu = torch.full((1, 6), -2.0, dtype=torch.float64)
    ratio = torch.tensor([[1.1, 0.9, 1.2, 0.8, 3.0, 1.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, -2.0, 1.0, 1.0, 1.0, 7.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, True, False]])
    logp = (mu + ratio.log()).requires_grad_()
    loss, clipped = rollout_is_loss(logp, mu, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)
    # the band is open: 1.2 and 0.8 sit on its ends and get the hard zero, as 3.0 does
    w = torch.tensor([[1.1, 0.9, 0.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
    lp = mu + ratio.log()  # log π = -2 + log ρ
    torch.testing.assert_close(loss, torch.where(mask, -w * adv * lp, torch.zeros(())))
    assert clipped.tolist() == [[False, False, True, True, True, False]]
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.where(mask, -w * adv, torch.zeros(())))


def test_cispo_hand_computed() -> None:
    # CISPO: weight sg(clip(r, 1 - 0.5, 1 + 1)) = clip(r, 0.5, 2); loss -w · A · log π; every token keeps a gradient
    anchor = torch.full((1, 5), -1.0, dtype=torch.float64)
    r = torch.tensor([[3.0, 0.25, 1.5, 1.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -2.0, 0.5, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, True, False]])
    logp = (anchor + r.log()).requires_grad_()
    loss, clipped, ratio = cispo_loss(logp, anchor, adv, mask, eps_low=0.5, eps_high=1.0)
    w = torch.tensor([[2.0, 0.5, 1.5, 1.0, 0.0]], dtype=torch.float64)
    lp = anchor + r.log()
    torch.testing.assert_close(loss, torch.where(mask, -w * adv * lp, torch.zeros(())))
    assert clipped.tolist() == [[True, True, False, False, False]]
    torch.testing.assert_close(ratio, torch.tensor([[3.0, 0.25, 1.5, 1.0, 0.0]], dtype=torch.float64))
    loss.sum().backward()
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -0.5, 3.0, -0.5, 0.0]], dtype=torch.float64))


def test_ratios_at_and_beyond_the_clamp() -> None:
    # log ratios of 20, 25 and -30: exp(clamp(., ±20)) = e^20, e^20, e^-20
    mu = torch.zeros(1, 3, dtype=torch.float64)
    logp = torch.tensor([[20.0, 25.0, -30.0]], dtype=torch.float64, requires_grad=True)
    adv = torch.tensor([[-1.0, -1.0, 1.0]], dtype=torch.float64)
    mask = torch.ones(1, 3, dtype=torch.bool)
    loss, clipped, ratio = cispo_loss(logp, mu, adv, mask, eps_low=1.0, eps_high=4.0)
    torch.testing.assert_close(ratio, torch.tensor([[math.exp(20), math.exp(20), math.exp(-20)]], dtype=torch.float64))
    # weights clip(., 0, 5) = 5, 5, e^-20; loss -w · A · log π
    torch.testing.assert_close(loss, torch.tensor([[5.0 * 20, 5.0 * 25, math.exp(-20) * 30]], dtype=torch.float64))
    # PPO with A < 0 and the ratio pinned at e^20: the clamp's gradient is 0 past ±20, dual clip caps at -A·3 = 3
    logp.grad = None
    pl, _, dual = ppo_clip_loss(logp, mu, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0)
    torch.testing.assert_close(pl[0, :2], torch.tensor([3.0, 3.0], dtype=torch.float64))
    assert dual[0, :2].all()
    # third token: A = 1, r = e^-20 < 0.8: max(-r, -0.8) = -e^-20, the unclipped term
    assert pl[0, 2].item() == pytest.approx(-math.exp(-20.0))


def test_kl_estimators_hand_computed() -> None:
    logp = torch.tensor([[LN(0.5), 0.0]], dtype=torch.float64)
    ref = torch.tensor([[LN(0.25), 0.0]], dtype=torch.float64)
    mask = torch.tensor([[True, False]])
    log_r = LN(0.5)
    assert kl_penalty(logp, ref, mask, "k1")[0, 0].item() == pytest.approx(-log_r)
    assert kl_penalty(logp, ref, mask, "k2")[0, 0].item() == pytest.approx(0.5 * log_r**2)
    assert kl_penalty(logp, ref, mask, "k3")[0, 0].item() == pytest.approx(0.5 - 1 - log_r)
    for est in ("k1", "k2", "k3"):
        assert kl_penalty(logp, ref, mask, est)[0, 1].item() == 0.0
        assert kl_penalty(logp, logp, mask, est).abs().max().item() == 0.0
    with pytest.raises(ValueError, match="kl_estimator"):
        kl_penalty(logp, ref, mask, "k9")


def test_extreme_log_ratios_and_garbage_under_the_mask_stay_finite() -> None:
    mu = torch.tensor([[0.0, 0.0, float("nan"), -float("inf")]])
    logp = torch.tensor([[100.0, -100.0, float("inf"), 3.0]], requires_grad=True)
    adv = torch.tensor([[1.0, -1.0, float("nan"), 1.0]])
    mask = torch.tensor([[True, True, False, False]])
    for fn in (
        lambda: ppo_clip_loss(logp, mu, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0)[0],
        lambda: rollout_is_loss(logp, mu, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2)[0],
        lambda: cispo_loss(logp, mu, adv, mask, eps_low=1.0, eps_high=1.0)[0],
        lambda: kl_penalty(logp, mu, mask, "k3"),
    ):
        logp.grad = None
        loss = fn()
        loss.sum().backward()
        assert torch.isfinite(loss).all() and torch.isfinite(logp.grad).all()
        assert loss[0, 2:].abs().sum() == 0 and logp.grad[0, 2:].abs().sum() == 0


def test_gradcheck_float64() -> None:
    g = torch.Generator().manual_seed(0)
    mask = torch.tensor([[True, True, False, True], [False, True, True, True]])
    old = torch.randn(2, 4, dtype=torch.float64, generator=g) * 0.3 - 1.0
    adv = torch.randn(2, 4, dtype=torch.float64, generator=g)
    ref = torch.randn(2, 4, dtype=torch.float64, generator=g) * 0.3 - 1.0
    # ratios in the open interior of every clip region (no kinks at the sample point)
    logp = (old + torch.tensor([[0.05, -0.5, 0.0, 0.6], [0.0, 0.1, 1.5, -0.05]], dtype=torch.float64)).requires_grad_()

    def ppo(x: torch.Tensor) -> torch.Tensor:
        return ppo_clip_loss(x, old, adv, mask, clip_eps_low=0.2, clip_eps_high=0.2, dual_clip=3.0)[0]

    assert torch.autograd.gradcheck(ppo, (logp,))
    # rollout_is and CISPO detach their weight, so their gradient is not the derivative of their value:
    # the hand-computed tests above check it against the closed form -w · A instead
    for est in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda x, e=est: kl_penalty(x, ref, mask, e), (logp,))
