"""The learner's loss function: policy loss + corrections + KL / entropy, reduced with step-global denominators.

``make_loss_fn(cfg)`` returns a :data:`async_rl.algorithms.batch.LossFn`. Per token t of the loss mask:

    ℓ_t = w_t · pg_t + kl_coef · KL_t - entropy_coef · H_t,   kept tokens only

where pg_t is the policy loss of ``algorithm.loss.type``, w_t the TIS weight (1 when off) and the kept
tokens those that survive the correction masks (see :mod:`async_rl.algorithms.corrections`). The
correction ratio is ρ_t = π_anchor/μ with π_anchor = π_prox for ``decoupled_ppo`` and the detached
π_θ otherwise. The result is reduced by :func:`async_rl.algorithms.reductions.reduce_loss`, so the
losses of all micro-batches of a step sum to the step loss. Metrics follow the naming convention of
:mod:`async_rl.algorithms.metrics`; aggregate them with :func:`~async_rl.algorithms.metrics.reduce_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from async_rl.algorithms.batch import ForwardOutput, LossFn, MicroBatch
from async_rl.algorithms.config import AlgorithmConfig
from async_rl.algorithms.corrections import apply_corrections
from async_rl.algorithms.kl import kl_penalty
from async_rl.algorithms.metrics import ratio_metrics, staleness_tensors, to_floats
from async_rl.algorithms.policy_losses import masked, ppo_clip_loss, rollout_is_loss
from async_rl.algorithms.reductions import reduce_loss


def _aligned(name: str, t: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    if t is None:
        raise ValueError(f"{name} is None but the configured algorithm needs it")
    if t.shape != like.shape:
        raise ValueError(f"{name} has shape {tuple(t.shape)}, expected {tuple(like.shape)} (like out.logprobs)")
    return t.to(device=like.device, dtype=like.dtype)


def make_loss_fn(cfg: AlgorithmConfig, *, learner_version: int | Callable[[], int] | None = None) -> LossFn:
    """The loss function for ``cfg``; ``learner_version`` (an int, or a callable read at every call) turns on
    the staleness metrics (learner version - ``mb.token_versions``)."""
    lcfg, ccfg = cfg.loss, cfg.correction

    def loss_fn(out: ForwardOutput, mb: MicroBatch) -> tuple[torch.Tensor, dict[str, float]]:
        logp = out.logprobs
        if logp.dtype in (torch.float16, torch.bfloat16):
            logp = logp.float()  # ratios and their exp need float32 at least
        if logp.dim() != 2:
            raise ValueError(f"out.logprobs must be [B, T], got shape {tuple(logp.shape)}")
        if mb.loss_mask.shape != logp.shape:
            raise ValueError(f"mb.loss_mask has shape {tuple(mb.loss_mask.shape)}, expected {tuple(logp.shape)}")
        mask = mb.loss_mask.to(device=logp.device, dtype=torch.bool)
        mu = masked(_aligned("mb.behaviour_logprobs", mb.behaviour_logprobs, logp), mask)
        adv = masked(_aligned("mb.advantages", mb.advantages, logp), mask)
        prox = (
            masked(_aligned("mb.proximal_logprobs", mb.proximal_logprobs, logp), mask)
            if cfg.needs_proximal_logprobs
            else None
        )
        anchor = prox if prox is not None else masked(logp.detach(), mask)
        log_ratio = anchor - mu
        corr = apply_corrections(log_ratio, mask, ccfg)

        tensors: dict[str, torch.Tensor] = {}
        if lcfg.type == "rollout_is":
            pg, clipped = rollout_is_loss(logp, mu, adv, mask, low=lcfg.rollout_is_low, high=lcfg.rollout_is_high)
        else:
            old = prox if prox is not None else mu
            pg, clipped, dual = ppo_clip_loss(
                logp, old, adv, mask, clip_eps_low=lcfg.clip_eps_low, clip_eps_high=lcfg.clip_eps_high,
                dual_clip=lcfg.dual_clip,
            )  # fmt: skip
            if lcfg.dual_clip > 0.0:
                tensors["dual_clip_frac"] = dual.sum()
        tensors["clip_frac"] = clipped.sum()
        per_token = corr.weights * pg
        tensors["pg_loss_mean"] = masked(per_token, corr.keep).sum()

        ref = mb.reference_logprobs
        if cfg.needs_reference_logprobs or ref is not None:
            kl = kl_penalty(logp, _aligned("mb.reference_logprobs", ref, logp), mask, lcfg.kl_estimator)
            tensors["kl_mean"] = kl.detach().sum()
            if lcfg.kl_coef > 0.0:
                per_token = per_token + lcfg.kl_coef * kl
        if cfg.needs_entropy or out.entropy is not None:
            ent = masked(_aligned("out.entropy", out.entropy, logp), mask)
            tensors["entropy_mean"] = ent.detach().sum()
            if lcfg.entropy_coef > 0.0:
                per_token = per_token - lcfg.entropy_coef * ent

        loss = reduce_loss(
            per_token, corr.keep, mask, mode=lcfg.reduction, step_num_tokens=mb.step_num_tokens,
            step_num_sequences=mb.step_num_sequences, renormalize=lcfg.renormalize, max_tokens=lcfg.max_tokens,
        )  # fmt: skip

        num_tokens = mask.sum()
        denom = num_tokens.clamp(min=1).to(logp.dtype)
        metrics = {k: v.to(logp.dtype) / denom for k, v in tensors.items()}  # the sums above become token means
        metrics |= corr.metrics
        metrics |= ratio_metrics(log_ratio, mask)
        metrics["loss_sum"] = loss.detach()
        metrics["loss_tokens_count"] = num_tokens
        metrics["loss_sequences_count"] = mask.any(dim=-1).sum()
        if learner_version is not None:
            version = learner_version() if callable(learner_version) else learner_version
            tv = mb.token_versions.to(device=logp.device)
            metrics |= staleness_tensors(tv, mask, int(version), cfg.staleness_hist_max)
        return loss, to_floats(metrics)

    return loss_fn
