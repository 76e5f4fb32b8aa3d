"""Off-policy corrections on ρ_t = π_anchor(y_t) / μ(y_t): truncated importance sampling and masks.

Everything is computed in log space: a mask compares log ρ_t with log bounds, a TIS weight is
exp(min(log ρ, log C)), so log ratios of ±100 (or ±1e4 summed over a sequence) never overflow.
The ratio is detached: corrections re-weight or drop tokens, they never carry gradient.

Order of application (each step sees the tokens the previous ones kept, for its metrics):

1. outlier sequence mask: drop a sequence if any token's ρ_t is outside [outlier_low, outlier_high];
2. token mask ("icepop"): drop tokens with ρ_t outside [token_mask_low, token_mask_high];
3. TIS: token weight min(ρ_t, C) or one sequence weight min(Π ρ_t, C);
4. sequence mask: drop a sequence whose geometric mean (or product) of ρ_t is outside its band.

Sequence statistics (outlier test, Π ρ_t, mean log ρ_t) are taken over the response tokens as
generated (the loss mask), not over the survivors of the token mask: a sequence is judged whole.
Masks only ever remove tokens (``keep`` ⊆ ``loss_mask``); TIS weights are in [0, C].
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from async_rl.algorithms.config import CorrectionConfig
from async_rl.algorithms.metrics import masked_extremes


@dataclass(slots=True)
class CorrectionResult:
    """What the corrections decided for one micro-batch."""

    weights: torch.Tensor
    """``[B, T]`` detached TIS weights (1 where TIS is off; 0 outside the loss mask)."""
    keep: torch.Tensor
    """bool ``[B, T]``: loss-mask tokens that survived every mask."""
    metrics: dict[str, torch.Tensor]
    """0-d tensors: ``*_frac`` are fractions of the micro-batch's response tokens, ``*_count`` are counts,
    ``*_max`` / ``*_min`` are ±inf when the micro-batch has no response token (:func:`to_floats` drops them)."""


def _outside(log_ratio: torch.Tensor, low: float, high: float) -> torch.Tensor:
    return (log_ratio < math.log(low)) | (log_ratio > math.log(high))


def apply_corrections(log_ratio: torch.Tensor, loss_mask: torch.Tensor, cfg: CorrectionConfig) -> CorrectionResult:
    """Masks and TIS weights from ``log_ratio = log π_anchor - log μ`` (``[B, T]``) on the bool ``loss_mask``."""
    if log_ratio.shape != loss_mask.shape:
        raise ValueError(f"log_ratio shape {tuple(log_ratio.shape)} != loss_mask shape {tuple(loss_mask.shape)}")
    mask = loss_mask.bool()
    lr = torch.where(mask, log_ratio.detach(), torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))
    lr = torch.nan_to_num(lr, nan=0.0)  # a NaN can only come from masked-out garbage; masked positions are 0 already
    num_tokens = mask.sum().clamp(min=1).to(lr.dtype)
    seq_tokens = mask.sum(dim=-1)
    seq_log_sum = lr.sum(dim=-1)
    keep = mask.clone()
    metrics: dict[str, torch.Tensor] = {}

    def dropped_frac(before: torch.Tensor) -> torch.Tensor:
        return (before & ~keep).sum().to(lr.dtype) / num_tokens

    if cfg.outlier_mask:
        bad_seq = (mask & _outside(lr, cfg.outlier_low, cfg.outlier_high)).any(dim=-1)
        before = keep.clone()
        keep &= ~bad_seq.unsqueeze(-1)
        metrics["outlier_masked_frac"] = dropped_frac(before)
        metrics["outlier_masked_sequences_count"] = bad_seq.sum().to(lr.dtype)
    if cfg.token_mask:
        before = keep.clone()
        keep &= ~_outside(lr, cfg.token_mask_low, cfg.token_mask_high)
        metrics["token_masked_frac"] = dropped_frac(before)

    ones = torch.ones_like(lr)
    if cfg.tis == "token":
        log_cap = math.log(cfg.token_tis_cap)
        weights = torch.clamp(torch.exp(torch.clamp(lr, max=log_cap)), max=cfg.token_tis_cap)  # exp may round up
        metrics["tis_clipped_frac"] = (mask & (lr > log_cap)).sum().to(lr.dtype) / num_tokens
    elif cfg.tis == "sequence":
        log_cap = math.log(cfg.sequence_tis_cap)
        seq_w = torch.clamp(torch.exp(torch.clamp(seq_log_sum, max=log_cap)), max=cfg.sequence_tis_cap)
        weights = seq_w.unsqueeze(-1).expand_as(lr)
        clipped_seq = (seq_log_sum > log_cap) & (seq_tokens > 0)
        metrics["tis_clipped_frac"] = (mask & clipped_seq.unsqueeze(-1)).sum().to(lr.dtype) / num_tokens
        metrics["tis_clipped_sequences_count"] = clipped_seq.sum().to(lr.dtype)
    else:
        weights = ones
    weights = torch.where(mask, weights, torch.zeros_like(weights))
    if cfg.tis != "off":
        metrics["tis_weight_mean"] = weights.sum() / num_tokens
        metrics |= masked_extremes(weights, mask, "tis_weight")

    if cfg.sequence_mask != "off":
        if cfg.sequence_mask == "geometric":
            stat = seq_log_sum / seq_tokens.clamp(min=1).to(lr.dtype)
            bad_seq = _outside(stat, cfg.geometric_low, cfg.geometric_high)
        else:
            bad_seq = _outside(seq_log_sum, cfg.product_low, cfg.product_high)
        bad_seq &= seq_tokens > 0
        before = keep.clone()
        keep &= ~bad_seq.unsqueeze(-1)
        metrics["sequence_masked_frac"] = dropped_frac(before)
        metrics["sequence_masked_sequences_count"] = bad_seq.sum().to(lr.dtype)

    if cfg.any_enabled:
        metrics["kept_frac"] = keep.sum().to(lr.dtype) / num_tokens
    return CorrectionResult(weights=weights, keep=keep, metrics=metrics)
