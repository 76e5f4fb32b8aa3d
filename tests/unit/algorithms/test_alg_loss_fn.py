"""make_loss_fn end to end on explicit tensors: values, gradients, micro-batch sums, garbage, extremes, errors."""

from __future__ import annotations

import math

import pytest
import torch
from _alg_batches import micro_batch, rows

from async_rl.algorithms import AlgorithmConfig, make_loss_fn, reduce_metrics
from async_rl.algorithms.batch import ForwardOutput
from async_rl.config.configurable import from_dict

LN = math.log


def _cfg(**sections: dict) -> AlgorithmConfig:
    return from_dict(AlgorithmConfig, sections)


def _random_batch(seed: int, dtype: torch.dtype = torch.float64, b: int = 6, t: int = 8):
    g = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([8, 5, 0, 3, 8, 1])[:b]
    mask = (torch.arange(t).unsqueeze(0) >= 1) & (torch.arange(t).unsqueeze(0) < lengths.unsqueeze(1))
    mu = -torch.rand(b, t, generator=g, dtype=dtype) * 3
    logp = mu + torch.randn(b, t, generator=g, dtype=dtype) * 0.4
    prox = mu + torch.randn(b, t, generator=g, dtype=dtype) * 0.2
    ref = mu + torch.randn(b, t, generator=g, dtype=dtype) * 0.2
    adv = torch.randn(b, 1, generator=g, dtype=dtype).expand(b, t).clone()
    ent = torch.rand(b, t, generator=g, dtype=dtype)
    mb = micro_batch(mask, mu, adv, proximal=prox, reference=ref, versions=torch.randint(3, 6, (b, t), generator=g))
    return logp, ent, mb


def test_on_policy_default_loss_hand_computed() -> None:
    mask = torch.tensor([[False, True, True, True], [False, True, False, False]])
    mu = torch.full((2, 4), -1.0)
    adv = torch.tensor([[0.0, 1.0, 1.0, 1.0], [0.0, -2.0, 0.0, 0.0]])
    logp = mu.clone().requires_grad_()
    loss, m = make_loss_fn(AlgorithmConfig())(ForwardOutput(logprobs=logp), micro_batch(mask, mu, adv))
    # default: CISPO on π/μ = 1, weight 1; per token -1 · A · log π = A (log π = -1): (1 + 1 + 1 - 2) / 4 tokens
    assert loss.item() == pytest.approx(0.25)
    loss.backward()
    torch.testing.assert_close(logp.grad, torch.where(mask, -adv / 4, torch.zeros(())))  # -w · A / N
    assert m["loss_tokens_count"] == 4 and m["loss_sequences_count"] == 2 and m["clip_ratio"] == 0
    assert m["is_ratio_mean"] == 1 and m["abs_log_ratio_max"] == 0 and m["loss_sum"] == pytest.approx(0.25)
    assert m["cispo/ratio_mean"] == 1 and m["cispo/ratio_clamped_mean"] == 1


def test_kl_and_entropy_terms() -> None:
    mask = torch.tensor([[True, True, False]])
    mu = torch.tensor([[LN(0.5), LN(0.5), 0.0]])
    ref = torch.tensor([[LN(0.25), LN(0.5), 0.0]])
    adv = torch.zeros(1, 3)
    ent = torch.tensor([[1.0, 3.0, 50.0]], requires_grad=True)
    cfg = _cfg(loss={"kl_coef": 0.5, "kl_estimator": "k3", "entropy_coef": 0.1})
    assert cfg.needs_reference_logprobs and cfg.needs_entropy
    logp = mu.clone().requires_grad_()
    loss, m = make_loss_fn(cfg)(ForwardOutput(logprobs=logp, entropy=ent), micro_batch(mask, mu, adv, reference=ref))
    k3 = 0.5 - 1 - LN(0.5)
    assert m["kl_mean"] == pytest.approx(k3 / 2) and m["entropy_mean"] == pytest.approx(2.0)
    assert loss.item() == pytest.approx((0.5 * k3 - 0.1 * (1 + 3)) / 2)
    loss.backward()
    torch.testing.assert_close(ent.grad, torch.tensor([[-0.05, -0.05, 0.0]]))


