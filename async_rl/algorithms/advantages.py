"""Group-relative advantages (GRPO, Dr. GRPO, RLOO) and their per-token broadcast.

A group is the ``n`` samples drawn for one prompt. Groups of one carry no relative signal:
their advantage is 0 and they are counted (``adv_singleton_groups_count``). Groups whose
rewards are all equal also get 0 (``adv_zero_std_groups_count``, singletons excluded).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from async_rl.algorithms.config import AdvantageConfig, AlgorithmConfig


def _group_advantages(rewards: np.ndarray, cfg: AdvantageConfig) -> np.ndarray:
    n = rewards.shape[0]
    if n == 1:
        return np.zeros(1, dtype=np.float64)
    mean = rewards.mean()
    if cfg.estimator == "grpo":
        # Unbiased std (ddof=1), as in the GRPO paper's reference implementation; eps keeps equal groups at 0.
        return (rewards - mean) / (rewards.std(ddof=1) + cfg.std_eps)
    if cfg.estimator == "dr_grpo":
        return rewards - mean
    # rloo: baseline is the mean of the other n-1 rewards, r_i - (S - r_i)/(n-1) = n/(n-1) * (r_i - mean).
    return (rewards - (rewards.sum() - rewards) / (n - 1)).astype(np.float64)


def compute_advantages(
    rewards: np.ndarray | Sequence[np.ndarray | Sequence[float]], cfg: AlgorithmConfig | AdvantageConfig
) -> tuple[np.ndarray | list[np.ndarray], dict[str, float]]:
    """Per-sample advantages from per-group rewards.

    ``rewards`` is a float array ``[num_groups, n]`` or a list of per-group 1-D arrays (groups may
    differ in size, a group of one is allowed). Returns advantages in the same layout (float32:
    one array ``[num_groups, n]`` or a list of arrays) and metrics (``*_count`` are counts,
    the rest are means / std / extremes over all samples).
    """
    acfg = cfg.advantage if isinstance(cfg, AlgorithmConfig) else cfg
    as_matrix = isinstance(rewards, np.ndarray)
    groups: list[np.ndarray | Sequence[float]]
    if isinstance(rewards, np.ndarray):
        if rewards.ndim != 2:
            raise ValueError(f"rewards must be [num_groups, n] (2-D), got shape {rewards.shape}")
        groups = [rewards[i] for i in range(rewards.shape[0])]
    else:
        groups = list(rewards)
    out: list[np.ndarray] = []
    num_singleton = num_zero_std = 0
    for i, g in enumerate(groups):
        r = np.asarray(g, dtype=np.float64)
        if r.ndim != 1 or r.size == 0:
            raise ValueError(f"rewards of group {i} must be a non-empty 1-D array, got shape {r.shape}")
        if not np.all(np.isfinite(r)):
            raise ValueError(f"rewards of group {i} contain NaN or inf: {r.tolist()}")
        if r.size == 1:
            num_singleton += 1
        elif np.all(r == r[0]):
            num_zero_std += 1
        out.append(_group_advantages(r, acfg).astype(np.float32))
    all_r = np.concatenate([np.asarray(g, dtype=np.float64).reshape(-1) for g in groups]) if groups else np.zeros(0)
    all_a = np.concatenate(out) if out else np.zeros(0, dtype=np.float32)
    metrics = {
        "adv_groups_count": float(len(groups)),
        "adv_singleton_groups_count": float(num_singleton),
        "adv_zero_std_groups_count": float(num_zero_std),
        "adv_samples_count": float(all_a.size),
    }
    if all_a.size:
        metrics |= {
            "reward_mean": float(all_r.mean()),
            "reward_std": float(all_r.std()),
            "adv_mean": float(all_a.mean()),
            "adv_std": float(all_a.std()),
            "adv_abs_mean": float(np.abs(all_a).mean()),
            "adv_max": float(all_a.max()),
            "adv_min": float(all_a.min()),
        }
    if as_matrix:
        return np.stack(out) if out else np.zeros((0, 0), dtype=np.float32), metrics
    return out, metrics


def broadcast_to_tokens(advantage: float, num_tokens: int) -> np.ndarray:
    """A sample's advantage repeated over its ``num_tokens`` response tokens (float32, for ``TrainSample``)."""
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return np.full(num_tokens, advantage, dtype=np.float32)
