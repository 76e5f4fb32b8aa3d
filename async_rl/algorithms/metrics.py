"""Loss metrics: IS-ratio statistics, staleness histogram, and aggregation over micro-batches.

Naming convention (what :func:`reduce_metrics` does with each key over the micro-batches of a step):

* ``*_count`` and ``*_sum``: summed;
* ``*_max`` / ``*_min``: max / min (absent when a micro-batch had no response token);
* anything else is a mean over the micro-batch's response tokens, averaged weighted by
  ``loss_tokens_count`` (the token-weighted average that backends take, see ``actors/learner/backend.py``);
* for every ``X_sq_mean`` next to ``X_mean``, the result also gets ``X_std``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping

import torch

from async_rl.algorithms.policy_losses import LOG_RATIO_CLAMP

WEIGHT_KEY = "loss_tokens_count"
"""The metric holding a micro-batch's response-token count: the weight of its means."""


def masked_extremes(x: torch.Tensor, mask: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """``{name}_max`` / ``{name}_min`` of ``x`` over ``mask`` without a host sync (±inf when the mask is empty,
    dropped by :func:`to_floats`)."""
    if x.numel() == 0:
        return {}
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    return {f"{name}_max": torch.where(mask, x, -inf).max(), f"{name}_min": torch.where(mask, x, inf).min()}


def ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, prefix: str = "is_ratio") -> dict[str, torch.Tensor]:
    """ρ = exp(log_ratio) mean / mean square / max / min and |log ρ| mean / max over ``mask`` (0-d tensors)."""
    m = mask.bool()
    lr = torch.where(m, log_ratio.detach(), torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device))
    n = m.sum().clamp(min=1).to(lr.dtype)
    ratio = torch.where(m, torch.exp(torch.clamp(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), torch.zeros_like(lr))
    abs_lr = lr.abs()
    out = {
        f"{prefix}_mean": ratio.sum() / n,
        f"{prefix}_sq_mean": ratio.square().sum() / n,
        "abs_log_ratio_mean": abs_lr.sum() / n,
    }
    out |= masked_extremes(ratio, m, prefix)
    if abs_lr.numel():
        out["abs_log_ratio_max"] = abs_lr.max()  # 0 outside the mask, and |log ρ| >= 0
    return out


def staleness_tensors(
    token_versions: torch.Tensor, mask: torch.Tensor, learner_version: int, hist_max: int = 8
) -> dict[str, torch.Tensor]:
    """Staleness = learner_version - token version over ``mask``: mean, max, min and a histogram of token counts.

    Keys: ``staleness_mean``, ``staleness_max``, ``staleness_min``, ``staleness_hist_{k}_count`` for k in
    0..hist_max-1, ``staleness_hist_ge{hist_max}_count``, and ``staleness_hist_neg_count`` for tokens
    newer than the learner (a learner restarted from an older checkpoint while generators kept newer
    weights): counted, not fatal. No host sync.
    """
    if hist_max < 1:
        raise ValueError(f"algorithm.staleness_hist_max must be >= 1, got {hist_max}")
    m = mask.bool()
    st = learner_version - token_versions.detach().to(torch.int64)
    out: dict[str, torch.Tensor] = {
        "staleness_mean": torch.where(m, st, 0).sum().to(torch.float64) / m.sum().clamp(min=1).to(torch.float64)
    }
    out |= masked_extremes(st.to(torch.float64), m, "staleness")
    # bucket -1 collects negatives, hist_max collects >= hist_max; masked tokens go to an extra bucket, dropped
    buckets = torch.where(m, torch.clamp(st, -1, hist_max) + 1, hist_max + 2).reshape(-1)
    counts = torch.bincount(buckets, minlength=hist_max + 3)
    for k in range(hist_max):
        out[f"staleness_hist_{k}_count"] = counts[k + 1]
    out[f"staleness_hist_ge{hist_max}_count"] = counts[hist_max + 1]
    out["staleness_hist_neg_count"] = counts[0]
    return out


def staleness_metrics(
    token_versions: torch.Tensor, mask: torch.Tensor, learner_version: int, hist_max: int = 8
) -> dict[str, float]:
    """:func:`staleness_tensors` as plain floats (one host transfer)."""
    return to_floats(staleness_tensors(token_versions, mask, learner_version, hist_max))


def to_floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """0-d tensors to floats with a single device-to-host copy; ``_max`` / ``_min`` of empty masks (±inf) dropped."""
    keys = list(metrics)
    tensors = [metrics[k] for k in keys]
    dense = [t for t in tensors if isinstance(t, torch.Tensor)]
    values: list[float]
    if dense:
        stacked = iter(torch.stack([t.detach().to(dense[0].device, torch.float64).reshape(()) for t in dense]).tolist())
        values = [float(next(stacked)) if isinstance(v, torch.Tensor) else float(v) for v in tensors]
    else:
        values = [float(v) for v in tensors]
    return {
        k: v
        for k, v in zip(keys, values, strict=True)
        if not ((k.endswith("_max") or k.endswith("_min")) and math.isinf(v))
    }


def reduce_metrics(per_micro_batch: Iterable[Mapping[str, float]]) -> dict[str, float]:
    """Aggregate loss metrics of a step's micro-batches (and ranks) by the naming convention above."""
    sums: dict[str, float] = {}
    weights: dict[str, float] = {}
    extremes: dict[str, float] = {}
    for m in per_micro_batch:
        w = float(m.get(WEIGHT_KEY, 1.0))
        for k, v in m.items():
            v = float(v)
            if k.endswith("_count") or k.endswith("_sum"):
                sums[k] = sums.get(k, 0.0) + v
            elif k.endswith("_max"):
                extremes[k] = max(extremes.get(k, v), v)
            elif k.endswith("_min"):
                extremes[k] = min(extremes.get(k, v), v)
            else:
                sums[k] = sums.get(k, 0.0) + w * v
                weights[k] = weights.get(k, 0.0) + w
    out = {k: (v / weights[k] if weights[k] > 0 else 0.0) if k in weights else v for k, v in sums.items()}
    out |= extremes
    for k in list(out):
        if k.endswith("_sq_mean"):
            base = k[: -len("_sq_mean")]
            if f"{base}_mean" in out:
                out[f"{base}_std"] = max(out[k] - out[f"{base}_mean"] ** 2, 0.0) ** 0.5
    return out
