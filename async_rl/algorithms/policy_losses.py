"""Per-token policy losses on ``[B, T]`` tensors: PPO clip (with dual clip) and the rollout-anchored IS loss.

Each function returns the per-token loss (0 outside the mask; reduce it with
:func:`async_rl.algorithms.reductions.reduce_loss`) and bool ``[B, T]`` tensors marking clipped
tokens. Inputs outside the mask are ignored, whatever they hold (NaN and inf included): they are
replaced by 0 before any arithmetic, so neither the loss nor the gradient sees them.
"""

from __future__ import annotations

import torch

LOG_RATIO_CLAMP = 20.0
"""Log ratios are clamped to ±20 before exp: exp(20) ≈ 4.9e8 keeps float32 finite after multiplying by an
advantage, while a ratio that large is clipped by every loss anyway (the gradient there is 0 either way)."""


def masked(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """``x`` where ``mask`` holds, exact 0 elsewhere (gradient flows only through kept positions)."""
    return torch.where(mask, x, torch.zeros((), dtype=x.dtype, device=x.device))


def ppo_clip_loss(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_eps_low: float,
    clip_eps_high: float,
    dual_clip: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate with ratio r = π_θ/π_old, clipped to [1 - eps_low, 1 + eps_high].

    loss_t = max(-A r, -A clip(r)); with ``dual_clip`` = c > 1, for A < 0 the loss is further capped at
    -A c (Ye et al. 2020), so a huge ratio on a bad token cannot blow up the step. Returns
    ``(loss, clipped, dual_clipped)``; ``clipped`` marks tokens where the clip bound is the active term.
    """
    old = masked(old_logprobs.detach(), mask)
    adv = masked(advantages.detach(), mask)
    log_ratio = torch.clamp(masked(logprobs, mask) - old, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    unclipped = -adv * ratio
    clipped_term = -adv * torch.clamp(ratio, 1.0 - clip_eps_low, 1.0 + clip_eps_high)
    loss = torch.maximum(unclipped, clipped_term)
    clipped = mask & (clipped_term > unclipped)
    dual_clipped = torch.zeros_like(mask)
    if dual_clip > 0.0:
        cap = -adv * dual_clip
        dual_clipped = mask & (adv < 0) & (loss > cap)
        loss = torch.where(adv < 0, torch.minimum(loss, cap), loss)
    return masked(loss, mask), clipped, dual_clipped


def rollout_is_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    low: float,
    high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rollout-anchored IS policy gradient (CISPO-style): loss_t = -sg(clip(π_θ/μ, low, high)) · A · π_θ/sg(π_θ).

    The weight is the detached ratio to the behaviour policy μ, truncated to [low, high]; the
    gradient is weight · A · ∇log π_θ on *every* token (clipping bounds the weight, it never
    silences a token as PPO clipping does). The value of the per-token loss is -weight · A.
    Needs no recomputed π_old, so it stays meaningful when each batch gets one optimizer step.
    Returns ``(loss, clipped)``; ``clipped`` marks tokens whose ratio was outside [low, high].
    """
    logp = masked(logprobs, mask)
    mu = masked(behaviour_logprobs.detach(), mask)
    adv = masked(advantages.detach(), mask)
    log_ratio = torch.clamp(logp.detach() - mu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(log_ratio)
    weight = torch.clamp(ratio, low, high)
    clipped = mask & ((ratio > high) | (ratio < low))
    surrogate = torch.exp(logp - logp.detach())  # value 1, gradient ∇log π_θ
    return masked(-adv * weight * surrogate, mask), clipped
