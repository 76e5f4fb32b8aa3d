"""Per-token KL(π_θ || π_ref) estimators (Schulman's k1, k2, k3) on sampled tokens.

With log r = log π_ref(y_t) - log π_θ(y_t) and y_t ~ π_θ: k1 = -log r (unbiased, can be negative),
k2 = (log r)^2 / 2 (biased, low variance), k3 = r - 1 - log r (unbiased, always >= 0). The log ratio
is clamped to ±20 so k3 never overflows.
"""

from __future__ import annotations

import torch

from async_rl.algorithms.policy_losses import LOG_RATIO_CLAMP, masked


def kl_penalty(
    logprobs: torch.Tensor, reference_logprobs: torch.Tensor, mask: torch.Tensor, estimator: str
) -> torch.Tensor:
    """Per-token KL estimate (0 outside ``mask``), differentiable in ``logprobs``."""
    log_r = masked(reference_logprobs.detach(), mask) - masked(logprobs, mask)
    log_r = torch.clamp(log_r, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    if estimator == "k1":
        kl = -log_r
    elif estimator == "k2":
        kl = 0.5 * log_r.square()
    elif estimator == "k3":
        kl = torch.exp(log_r) - 1.0 - log_r
    else:
        raise ValueError(f"algorithm.loss.kl_estimator must be one of ['k1', 'k2', 'k3'], got {estimator!r}")
    return masked(kl, mask)