CONFIGS = [
    {},
    {"loss": {"type": "ppo", "reduction": "seq_mean_token_mean"}, "correction": {"token_mask": True}},
    {"loss": {"type": "regular", "reduction": "seq_mean_token_sum", "kl_coef": 0.1},
     "correction": {"tis": "token", "outlier_mask": True, "sequence_mask": "geometric", "geometric_low": 0.5,
                    "geometric_high": 2.0}},
    {"loss": {"type": "dual_clip", "reduction": "token_sum_norm", "max_tokens": 8, "entropy_coef": 0.01},
     "correction": {"tis": "sequence", "sequence_mask": "product", "product_low": 0.1, "product_high": 10.0}},
    {"loss": {"type": "rollout_is", "clip_eps_high": 0.5},
     "correction": {"outlier_mask": True, "outlier_low": None, "outlier_high": 3.0, "token_mask": True}},
    {"loss": {"type": "cispo", "cispo_anchor": "old", "cispo_eps_clip_low": 0.3},
     "correction": {"tis": "token", "token_mask": True, "token_mask_low": 0.8, "token_mask_high": 1.25}},
]  # fmt: skip


@pytest.mark.parametrize("sections", CONFIGS)
def test_micro_batches_sum_to_the_full_batch(sections: dict) -> None:
    cfg = _cfg(**sections)
    fn = make_loss_fn(cfg, learner_version=6)
    logp, ent, mb = _random_batch(0)
    full_lp = logp.clone().requires_grad_()
    full, full_m = fn(ForwardOutput(logprobs=full_lp, entropy=ent), mb)
    full.backward()
    part_lp = logp.clone().requires_grad_()
    total, metrics = torch.zeros((), dtype=torch.float64), []
    for lo in (0, 2, 4):
        loss, m = fn(ForwardOutput(logprobs=part_lp[lo : lo + 2], entropy=ent[lo : lo + 2]), rows(mb, lo, lo + 2))
        total = total + loss
        metrics.append(m)
    total.backward()
    assert total.item() == pytest.approx(full.item(), rel=1e-10)
    torch.testing.assert_close(part_lp.grad, full_lp.grad)
    agg = reduce_metrics(metrics)
    for k, v in full_m.items():
        assert agg[k] == pytest.approx(v, rel=1e-9, abs=1e-12), k
    assert agg["staleness_hist_0_count"] + agg["staleness_hist_1_count"] + agg["staleness_hist_2_count"] + agg[
        "staleness_hist_3_count"] == mb.loss_mask.sum()  # fmt: skip


@pytest.mark.parametrize("sections", CONFIGS)
def test_garbage_under_the_mask_and_all_masked_rows_stay_finite(sections: dict) -> None:
    cfg = _cfg(**sections)
    logp, ent, mb = _random_batch(1, dtype=torch.float32)
    pad = ~mb.loss_mask
    for t in (mb.behaviour_logprobs, mb.advantages, mb.proximal_logprobs, mb.reference_logprobs, ent):
        t[pad] = float("nan")
    logp = logp.masked_fill(pad, float("inf")).requires_grad_()
    loss, m = make_loss_fn(cfg, learner_version=5)(ForwardOutput(logprobs=logp, entropy=ent), mb)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()
    assert logp.grad[pad].abs().sum() == 0 and logp.grad[2].abs().sum() == 0  # row 2 has no response token
    assert all(math.isfinite(v) for v in m.values())
    # a micro-batch with no response token at all: 0 loss, 0 gradient
    mb.loss_mask = torch.zeros_like(mb.loss_mask)
    lp2 = logp.detach().clone().requires_grad_()
    loss, m = make_loss_fn(cfg)(ForwardOutput(logprobs=lp2, entropy=ent), mb)
    loss.backward()
    assert loss.item() == 0.0 and lp2.grad.abs().sum() == 0 and all(math.isfinite(v) for v in m.values())


