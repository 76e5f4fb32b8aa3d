"""Off-policy RL algorithms on ``[batch, tokens]`` tensors: advantages, policy losses, corrections, metrics.

The learner uses :class:`AlgorithmConfig`, :func:`compute_advantages` and :func:`make_loss_fn`;
backends aggregate the loss metrics with :func:`reduce_metrics`; :func:`skyrl_algorithm_config` turns a
SkyRL ``trainer.algorithm`` section into an :class:`AlgorithmConfig`. See ``docs/algorithms.md``.
Public names load on first use (:mod:`async_rl.lazy`), so ``async_rl.algorithms.config`` stays torch-free.

May import: config, lazy.
"""

from typing import TYPE_CHECKING

from async_rl.lazy import lazy_exports

_EXPORTS = {
    "broadcast_to_tokens": "advantages", "compute_advantages": "advantages",
    "AdvantageConfig": "config", "AlgorithmConfig": "config", "CorrectionConfig": "config", "LossConfig": "config",
    "CorrectionResult": "corrections", "apply_corrections": "corrections",
    "kl_penalty": "kl",
    "make_loss_fn": "loss",
    "ratio_metrics": "metrics", "reduce_metrics": "metrics", "staleness_metrics": "metrics",
    "cispo_loss": "policy_losses", "ppo_clip_loss": "policy_losses", "rollout_is_loss": "policy_losses",
    "reduce_loss": "reductions",
    "SkyRLConfigError": "skyrl", "skyrl_algorithm_config": "config",
}  # fmt: skip
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers
    from async_rl.algorithms.advantages import broadcast_to_tokens, compute_advantages
    from async_rl.algorithms.config import (
        AdvantageConfig,
        AlgorithmConfig,
        CorrectionConfig,
        LossConfig,
        skyrl_algorithm_config,
    )
    from async_rl.algorithms.corrections import CorrectionResult, apply_corrections
    from async_rl.algorithms.kl import kl_penalty
    from async_rl.algorithms.loss import make_loss_fn
    from async_rl.algorithms.metrics import ratio_metrics, reduce_metrics, staleness_metrics
    from async_rl.algorithms.policy_losses import cispo_loss, ppo_clip_loss, rollout_is_loss
    from async_rl.algorithms.reductions import reduce_loss
    from async_rl.algorithms.skyrl import SkyRLConfigError
