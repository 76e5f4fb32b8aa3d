"""Off-policy RL algorithms on ``[batch, tokens]`` tensors: advantages, policy losses, corrections, metrics.

The learner uses :class:`AlgorithmConfig`, :func:`compute_advantages` and :func:`make_loss_fn`;
backends aggregate the loss metrics with :func:`reduce_metrics`. See ``docs/algorithms.md``.
"""

from async_rl.algorithms.advantages import broadcast_to_tokens, compute_advantages
from async_rl.algorithms.config import AdvantageConfig, AlgorithmConfig, CorrectionConfig, LossConfig
from async_rl.algorithms.corrections import CorrectionResult, apply_corrections
from async_rl.algorithms.kl import kl_penalty
from async_rl.algorithms.loss import make_loss_fn
from async_rl.algorithms.metrics import ratio_metrics, reduce_metrics, staleness_metrics
from async_rl.algorithms.policy_losses import ppo_clip_loss, rollout_is_loss
from async_rl.algorithms.reductions import reduce_loss

__all__ = [
    "AdvantageConfig",
    "AlgorithmConfig",
    "CorrectionConfig",
    "CorrectionResult",
    "LossConfig",
    "apply_corrections",
    "broadcast_to_tokens",
    "compute_advantages",
    "kl_penalty",
    "make_loss_fn",
    "ppo_clip_loss",
    "ratio_metrics",
    "reduce_loss",
    "reduce_metrics",
    "rollout_is_loss",
    "staleness_metrics",
]
