"""Property tests (hypothesis): on-policy data is untouched, TIS never exceeds C, masks only remove tokens."""

from __future__ import annotations

import math
import warnings

import torch
from _alg_batches import micro_batch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from async_rl.algorithms import AlgorithmConfig, CorrectionConfig, LossConfig, apply_corrections, make_loss_fn
from async_rl.algorithms.batch import ForwardOutput
from async_rl.algorithms.metrics import to_floats

SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def bands(draw: st.DrawFn) -> tuple[float, float]:
    """A valid keep-band: 0 < low <= 1 <= high, low < high."""
    low = draw(st.floats(1e-6, 1.0))
    high = draw(st.floats(1.0, 1e6))
    if low == high:
        high = 1.5
    return low, high


@st.composite
def corrections(draw: st.DrawFn, tis: bool = True) -> CorrectionConfig:
    (ol, oh), (tl, th), (gl, gh), (pl, ph) = draw(bands()), draw(bands()), draw(bands()), draw(bands())
    # either side of the outlier band may be absent (a one-sided band); the token mask needs both sides
    ol, oh = draw(st.sampled_from([(ol, oh), (None, oh), (ol, None)]))
    return CorrectionConfig(
        outlier_mask=draw(st.booleans()), outlier_low=ol, outlier_high=oh,
        token_mask=draw(st.booleans()), token_mask_low=tl, token_mask_high=th,
        tis=draw(st.sampled_from(["off", "token", "sequence"] if tis else ["off"])),
        token_tis_cap=draw(st.floats(1.0, 100.0)), sequence_tis_cap=draw(st.floats(1.0, 100.0)),
        sequence_mask=draw(st.sampled_from(["off", "geometric", "product"])),
        geometric_low=gl, geometric_high=gh, product_low=pl, product_high=ph,
    )  # fmt: skip


@st.composite
def ratio_batches(draw: st.DrawFn, max_abs: float = 200.0) -> tuple[torch.Tensor, torch.Tensor]:
    b = draw(st.integers(1, 4))
    t = draw(st.integers(1, 6))
    vals = draw(st.lists(st.floats(-max_abs, max_abs), min_size=b * t, max_size=b * t))
    keep = draw(st.lists(st.booleans(), min_size=b * t, max_size=b * t))
    return torch.tensor(vals, dtype=torch.float64).view(b, t), torch.tensor(keep).view(b, t)


@SETTINGS
@given(cfg=corrections(), batch=ratio_batches())
def test_on_policy_corrections_are_the_identity(
    cfg: CorrectionConfig, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    _, mask = batch
    r = apply_corrections(torch.zeros(mask.shape, dtype=torch.float64), mask, cfg)
    assert r.keep.equal(mask)
    assert r.weights.equal(mask.to(torch.float64))


@SETTINGS
@given(cfg=corrections(), batch=ratio_batches())
def test_tis_never_exceeds_its_cap_and_masks_only_remove(
    cfg: CorrectionConfig, batch: tuple[torch.Tensor, torch.Tensor]
) -> None:
    lr, mask = batch
    r = apply_corrections(lr, mask, cfg)
    cap = {"off": 1.0, "token": cfg.token_tis_cap, "sequence": cfg.sequence_tis_cap}[cfg.tis]
    assert torch.isfinite(r.weights).all()
    assert (r.weights <= cap).all() and (r.weights >= 0).all()
    assert not (r.keep & ~mask).any()
    # turning every mask off can only give back tokens, never take them
    r_off = apply_corrections(lr, mask, CorrectionConfig(tis=cfg.tis, token_tis_cap=cfg.token_tis_cap,
                                                         sequence_tis_cap=cfg.sequence_tis_cap))  # fmt: skip
    assert r_off.keep.equal(mask) and not (r.keep & ~r_off.keep).any()
    assert all(math.isfinite(v) for v in to_floats(r.metrics).values())


@SETTINGS
@given(
    cfg=corrections(),
    batch=ratio_batches(max_abs=5.0),
    loss_type=st.sampled_from(["cispo", "rollout_is", "regular", "dual_clip", "ppo"]),
    reduction=st.sampled_from(["token_mean", "seq_mean_token_mean", "seq_mean_token_sum"]),
    renormalize=st.booleans(),
)
def test_on_policy_loss_with_corrections_equals_loss_without(
    cfg: CorrectionConfig, batch: tuple[torch.Tensor, torch.Tensor], loss_type: str, reduction: str, renormalize: bool
) -> None:
    logp, mask = batch
    logp = -logp.abs()  # valid log-probabilities; μ = π_prox = π_θ
    if loss_type in ("ppo", "cispo"):  # TIS is refused with the rollout-anchored losses
        cfg.tis = "off"
    lcfg = dict(type=loss_type, reduction=reduction, renormalize=renormalize)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rollout_is + TIS warns
        with_corr = AlgorithmConfig(loss=LossConfig(**lcfg), correction=cfg)  # type: ignore[arg-type]
    plain = AlgorithmConfig(loss=LossConfig(**lcfg))  # type: ignore[arg-type]
    adv = torch.linspace(-1.0, 1.0, logp.numel(), dtype=torch.float64).view(logp.shape)
    mb = micro_batch(mask, logp.clone(), adv, proximal=logp.clone())
    results = []
    for c in (with_corr, plain):
        lp = logp.clone().requires_grad_()
        loss, metrics = make_loss_fn(c)(ForwardOutput(logprobs=lp), mb)
        loss.backward()
        results.append((loss.detach(), lp.grad, metrics))
    (l1, g1, m1), (l2, g2, m2) = results
    torch.testing.assert_close(l1, l2, rtol=0, atol=0)
    torch.testing.assert_close(g1, g2, rtol=0, atol=0)
    assert m1["is_ratio_mean"] == (1.0 if mask.any() else 0.0) and m1["clip_ratio"] == 0
    if cfg.any_enabled:
        assert m1["kept_frac"] == (1.0 if mask.any() else 0.0)
    assert all(math.isfinite(v) for v in m1.values())
