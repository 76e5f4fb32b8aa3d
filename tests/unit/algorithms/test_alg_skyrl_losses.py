"""The five SkyRL losses through make_loss_fn, with and without TIS: values and autograd gradients against
closed forms, hand-computed in float64.

One batch of five response tokens (two rows; row 1's last position is masked and holds wild values). For each
token the test fixes log π_θ, r = π_θ/π_old and ρ = π_old/μ; then π_θ/μ = r·ρ. With token_mean over N = 5:

    token       t0     t1     t2     t3     t4
    A           1     -1      2     -1      0.5
    log π_θ    -1     -0.5   -2     -0.25  -1.5
    r           1.5    4      1      0.45   1.1
    ρ           1      2      0.4    1.2    1
    r·ρ         1.5    8      0.4    0.54   1.1

(No ratio sits on a clip bound, where float rounding would decide.)

PPO (regular, clip [0.8, 1.2]): ℓ = max(-A r, -A clip(r)), gradient -A r where the unclipped term is active,
0 where the clip is. IS-weighted (rollout_is, CISPO): ℓ = -w · A · log π_θ with a detached w, gradient -w · A.
The loss is Σ w_tis · ℓ / 5 and its gradient Σ w_tis · ∂ℓ / 5.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
from _alg_batches import micro_batch

from async_rl.algorithms import AlgorithmConfig, make_loss_fn
from async_rl.algorithms.batch import ForwardOutput
from async_rl.config.configurable import from_dict

F64 = torch.float64
MASK = torch.tensor([[True, True, True], [True, True, False]])
ADV = torch.tensor([[1.0, -1.0, 2.0], [-1.0, 0.5, 1e6]], dtype=F64)
LOGP = torch.tensor([[-1.0, -0.5, -2.0], [-0.25, -1.5, 40.0]], dtype=F64)
R = torch.tensor([[1.5, 4.0, 1.0], [0.45, 1.1, 1.0]], dtype=F64)
RHO = torch.tensor([[1.0, 2.0, 0.4], [1.2, 1.0, 1.0]], dtype=F64)
OLD = torch.where(MASK, LOGP - R.log(), torch.tensor(-30.0, dtype=F64))
MU = torch.where(MASK, OLD - RHO.log(), torch.tensor(50.0, dtype=F64))
TOKEN_TIS = {"tis": "token", "token_tis_cap": 1.5}  # weights min(ρ, 1.5) = 1, 1.5, 0.4, 1.2, 1
SEQ_TIS = {"tis": "sequence", "sequence_tis_cap": 5.0}  # row weights min(Π ρ, 5): 1 · 2 · 0.4 = 0.8 and 1.2 · 1 = 1.2


def _grad(*per_token: float) -> torch.Tensor:
    """The five per-token gradients laid out in the batch, divided by N = 5; 0 at the masked position."""
    g = torch.zeros(2, 3, dtype=F64)
    g[MASK] = torch.tensor(per_token, dtype=F64) / 5
    return g


CASES = [
    # regular: ℓ = -1.2 (clipped), 4, -2, 0.8 (clipped), -0.55: Σ = 1.05; gradient -A r on t1, t2, t4
    ("regular", {}, 1.05 / 5, _grad(0, 4, -2, 0, -0.55), 2 / 5),
    # × (1, 1.5, 0.4, 1.2, 1): -1.2 + 6 - 0.8 + 0.96 - 0.55 = 4.41
    ("regular", TOKEN_TIS, 4.41 / 5, _grad(0, 6, -0.8, 0, -0.55), 2 / 5),
    # dual clip c = 3: t1 (A < 0) capped at -A·3 = 3 (gradient 0): Σ = 1.05 - 4 + 3 = 0.05
    ("dual_clip", {}, 0.05 / 5, _grad(0, 0, -2, 0, -0.55), 2 / 5),
    # × TIS: -1.2 + 3·1.5 - 0.8 + 0.96 - 0.55 = 2.91
    ("dual_clip", TOKEN_TIS, 2.91 / 5, _grad(0, 0, -0.8, 0, -0.55), 2 / 5),
    # rollout_is, open band (0.5, 2) on r·ρ: t0 (1.5), t3 (0.54), t4 (1.1) in; t1 (8) and t2 (0.4) get 0.
    # ℓ = -1.5·1·(-1) = 1.5, -0.54·(-1)·(-0.25) = -0.135, -1.1·0.5·(-1.5) = 0.825: Σ = 2.19; gradient -w·A
    ("rollout_is", {}, 2.19 / 5, _grad(-1.5, 0, 0, 0.54, -0.55), 2 / 5),
    # × row weights 0.8 and 1.2: 0.8 · 1.5 + 1.2 · (-0.135 + 0.825) = 2.028
    ("rollout_is", SEQ_TIS, 2.028 / 5, _grad(-1.2, 0, 0, 0.648, -0.66), 2 / 5),
    # CISPO on π_old: w = clip(r, 0.5, 2) = 1.5, 2, 1, 0.5, 1.1; ℓ = 1.5, -2·(-1)·(-0.5) = -1, -1·2·(-2) = 4,
    # -0.5·(-1)·(-0.25) = -0.125, 0.825: Σ = 5.2; t1 (r = 4) and t3 (0.45) are clipped
    ("cispo_old", {}, 5.2 / 5, _grad(-1.5, 2, -2, 0.5, -0.55), 2 / 5),
    # × (1, 1.5, 0.4, 1.2, 1): 1.5 - 1.5 + 1.6 - 0.15 + 0.825 = 2.275
    ("cispo_old", TOKEN_TIS, 2.275 / 5, _grad(-1.5, 3, -0.8, 0.6, -0.55), 2 / 5),
    # CISPO on μ: w = clip(r·ρ, 0.5, 2) = 1.5, 2, 0.5, 0.54, 1.1; ℓ = 1.5, -1, -0.5·2·(-2) = 2, -0.135, 0.825:
    # Σ = 3.19; t1 (8) and t2 (0.4) are clipped
    ("cispo_rollout", {}, 3.19 / 5, _grad(-1.5, 2, -1, 0.54, -0.55), 2 / 5),
]
LOSSES = {
    "regular": {"type": "regular"},
    "dual_clip": {"type": "dual_clip", "dual_clip": 3.0},
    "rollout_is": {"type": "rollout_is", "clip_eps_low": 0.5, "clip_eps_high": 1.0},
    "cispo_old": {"type": "cispo", "cispo_anchor": "old", "cispo_eps_clip_low": 0.5, "cispo_eps_clip_high": 1.0},
    "cispo_rollout": {"type": "cispo", "cispo_anchor": "rollout", "cispo_eps_clip_low": 0.5,
                      "cispo_eps_clip_high": 1.0},
}  # fmt: skip


def _run(loss: dict, correction: dict) -> tuple[torch.Tensor, torch.Tensor, dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # rollout_is + TIS warns (test_alg_config.py checks it)
        cfg = from_dict(AlgorithmConfig, {"loss": loss, "correction": correction})
    logp = LOGP.clone().requires_grad_()
    mb = micro_batch(MASK, MU.clone(), ADV.clone(), proximal=OLD.clone())
    value, metrics = make_loss_fn(cfg)(ForwardOutput(logprobs=logp), mb)
    value.backward()
    assert logp.grad is not None
    return value.detach(), logp.grad, metrics


@pytest.mark.parametrize(("loss", "correction", "value", "grad", "clip_ratio"), CASES)
def test_five_losses_with_and_without_tis(
    loss: str, correction: dict, value: float, grad: torch.Tensor, clip_ratio: float
) -> None:
    got, g, m = _run(LOSSES[loss], correction)
    assert got.item() == pytest.approx(value, rel=1e-12, abs=1e-15)
    torch.testing.assert_close(g, grad, rtol=1e-12, atol=1e-15)
    assert m["clip_ratio"] == pytest.approx(clip_ratio)
    # is_ratio: π_old/μ = ρ whenever π_old is read (mean (1 + 2 + 0.4 + 1.2 + 1) / 5 = 1.12), else sg(π_θ)/μ = r·ρ
    # (mean (1.5 + 8 + 0.4 + 0.54 + 1.1) / 5 = 2.308)
    reads_old = loss in ("regular", "dual_clip", "cispo_old") or bool(correction)
    assert m["is_ratio_mean"] == pytest.approx(1.12 if reads_old else 2.308)
    if correction.get("tis") == "token":  # ρ = 2 on t1 is the one above the cap 1.5
        assert m["tis_token_clip_high_ratio"] == pytest.approx(1 / 5)
    if loss == "dual_clip":
        assert m["dual_clip_frac"] == pytest.approx(1 / 5)


def test_cispo_ratio_metrics() -> None:
    _, _, m = _run(LOSSES["cispo_old"], {})
    # r = 1.5, 4, 1, 0.45, 1.1: mean 8.05/5; clamped to [0.5, 2]: 6.1/5; extremes over the response tokens only
    assert m["cispo/ratio_mean"] == pytest.approx(8.05 / 5) and m["cispo/ratio_clamped_mean"] == pytest.approx(6.1 / 5)
    assert m["cispo/ratio_max"] == pytest.approx(4.0) and m["cispo/ratio_min"] == pytest.approx(0.45)
    _, _, m = _run(LOSSES["cispo_rollout"], {})
    # r·ρ = 1.5, 8, 0.4, 0.54, 1.1: mean 11.54/5, clamped 1.5 + 2 + 0.5 + 0.54 + 1.1 = 5.64
    assert m["cispo/ratio_mean"] == pytest.approx(11.54 / 5)
    assert m["cispo/ratio_clamped_mean"] == pytest.approx(5.64 / 5)
    assert m["cispo/ratio_max"] == pytest.approx(8.0)


def test_tis_with_rollout_anchored_cispo_is_refused() -> None:
    with pytest.raises(ValueError, match="would count the off-policy gap twice"):
        from_dict(AlgorithmConfig, {"loss": LOSSES["cispo_rollout"], "correction": TOKEN_TIS})


def test_the_masked_position_is_inert_and_an_all_masked_batch_gives_zero() -> None:
    # the masked position holds log π_θ = 40, π_old = e^-30, μ = e^50, A = 1e6: its gradient is exactly 0 above
    # (the closed forms put 0 there); here all of a batch's tokens are masked
    none = torch.zeros(2, 3, dtype=torch.bool)
    for name, loss in LOSSES.items():
        cfg = from_dict(AlgorithmConfig, {"loss": loss, "correction": {"outlier_mask": True, "token_mask": True,
                                                                      "sequence_mask": "geometric"}})  # fmt: skip
        logp = LOGP.clone().requires_grad_()
        mb = micro_batch(none, MU, ADV, proximal=OLD, step_num_tokens=0, step_num_sequences=0)
        value, m = make_loss_fn(cfg)(ForwardOutput(logprobs=logp), mb)
        value.backward()
        assert value.item() == 0.0 and logp.grad is not None and not logp.grad.any(), name
        # SkyRL's statistics of an empty mask: ratio mean 0, std / max / min over the six zero entries: 0
        assert m["is_ratio_mean"] == 0 and m["is_ratio_std"] == 0 and m["is_ratio_max"] == 0, name
        assert m["clip_ratio"] == 0 and m["kept_frac"] == 0 and all(math.isfinite(v) for v in m.values()), name


def test_a_token_the_token_mask_dropped_cannot_dominate_a_row() -> None:
    # one row, π_θ = π_old (r = 1), A = 1, log π = -1; ρ = e^15, 1.2, 1. The token mask drops t0 first, so the
    # sequence TIS weight is min(1.2 · 1, 5) = 1.2 (taking t0 in would give the cap, 5) and regular's ℓ = -1:
    # loss (-1.2 - 1.2) / 3 (the dropped token stays in the denominator, as in SkyRL) = -0.8
    mask = torch.ones(1, 3, dtype=torch.bool)
    logp = torch.full((1, 3), -1.0, dtype=F64)
    mu = logp - torch.tensor([[15.0, math.log(1.2), 0.0]], dtype=F64)
    correction = {"token_mask": True, **SEQ_TIS}
    for renormalize, denom in ((False, 3), (True, 2)):  # renormalize: the project's option, survivors only
        cfg = from_dict(AlgorithmConfig, {"loss": {"type": "regular", "renormalize": renormalize},
                                          "correction": correction})  # fmt: skip
        lp = logp.clone().requires_grad_()
        value, m = make_loss_fn(cfg)(ForwardOutput(logprobs=lp), micro_batch(mask, mu, torch.ones(1, 3, dtype=F64),
                                                                              proximal=logp.clone()))  # fmt: skip
        value.backward()
        assert value.item() == pytest.approx(-2.4 / denom, rel=1e-12)
        torch.testing.assert_close(lp.grad, torch.tensor([[0.0, -1.2, -1.2]], dtype=F64) / denom)
        assert m["token_mask_ratio"] == pytest.approx(1 / 3) and m["tis_seq_clip_high_ratio"] == 0