@pytest.mark.parametrize("sections", CONFIGS)
def test_extreme_log_ratios(sections: dict) -> None:
    cfg = _cfg(**sections)
    mask = torch.ones(2, 3, dtype=torch.bool)
    mu = torch.zeros(2, 3)
    logp = torch.tensor([[100.0, -100.0, 0.0], [-100.0, -100.0, 100.0]], requires_grad=True)
    adv = torch.tensor([[1.0] * 3, [-1.0] * 3])
    mb = micro_batch(mask, mu, adv, proximal=logp.detach().clone(), reference=-logp.detach().clone())
    loss, m = make_loss_fn(cfg)(ForwardOutput(logprobs=logp, entropy=torch.ones(2, 3)), mb)
    loss.backward()
    assert torch.isfinite(loss) and torch.isfinite(logp.grad).all() and all(math.isfinite(v) for v in m.values())


# the PPO-family configs: rollout_is and CISPO detach their weight, so their gradient -w · A · ∇log π is not the
# derivative of their value; test_alg_skyrl_losses.py checks it against closed forms instead
@pytest.mark.parametrize("sections", CONFIGS[1:4])
def test_gradcheck_float64(sections: dict) -> None:
    cfg = _cfg(**sections)
    assert cfg.loss.type in ("ppo", "regular", "dual_clip")
    fn = make_loss_fn(cfg)
    logp, ent, mb = _random_batch(2)

    def f(lp: torch.Tensor, en: torch.Tensor) -> torch.Tensor:
        return fn(ForwardOutput(logprobs=lp, entropy=en), mb)[0]

    assert torch.autograd.gradcheck(f, (logp.requires_grad_(), ent.clone().requires_grad_()))


def test_missing_inputs_are_named() -> None:
    mask = torch.ones(1, 2, dtype=torch.bool)
    z = torch.zeros(1, 2)
    out = ForwardOutput(logprobs=z.clone())
    with pytest.raises(ValueError, match="mb.proximal_logprobs is None"):
        make_loss_fn(_cfg(loss={"type": "regular"}))(out, micro_batch(mask, z, z))
    with pytest.raises(ValueError, match="mb.proximal_logprobs is None"):  # corrections read π_old too
        make_loss_fn(_cfg(correction={"token_mask": True}))(out, micro_batch(mask, z, z))
    with pytest.raises(ValueError, match="mb.reference_logprobs is None"):
        make_loss_fn(_cfg(loss={"kl_coef": 0.1}))(out, micro_batch(mask, z, z))
    with pytest.raises(ValueError, match="out.entropy is None"):
        make_loss_fn(_cfg(loss={"entropy_coef": 0.1}))(out, micro_batch(mask, z, z))
    with pytest.raises(ValueError, match="mb.advantages has shape"):
        make_loss_fn(AlgorithmConfig())(out, micro_batch(mask, z, torch.zeros(1, 3)))
    with pytest.raises(ValueError, match="mb.loss_mask has shape"):
        make_loss_fn(AlgorithmConfig())(out, micro_batch(torch.ones(1, 3, dtype=torch.bool), z, z))


def test_learner_version_callable_is_read_at_every_call() -> None:
    version = [3]
    fn = make_loss_fn(AlgorithmConfig(), learner_version=lambda: version[0])
    mask = torch.ones(1, 2, dtype=torch.bool)
    z = torch.zeros(1, 2)
    mb = micro_batch(mask, z, z, versions=torch.tensor([[3, 1]]))
    assert fn(ForwardOutput(logprobs=z.clone()), mb)[1]["staleness_max"] == 2
    version[0] = 5
    m = fn(ForwardOutput(logprobs=z.clone()), mb)[1]
    assert m["staleness_max"] == 4 and m["staleness_hist_2_count"] == 1 and m["staleness_hist_4_count"] == 1
    assert "staleness_mean" not in make_loss_fn(AlgorithmConfig())(ForwardOutput(logprobs=z.clone()), mb)[1]
