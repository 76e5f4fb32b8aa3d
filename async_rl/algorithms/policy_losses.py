"""Per-token policy losses on ``[B, T]`` tensors, SkyRL's semantics: PPO clip (dual clip), ``rollout_is``, CISPO.

Each function returns the per-token loss (0 outside the mask; reduce it with
:func:`async_rl.algorithms.reductions.reduce_loss`) and bool ``[B, T]`` tensors marking clipped
tokens. Ratios are exp(log π_θ - log π_anchor) with the log ratio clamped to ±20 (SkyRL's
``safe_exp_delta``). The IS-weighted losses (``rollout_is``, CISPO) have SkyRL's value
-sg(w) · A · log π_θ, whose gradient is -w · A · ∇log π_θ. Inputs outside the mask are ignored,
whatever they hold (NaN and inf included): they are replaced by 0 before any arithmetic, so neither
the loss nor the gradient sees them.
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
    clip_eps_low: float,
    clip_eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor]:
    """SkyRL's ``rollout_is`` (GLM-5's loss): loss_t = -sg(ρ · 1[1 - eps_low < ρ < 1 + eps_high]) · A · log π_θ.

    ρ = π_θ/μ against the behaviour policy μ; outside the open band the weight is exactly 0 (a hard zero,
    icepop-style), so such a token gets no gradient; inside, the gradient is -ρ · A · ∇log π_θ. Needs no π_old.
    Returns ``(loss, clipped)``; ``clipped`` marks mask tokens outside the band.
    """
    logp = masked(logprobs, mask)
    mu = masked(behaviour_logprobs.detach(), mask)
    adv = masked(advantages.detach(), mask)
    ratio = torch.exp(torch.clamp(logp.detach() - mu, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    in_band = (ratio > 1.0 - clip_eps_low) & (ratio < 1.0 + clip_eps_high)
    weight = torch.where(in_band, ratio, torch.zeros_like(ratio))
    return masked(-weight * adv * logp, mask), mask & ~in_band


def cispo_loss(
    logprobs: torch.Tensor,
    anchor_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    eps_low: float,
    eps_high: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """CISPO (MiniMax-M1): loss_t = -sg(clip(r, 1 - eps_low, 1 + eps_high)) · A · log π_θ, r = π_θ/π_anchor.

    π_anchor is π_old (SkyRL's ``cispo_anchor='old'``) or the behaviour policy μ (``'rollout'``). The clip
    bounds the weight but never silences a token: every token gets the gradient -w · A · ∇log π_θ.
    Returns ``(loss, clipped, ratio)``: ``clipped`` marks mask tokens with r outside the band, ``ratio`` is the
    detached unclipped r (0 outside the mask) for the ``cispo/ratio_*`` metrics.
    """
    logp = masked(logprobs, mask)
    anchor = masked(anchor_logprobs.detach(), mask)
    adv = masked(advantages.detach(), mask)
    ratio = torch.exp(torch.clamp(logp.detach() - anchor, -LOG_RATIO_CLAMP, LOG_RATIO_CLAMP))
    low, high = 1.0 - eps_low, 1.0 + eps_high
    weight = torch.clamp(ratio, low, high)
    clipped = mask & ((ratio < low) | (ratio > high))
    return masked(-adv * weight * logp, mask), clipped, masked(ratio, mask)
