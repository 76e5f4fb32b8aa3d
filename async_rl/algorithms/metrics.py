"""Loss metrics: IS-ratio statistics, staleness histogram, and aggregation over micro-batches.

Naming convention (what :func:`reduce_metrics` does with each key over the micro-batches of a step):

* ``*_count`` and ``*_sum``: summed;
* ``*_max`` / ``*_min``: max / min (absent when a micro-batch had no response token);
* a key of :data:`METRIC_WEIGHTS` is a fraction over its own denominator (rows, or the tokens a correction
  step looked at, SkyRL's definitions): averaged weighted by that denominator's ``_count`` metric, which
  makes the step's value the one a single micro-batch holding the whole step would give;
* anything else is a mean over the micro-batch's response tokens, averaged weighted by
  ``loss_tokens_count`` (the token-weighted average that backends take, see ``actors/learner/backend.py``);
* for every ``X_entries_count`` next to ``X_sum`` and ``X_sq_sum``, ``X_std`` is recomputed exactly (the
  unbiased std over all entries, SkyRL's ``is_ratio_std``).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping, Sequence

import torch

from async_rl.algorithms.policy_losses import LOG_RATIO_CLAMP

WEIGHT_KEY = "loss_tokens_count"
"""The metric holding a micro-batch's response-token count: the weight of its means."""

_ROWS = "correction_rows_count"
METRIC_WEIGHTS: dict[str, str] = {
    **{f"{mask}_{what}_ratio": _ROWS for mask in ("outlier_seq", "geo_sequence_mask", "product_sequence_mask")
       for what in ("masked", "over_high", "under_low")},
    "tis_seq_clip_high_ratio": _ROWS,
    "token_mask_ratio": "token_mask_tokens_count",
    "token_mask_over_high_ratio": "token_mask_tokens_count",
    "token_mask_under_low_ratio": "token_mask_tokens_count",
    "m2_mask_ratio": "m2_mask_tokens_count",
    "m2_before": "m2_mask_tokens_count",
    "m2_after": "m2_mask_tokens_count",
    "tis_token_clip_high_ratio": "tis_tokens_count",
    "tis_weight_mean": "tis_tokens_count",
}  # fmt: skip
"""Metrics whose denominator is not the micro-batch's response tokens, and the ``_count`` metric holding it."""


def masked_extremes(x: torch.Tensor, mask: torch.Tensor, name: str) -> dict[str, torch.Tensor]:
    """``{name}_max`` / ``{name}_min`` of ``x`` over ``mask`` without a host sync (±inf when the mask is empty,
    dropped by :func:`to_floats`)."""
    if x.numel() == 0:
        return {}
    inf = torch.tensor(float("inf"), dtype=x.dtype, device=x.device)
    return {f"{name}_max": torch.where(mask, x, -inf).max(), f"{name}_min": torch.where(mask, x, inf).min()}


def ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, prefix: str = "is_ratio") -> dict[str, torch.Tensor]:
    """Statistics of ρ = exp(clamp(log_ratio, ±20)), as SkyRL reports them (0-d tensors).

    ``{prefix}_mean`` over the tokens of ``mask``; ``{prefix}_std`` (unbiased), ``_max``, ``_min`` over *all*
    ``[B, T]`` entries with the masked ones as 0 (so ``_min`` is 0 as soon as one entry is masked);
    ``{prefix}_sum``, ``{prefix}_sq_sum``, ``{prefix}_entries_count`` let :func:`reduce_metrics` recompute the std
    of a whole step; ``abs_log_ratio_mean`` / ``_max`` (this project's) over ``mask``, unclamped.
    """
    m = mask.bool()
    zero = torch.zeros((), dtype=log_ratio.dtype, device=log_ratio.device)
    lr = torch.nan_to_num(torch.where(m, log_ratio.detach(), zero), nan=0.0)
    ratio = torch.where(m, torch.exp(torch.clamp(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)), zero)
    n = m.sum().clamp(min=1).to(lr.dtype)
    abs_lr = lr.abs()
    out = {
        f"{prefix}_mean": ratio.sum() / n,
        f"{prefix}_sum": ratio.sum(),
        f"{prefix}_sq_sum": ratio.square().sum(),
        f"{prefix}_entries_count": torch.tensor(float(ratio.numel()), dtype=torch.float64, device=lr.device),
        "abs_log_ratio_mean": abs_lr.sum() / n,
    }
    if ratio.numel():
        out[f"{prefix}_std"] = ratio.std() if ratio.numel() > 1 else zero
        out[f"{prefix}_max"] = ratio.max()
        out[f"{prefix}_min"] = ratio.min()
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
        for k, v in m.items():
            v = float(v)
            if k.endswith("_count") or k.endswith("_sum"):
                sums[k] = sums.get(k, 0.0) + v
            elif k.endswith("_max"):
                extremes[k] = max(extremes.get(k, v), v)
            elif k.endswith("_min"):
                extremes[k] = min(extremes.get(k, v), v)
            else:
                w = float(m.get(METRIC_WEIGHTS.get(k, WEIGHT_KEY), 1.0))
                sums[k] = sums.get(k, 0.0) + w * v
                weights[k] = weights.get(k, 0.0) + w
    out = {k: (v / weights[k] if weights[k] > 0 else 0.0) if k in weights else v for k, v in sums.items()}
    out |= extremes
    for k in list(out):
        if k.endswith("_sq_mean"):
            base = k[: -len("_sq_mean")]
            if f"{base}_mean" in out:
                out[f"{base}_std"] = max(out[k] - out[f"{base}_mean"] ** 2, 0.0) ** 0.5
        elif k.endswith("_entries_count"):
            base = k[: -len("_entries_count")]
            n, total, sq = out[k], out.get(f"{base}_sum"), out.get(f"{base}_sq_sum")
            if total is not None and sq is not None:
                out[f"{base}_std"] = (max(sq - total * total / n, 0.0) / (n - 1)) ** 0.5 if n > 1 else 0.0
    return out


def parts_to_floats(parts: Sequence[tuple[Mapping[str, torch.Tensor | float], torch.Tensor | float]]
                    ) -> list[dict[str, float]]:  # fmt: skip
    """Per-micro-batch ``(metrics, weight)`` as float dicts, each with its :data:`WEIGHT_KEY` (the given weight where
    the loss left it out), with one device-to-host copy for all of them: the backends keep a micro-batch's metrics
    on the device until the step's work is queued (a ``float()`` per micro-batch made the host wait for each)."""
    flat: dict[str, torch.Tensor | float] = {}
    for i, (m, w) in enumerate(parts):
        for k, v in m.items():
            flat[f"{i}\x00{k}"] = v
        if WEIGHT_KEY not in m:
            flat[f"{i}\x00{WEIGHT_KEY}"] = w
    out: list[dict[str, float]] = [{} for _ in parts]
    for key, v in to_floats(flat).items():
        index, name = key.split("\x00", 1)
        out[int(index)][name] = v
    return out

