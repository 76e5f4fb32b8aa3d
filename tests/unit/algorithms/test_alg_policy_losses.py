"""PPO clip (dual clip), rollout-anchored IS loss and KL estimators: hand-computed values, gradients, gradcheck."""

from __future__ import annotations

import math

import pytest
import torch

from async_rl.algorithms import kl_penalty, ppo_clip_loss, rollout_is_loss

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
    mu = torch.full((1, 4), -2.0, dtype=torch.float64)
    ratio = torch.tensor([[3.0, 0.5, 1.0, 9.0]], dtype=torch.float64)
    adv = torch.tensor([[1.0, 1.0, -2.0, 1.0]], dtype=torch.float64)
    mask = torch.tensor([[True, True, True, False]])
    logp = (mu + ratio.log()).requires_grad_()
    loss, clipped = rollout_is_loss(logp, mu, adv, mask, low=0.0, high=2.0)
    torch.testing.assert_close(loss, torch.tensor([[-2.0, -0.5, 2.0, 0.0]], dtype=torch.float64))
    assert clipped.tolist() == [[True, False, False, False]]
    loss.sum().backward()
    # every token gets gradient (weight * -A), clipping bounds it but never zeroes it
    torch.testing.assert_close(logp.grad, torch.tensor([[-2.0, -0.5, 2.0, 0.0]], dtype=torch.float64))
    loss2, clipped2 = rollout_is_loss(logp.detach(), mu, adv, mask, low=0.8, high=2.0)
    torch.testing.assert_close(loss2, torch.tensor([[-2.0, -0.8, 2.0, 0.0]], dtype=torch.float64))
    assert clipped2.tolist() == [[True, True, False, False]]


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
        lambda: rollout_is_loss(logp, mu, adv, mask, low=0.0, high=2.0)[0],
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

    def ris(x: torch.Tensor) -> torch.Tensor:
        return rollout_is_loss(x, old, adv, mask, low=0.0, high=2.0)[0]

    assert torch.autograd.gradcheck(ppo, (logp,))
    # rollout_is detaches its weight: its gradient equals that of -A·π/μ only inside [low, high], so check there
    assert torch.autograd.gradcheck(ris, (logp.detach().clamp(max=old + 0.6).requires_grad_(),))
    for est in ("k1", "k2", "k3"):
        assert torch.autograd.gradcheck(lambda x, e=est: kl_penalty(x, ref, mask, e), (logp,))
