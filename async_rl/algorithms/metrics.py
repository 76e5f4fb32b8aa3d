"""Loss metrics: IS-ratio statistics, staleness histogram, and aggregation over micro-batches.

Naming convention (what :func:`reduce_metrics` does with each key over the micro-batches of a step):

* ``*_count`` and ``*_sum``: summed;
* ``*_max`` / ``*_min``: max / min (absent when a micro-batch had no response token);
* anything else is a mean over the micro-batch's response tokens, averaged weighted by
  ``loss_tokens_count`` (the token-weighted average of ``actors/learner/backend.py``);
* for every ``X_sq_mean`` next to ``X_mean``, the result also gets ``X_std``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

import torch

from async_rl.algorithms.policy_losses import LOG_RATIO_CLAMP

WEIGHT_KEY = "loss_tokens_count"
"""The metric holding a micro-batch's response-token count: the weight of its means."""


def ratio_metrics(log_ratio: torch.Tensor, mask: torch.Tensor, prefix: str = "is_ratio") -> dict[str, torch.Tensor]:
    """ρ = exp(log_ratio) mean / mean square / max / min and |log ρ| mean / max over ``mask`` (0-d tensors)."""
    lr = log_ratio.detach()[mask.bool()]
    n = max(lr.numel(), 1)
    ratio = torch.exp(torch.clamp(lr, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    abs_lr = lr.abs()
    out = {
        f"{prefix}_mean": ratio.sum() / n,
        f"{prefix}_sq_mean": ratio.square().sum() / n,
        "abs_log_ratio_mean": abs_lr.sum() / n,
    }
    if lr.numel():
        out |= {f"{prefix}_max": ratio.max(), f"{prefix}_min": ratio.min(), "abs_log_ratio_max": abs_lr.max()}
    return out


def staleness_tensors(
    token_versions: torch.Tensor, mask: torch.Tensor, learner_version: int, hist_max: int = 8
) -> dict[str, torch.Tensor]:
    """Staleness = learner_version - token version over ``mask``: mean, max and a histogram of token counts.

    Keys: ``staleness_mean``, ``staleness_max``, ``staleness_hist_{k}_count`` for k in
    0..hist_max-1 and ``staleness_hist_ge{hist_max}_count``. A negative staleness (a token newer
    than the learner) means mixed-up versions: it raises ``ValueError``.
    """
    if hist_max < 1:
        raise ValueError(f"algorithm.staleness_hist_max must be >= 1, got {hist_max}")
    st = (learner_version - token_versions.detach()[mask.bool()].to(torch.int64)).to(torch.float64)
    out: dict[str, torch.Tensor] = {"staleness_mean": st.sum() / max(st.numel(), 1)}
    if st.numel():
        if bool((st < 0).any()):
            raise ValueError(
                f"token versions up to {int(learner_version - st.min())} are newer than learner version {learner_version}"
            )
        out["staleness_max"] = st.max()
    clipped = torch.clamp(st, max=hist_max).to(torch.int64)
    counts = torch.bincount(clipped, minlength=hist_max + 1)
    for k in range(hist_max):
        out[f"staleness_hist_{k}_count"] = counts[k]
    out[f"staleness_hist_ge{hist_max}_count"] = counts[hist_max]
    return out


def staleness_metrics(
    token_versions: torch.Tensor, mask: torch.Tensor, learner_version: int, hist_max: int = 8
) -> dict[str, float]:
    """:func:`staleness_tensors` as plain floats (one host transfer)."""
    return to_floats(staleness_tensors(token_versions, mask, learner_version, hist_max))


def to_floats(metrics: Mapping[str, torch.Tensor | float]) -> dict[str, float]:
    """0-d tensors to floats with a single device-to-host copy."""
    keys = list(metrics)
    tensors = [metrics[k] for k in keys]
    dense = [t for t in tensors if isinstance(t, torch.Tensor)]
    if not dense:
        return {k: float(v) for k, v in zip(keys, tensors, strict=True)}
    stacked = torch.stack([t.detach().to(dense[0].device, torch.float64).reshape(()) for t in dense]).tolist()
    it = iter(stacked)
    return {k: float(next(it)) if isinstance(v, torch.Tensor) else float(v) for k, v in zip(keys, tensors, strict=True)}


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
