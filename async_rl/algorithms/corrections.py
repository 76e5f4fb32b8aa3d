"""Off-policy corrections on ρ_t = π_old(y_t) / μ(y_t), in SkyRL's order and with its semantics.

Each step works on the mask the steps before it left, so a token or a row already dropped never
enters a later statistic (a wild log ratio on a dropped token cannot move anything):

1. outlier sequence mask, on the loss mask M0: drop a row if any token has ρ_t > outlier_high or
   ρ_t < outlier_low (either bound alone enables it, the other side unchecked) -> M1;
2. token mask ("icepop"), on M1: drop tokens with ρ_t outside [token_mask_low, token_mask_high]
   (inclusive; only with both bounds set) -> M2;
2b. (this project's) M2 mask, on M2: drop the tokens with the largest (log ρ_t)², fewest first, until
   mean (log ρ_t)² over the tokens left is <= m2_threshold (M2PO's second-moment trust region) -> M2;
3. TIS on M2: token weight min(ρ_t, C) (no lower clip), or one row weight min(exp(clamp(Σ_M2 log ρ)), C);
4. sequence mask on M2: drop a row whose exp(clamp(Σ_M2 log ρ / |M2_row|)) (geometric) or
   exp(clamp(Σ_M2 log ρ)) (product) is outside its band -> M3, the tokens kept.

Per-token ratios are exp(clamp(log ρ, ±20)) compared with the bounds as ratios; sums take the
unclamped log ratios and clamp only before exp; a row with no token left counts as ratio 1. Row
metrics are fractions of all the micro-batch's rows (empty ones included), token metrics fractions
of the tokens the step looked at, all under SkyRL's names (see ``docs/algorithms.md``). The ratio is
detached: corrections re-weight or drop tokens, they never carry gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from async_rl.algorithms.config import CorrectionConfig
from async_rl.algorithms.metrics import masked_extremes
from async_rl.algorithms.policy_losses import LOG_RATIO_CLAMP


@dataclass(slots=True)
class CorrectionResult:
    """What the corrections decided for one micro-batch."""

    weights: torch.Tensor
    """``[B, T]`` detached TIS weights (1 where TIS is off; 0 outside the loss mask)."""
    keep: torch.Tensor
    """bool ``[B, T]``: loss-mask tokens that survived every mask."""
    metrics: dict[str, torch.Tensor]
    """0-d tensors named as in ``docs/algorithms.md``: ``*_ratio`` fractions (SkyRL's), ``*_frac`` fractions of
    the response tokens, ``*_count`` counts; ``*_max`` / ``*_min`` are ±inf when nothing was looked at
    (:func:`~async_rl.algorithms.metrics.to_floats` drops them)."""


def _exp(log_ratio: torch.Tensor) -> torch.Tensor:
    return torch.exp(torch.clamp(log_ratio, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))


def _frac(part: torch.Tensor, whole: torch.Tensor | float) -> torch.Tensor:
    whole_t = whole if isinstance(whole, torch.Tensor) else torch.tensor(whole)
    return part.sum().to(torch.float64) / whole_t.to(torch.float64).clamp(min=1)


def second_moment_keep(log_ratio: torch.Tensor, mask: torch.Tensor, threshold: float) -> torch.Tensor:
    """The largest subset of ``mask`` whose mean (log ρ)² is <= ``threshold``, made by dropping the largest (log ρ)²
    first (M2PO's masking; ties broken by position). Sorted ascending, the running mean of (log ρ)² never falls,
    so the kept tokens are the longest prefix whose running mean is within the bound."""
    flat_mask = mask.reshape(-1)
    sq = torch.where(flat_mask, log_ratio.reshape(-1).square(), torch.full_like(log_ratio.reshape(-1), torch.inf))
    order = torch.argsort(sq, stable=True)  # masked-out entries (inf) last
    n = int(flat_mask.sum())
    if n == 0:
        return mask.clone()
    sorted_sq = sq[order][:n]
    running_mean = torch.cumsum(sorted_sq.to(torch.float64), 0) / torch.arange(1, n + 1, device=sq.device)
    num_keep = int((running_mean <= threshold).sum())
    keep = torch.zeros_like(flat_mask)
    keep[order[:num_keep]] = True
    return keep.reshape(mask.shape)


def apply_corrections(log_ratio: torch.Tensor, loss_mask: torch.Tensor, cfg: CorrectionConfig) -> CorrectionResult:
    """Masks and TIS weights from ``log_ratio = log π_old - log μ`` (``[B, T]``) on the bool ``loss_mask``."""
    if log_ratio.shape != loss_mask.shape:
        raise ValueError(f"log_ratio shape {tuple(log_ratio.shape)} != loss_mask shape {tuple(loss_mask.shape)}")
    m0 = loss_mask.bool()
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    lr = torch.nan_to_num(torch.where(m0, log_ratio.detach(), zero), nan=0.0)  # NaN only ever sits under the mask
    ratio = _exp(lr)
    num_rows = float(lr.shape[0]) if lr.dim() else 0.0
    keep = m0.clone()
    metrics: dict[str, torch.Tensor] = {}
    if cfg.any_enabled:
        metrics["correction_rows_count"] = torch.tensor(num_rows, dtype=torch.float64, device=lr.device)

    if cfg.outlier_enabled:
        over = m0 & (ratio > cfg.outlier_high) if cfg.outlier_high is not None else torch.zeros_like(m0)
        under = m0 & (ratio < cfg.outlier_low) if cfg.outlier_low is not None else torch.zeros_like(m0)
        bad_row = (over | under).any(dim=-1)
        keep &= ~bad_row.unsqueeze(-1)
        metrics["outlier_seq_masked_ratio"] = _frac(bad_row, num_rows)
        metrics["outlier_seq_over_high_ratio"] = _frac(over.any(dim=-1), num_rows)
        metrics["outlier_seq_under_low_ratio"] = _frac(under.any(dim=-1), num_rows)
        metrics["outlier_masked_sequences_count"] = bad_row.sum().to(torch.float64)
        metrics["outlier_masked_frac"] = _frac(m0 & ~keep, m0.sum())

    if cfg.token_mask_enabled:
        assert cfg.token_mask_low is not None and cfg.token_mask_high is not None
        seen = keep.clone()
        over, under = seen & (ratio > cfg.token_mask_high), seen & (ratio < cfg.token_mask_low)
        keep &= ~(over | under)
        metrics["token_mask_ratio"] = _frac(over | under, seen.sum())
        metrics["token_mask_over_high_ratio"] = _frac(over, seen.sum())
        metrics["token_mask_under_low_ratio"] = _frac(under, seen.sum())
        metrics["token_mask_tokens_count"] = seen.sum().to(torch.float64)
        metrics["token_masked_frac"] = _frac(over | under, m0.sum())

    if cfg.m2_mask:
        seen = keep.clone()
        m2_keep = second_moment_keep(lr, seen, cfg.m2_threshold)
        sq = lr.square()
        metrics["m2_mask_ratio"] = _frac(seen & ~m2_keep, seen.sum())
        metrics["m2_mask_tokens_count"] = seen.sum().to(torch.float64)
        metrics["m2_before"] = _frac(torch.where(seen, sq, zero), seen.sum())
        metrics["m2_after"] = _frac(torch.where(m2_keep, sq, zero), m2_keep.sum())
        metrics["m2_masked_frac"] = _frac(seen & ~m2_keep, m0.sum())
        keep = m2_keep

    m2 = keep.clone()  # what TIS and the sequence mask look at
    row_log_sum = torch.where(m2, lr, zero).sum(dim=-1)  # unclamped; clamped only inside _exp
    weights = torch.ones_like(lr)
    if cfg.tis == "token":
        weights = torch.clamp(ratio, max=cfg.token_tis_cap)
        metrics["tis_token_clip_high_ratio"] = _frac(m2 & (ratio > cfg.token_tis_cap), m2.sum())
    elif cfg.tis == "sequence":
        row_ratio = _exp(row_log_sum)
        weights = torch.clamp(row_ratio, max=cfg.sequence_tis_cap).unsqueeze(-1).expand_as(lr)
        metrics["tis_seq_clip_high_ratio"] = _frac(row_ratio > cfg.sequence_tis_cap, num_rows)
    weights = torch.where(m0, weights, zero)
    if cfg.tis != "off":
        metrics["tis_tokens_count"] = m2.sum().to(torch.float64)
        metrics["tis_weight_mean"] = _frac(torch.where(m2, weights, zero), m2.sum())
        metrics |= masked_extremes(weights, m2, "tis_weight")

    if cfg.sequence_mask != "off":
        if cfg.sequence_mask == "geometric":
            stat = _exp(row_log_sum / m2.sum(dim=-1).clamp(min=1).to(lr.dtype))
            low, high, name = cfg.geometric_low, cfg.geometric_high, "geo_sequence_mask"
        else:
            stat = _exp(row_log_sum)
            low, high, name = cfg.product_low, cfg.product_high, "product_sequence_mask"
        over_row, under_row = stat > high, stat < low
        bad_row = over_row | under_row
        before = keep.clone()
        keep &= ~bad_row.unsqueeze(-1)
        metrics[f"{name}_masked_ratio"] = _frac(bad_row, num_rows)
        metrics[f"{name}_over_high_ratio"] = _frac(over_row, num_rows)
        metrics[f"{name}_under_low_ratio"] = _frac(under_row, num_rows)
        metrics["sequence_masked_sequences_count"] = bad_row.sum().to(torch.float64)
        metrics["sequence_masked_frac"] = _frac(before & ~keep, m0.sum())

    if cfg.any_enabled:
        metrics["kept_frac"] = _frac(keep, m0.sum())
    return CorrectionResult(weights=weights, keep=keep, metrics=metrics)
