"""The learner's loss function: policy loss + corrections + KL / entropy, reduced with step-global denominators.

``make_loss_fn(cfg)`` returns a :data:`async_rl.algorithms.batch.LossFn`. Per token t of the loss mask:

    ℓ_t = w_t · pg_t + kl_coef · KL_t - entropy_coef · H_t,   kept tokens only

where pg_t is the policy loss of ``algorithm.loss.type``, w_t the TIS weight (1 when off) and the kept
tokens those that survive the correction masks (see :mod:`async_rl.algorithms.corrections`). As in
SkyRL, every correction takes ρ_t = π_old/μ whatever the loss (π_old = ``mb.proximal_logprobs``, the
learner's logprobs before the step; ``algorithm.correction.anchor = "current"`` takes the detached π_θ
instead), and the loss metrics (``clip_ratio``, ``cispo/ratio_*``) are taken over the loss mask as given.
The result is reduced by :func:`async_rl.algorithms.reductions.reduce_loss`, so the losses of all
micro-batches of a step sum to the step loss; by default dropped tokens stay in the denominator, as in
SkyRL. Metrics follow the naming convention of :mod:`async_rl.algorithms.metrics`; aggregate them with
:func:`~async_rl.algorithms.metrics.reduce_metrics`.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from async_rl.algorithms.batch import ForwardOutput, LossFn, MicroBatch
from async_rl.algorithms.config import AlgorithmConfig
from async_rl.algorithms.corrections import apply_corrections
from async_rl.algorithms.kl import kl_penalty
from async_rl.algorithms.metrics import masked_extremes, ratio_metrics, staleness_tensors, to_floats
from async_rl.algorithms.policy_losses import cispo_loss, masked, ppo_clip_loss, rollout_is_loss
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
        old = (
            masked(_aligned("mb.proximal_logprobs", mb.proximal_logprobs, logp), mask)
            if cfg.needs_proximal_logprobs
            else None
        )
        anchor = old if old is not None and ccfg.anchor == "old" else masked(logp.detach(), mask)
        log_ratio = anchor - mu  # π_old/μ for every correction and the is_ratio metrics
        corr = apply_corrections(log_ratio, mask, ccfg)

        tensors: dict[str, torch.Tensor] = {}
        extra: dict[str, torch.Tensor] = {}
        if lcfg.type == "rollout_is":
            pg, clipped = rollout_is_loss(logp, mu, adv, mask, clip_eps_low=lcfg.clip_eps_low,
                                          clip_eps_high=lcfg.clip_eps_high)  # fmt: skip
        elif lcfg.type == "cispo":
            behaviour = mu if lcfg.cispo_anchor == "rollout" else old
            assert behaviour is not None  # needs_proximal_logprobs covers cispo_anchor = "old"
            pg, clipped, ratio = cispo_loss(logp, behaviour, adv, mask, eps_low=lcfg.cispo_eps_clip_low,
                                            eps_high=lcfg.cispo_eps_clip_high)  # fmt: skip
            tensors["cispo/ratio_mean"] = ratio.sum()
            clamped = torch.clamp(ratio, 1.0 - lcfg.cispo_eps_clip_low, 1.0 + lcfg.cispo_eps_clip_high)
            tensors["cispo/ratio_clamped_mean"] = masked(clamped, mask).sum()
            extra |= masked_extremes(ratio, mask, "cispo/ratio")
        else:
            ppo_old = mu if lcfg.type == "ppo" else old
            assert ppo_old is not None  # needs_proximal_logprobs covers regular and dual_clip
            dual = lcfg.dual_clip if lcfg.type in ("dual_clip", "ppo") else 0.0
            pg, clipped, dual_clipped = ppo_clip_loss(
                logp, ppo_old, adv, mask, clip_eps_low=lcfg.clip_eps_low, clip_eps_high=lcfg.clip_eps_high,
                dual_clip=dual,
            )  # fmt: skip
            if dual > 0.0:
                tensors["dual_clip_frac"] = dual_clipped.sum()
        tensors["clip_ratio"] = clipped.sum()
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
        metrics |= extra
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
