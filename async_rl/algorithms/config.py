"""Configuration of the RL algorithm: advantages, policy loss, reduction, regularisers, off-policy corrections.

Nested sections (``algorithm.advantage``, ``algorithm.loss``, ``algorithm.correction``), each field
documented; invalid values and invalid combinations raise ``ValueError`` naming the dotted field.
Every off-policy correction is off by default. See ``docs/algorithms.md`` for when to use what.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo"]
PolicyLossType = Literal["rollout_is", "ppo", "decoupled_ppo"]
Reduction = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
TISMode = Literal["off", "token", "sequence"]
SequenceMaskMode = Literal["off", "geometric", "product"]

ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")
POLICY_LOSSES: tuple[str, ...] = ("rollout_is", "ppo", "decoupled_ppo")
REDUCTIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
TIS_MODES: tuple[str, ...] = ("off", "token", "sequence")
SEQUENCE_MASK_MODES: tuple[str, ...] = ("off", "geometric", "product")


def _check_choice(path: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{path} must be one of {list(choices)}, got {value!r}")


def _check_finite(path: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{path} must be a finite number, got {value!r}")


def _check_band(path: str, low: float, high: float) -> None:
    """A keep-band ``[low, high]`` on a ratio: positive, ordered, and containing 1 (on-policy data is kept)."""
    _check_finite(f"{path}_low", low)
    _check_finite(f"{path}_high", high)
    if low <= 0.0:
        raise ValueError(f"{path}_low must be > 0 (a ratio bound), got {low}")
    if low >= high:
        raise ValueError(f"{path}_low must be < {path}_high, got {low} >= {high}")
    if low > 1.0 or high < 1.0:
        raise ValueError(
            f"{path}_low <= 1 <= {path}_high must hold (on-policy tokens must be kept), got [{low}, {high}]"
        )


@dataclass(kw_only=True, slots=True)
class AdvantageConfig:
    """How group rewards become per-sample advantages (``algorithm.advantage``)."""

    estimator: AdvantageEstimator = "grpo"
    """``grpo``: (r - group mean) / (group std + eps); ``dr_grpo``: r - group mean; ``rloo``: r - mean of the others."""
    std_eps: float = 1e-6
    """Added to the group standard deviation (``grpo`` only) so equal-reward groups give 0, not NaN."""

    def __post_init__(self) -> None:
        _check_choice("algorithm.advantage.estimator", self.estimator, ADVANTAGE_ESTIMATORS)
        _check_finite("algorithm.advantage.std_eps", self.std_eps)
        if self.std_eps <= 0.0:
            raise ValueError(f"algorithm.advantage.std_eps must be > 0, got {self.std_eps}")


@dataclass(kw_only=True, slots=True)
class LossConfig:
    """The policy loss, its reduction over tokens and the KL / entropy regularisers (``algorithm.loss``)."""

    type: PolicyLossType = "rollout_is"
    """``rollout_is``: CISPO-style, detached weight clip(π_θ/μ, low, high) on a policy gradient (no π_prox needed);
    ``ppo``: PPO clip on π_θ/μ with dual clip; ``decoupled_ppo``: PPO clip on π_θ/π_prox, behaviour
    correction π_prox/μ through ``algorithm.correction`` (the learner computes π_prox)."""
    rollout_is_low: float = 0.0
    """``rollout_is``: lower bound of the detached IS weight π_θ/μ (0 = no lower truncation, as in CISPO)."""
    rollout_is_high: float = 2.0
    """``rollout_is``: upper bound of the detached IS weight π_θ/μ (the trust region; > 1)."""
    clip_eps_low: float = 0.2
    """``ppo`` / ``decoupled_ppo``: the ratio is clipped below at 1 - clip_eps_low (in (0, 1))."""
    clip_eps_high: float = 0.2
    """``ppo`` / ``decoupled_ppo``: the ratio is clipped above at 1 + clip_eps_high (> 0; e.g. 0.28 = clip-higher)."""
    dual_clip: float = 3.0
    """``ppo`` / ``decoupled_ppo``: for negative advantages the loss is capped at -A * dual_clip (> 1; 0 = off)."""
    reduction: Reduction = "token_mean"
    """How per-token losses become the step loss: ``token_mean`` (over all response tokens of the step),
    ``seq_mean_token_mean``, ``seq_mean_token_sum``, ``token_sum_norm`` (token sum / (sequences * max_tokens),
    Dr. GRPO)."""
    renormalize: bool = False
    """False: tokens removed by a correction mask stay in the denominator (masks shrink the step); True: they
    leave it (the survivors keep the full step size). Not allowed with ``token_sum_norm``."""
    max_tokens: int = 0
    """``token_sum_norm`` only: the constant length normaliser (usually the generation budget); must be > 0 there."""
    kl_coef: float = 0.0
    """Weight of the per-token KL(π_θ || π_ref) penalty in the loss (0 = off; > 0 makes the learner compute π_ref)."""
    kl_estimator: KLEstimator = "k3"
    """Estimator of the per-token KL from log r = log π_ref - log π_θ: ``k1`` = -log r, ``k2`` = (log r)^2 / 2,
    ``k3`` = r - 1 - log r (unbiased, non-negative)."""
    entropy_coef: float = 0.0
    """Weight of the entropy bonus (the loss gets -entropy_coef * H); > 0 needs the backend's entropy."""

    def __post_init__(self) -> None:
        p = "algorithm.loss"
        _check_choice(f"{p}.type", self.type, POLICY_LOSSES)
        _check_choice(f"{p}.reduction", self.reduction, REDUCTIONS)
        _check_choice(f"{p}.kl_estimator", self.kl_estimator, KL_ESTIMATORS)
        for name in ("rollout_is_low", "rollout_is_high", "clip_eps_low", "clip_eps_high", "dual_clip", "kl_coef",
                     "entropy_coef"):  # fmt: skip
            _check_finite(f"{p}.{name}", getattr(self, name))
        if not 0.0 <= self.rollout_is_low < 1.0:
            raise ValueError(f"{p}.rollout_is_low must be in [0, 1), got {self.rollout_is_low}")
        if self.rollout_is_high <= 1.0:
            raise ValueError(f"{p}.rollout_is_high must be > 1, got {self.rollout_is_high}")
        if not 0.0 < self.clip_eps_low < 1.0:
            raise ValueError(f"{p}.clip_eps_low must be in (0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high <= 0.0:
            raise ValueError(f"{p}.clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.dual_clip != 0.0 and self.dual_clip <= 1.0:
            raise ValueError(f"{p}.dual_clip must be > 1 (or 0 = off), got {self.dual_clip}")
        if self.max_tokens < 0:
            raise ValueError(f"{p}.max_tokens must be >= 0, got {self.max_tokens}")
        if self.reduction == "token_sum_norm":
            if self.max_tokens <= 0:
                raise ValueError(f"{p}.max_tokens must be > 0 with {p}.reduction='token_sum_norm'")
            if self.renormalize:
                raise ValueError(
                    f"{p}.renormalize must be false with {p}.reduction='token_sum_norm' (constant denominator)"
                )
        if self.kl_coef < 0.0:
            raise ValueError(f"{p}.kl_coef must be >= 0, got {self.kl_coef}")
        if self.entropy_coef < 0.0:
            raise ValueError(f"{p}.entropy_coef must be >= 0, got {self.entropy_coef}")


@dataclass(kw_only=True, slots=True)
class CorrectionConfig:
    """Off-policy corrections on ρ_t = π_anchor/μ, all off by default (``algorithm.correction``).

    π_anchor is π_prox for ``decoupled_ppo`` and the (detached) current policy otherwise. Applied in the
    order: outlier sequence mask, token mask, TIS, sequence mask (sequence statistics over the response
    tokens as generated, i.e. before any token mask).
    """

    outlier_mask: bool = False
    """Drop a whole sequence when any of its tokens has ρ_t outside [outlier_low, outlier_high]."""
    outlier_low: float = 1e-4
    """Lower bound of the outlier mask's per-token ratio band."""
    outlier_high: float = 100.0
    """Upper bound of the outlier mask's per-token ratio band."""
    token_mask: bool = False
    """Drop single tokens with ρ_t outside [token_mask_low, token_mask_high] ("icepop")."""
    token_mask_low: float = 0.5
    """Lower bound of the token mask's ratio band."""
    token_mask_high: float = 2.0
    """Upper bound of the token mask's ratio band."""
    tis: TISMode = "off"
    """Truncated importance sampling: ``token``: weight sg(min(ρ_t, token_tis_cap)); ``sequence``: one weight
    sg(min(Π_t ρ_t, sequence_tis_cap)) per sequence. Only with ``algorithm.loss.type='decoupled_ppo'`` (the
    other losses already carry π/μ)."""
    token_tis_cap: float = 2.0
    """Cap C of token TIS (>= 1)."""
    sequence_tis_cap: float = 5.0
    """Cap C of sequence TIS (>= 1)."""
    sequence_mask: SequenceMaskMode = "off"
    """``geometric``: drop a sequence when exp(mean_t log ρ_t) is outside [geometric_low, geometric_high];
    ``product``: drop it when Π_t ρ_t is outside [product_low, product_high]."""
    geometric_low: float = 0.99
    """Lower bound of the geometric-mean sequence mask."""
    geometric_high: float = 1.01
    """Upper bound of the geometric-mean sequence mask."""
    product_low: float = 0.5
    """Lower bound of the product sequence mask."""
    product_high: float = 2.0
    """Upper bound of the product sequence mask."""

    def __post_init__(self) -> None:
        p = "algorithm.correction"
        _check_choice(f"{p}.tis", self.tis, TIS_MODES)
        _check_choice(f"{p}.sequence_mask", self.sequence_mask, SEQUENCE_MASK_MODES)
        _check_band(f"{p}.outlier", self.outlier_low, self.outlier_high)
        _check_band(f"{p}.token_mask", self.token_mask_low, self.token_mask_high)
        _check_band(f"{p}.geometric", self.geometric_low, self.geometric_high)
        _check_band(f"{p}.product", self.product_low, self.product_high)
        for name in ("token_tis_cap", "sequence_tis_cap"):
            value = getattr(self, name)
            _check_finite(f"{p}.{name}", value)
            if value < 1.0:
                raise ValueError(f"{p}.{name} must be >= 1 (a cap below 1 down-weights on-policy tokens), got {value}")

    @property
    def any_enabled(self) -> bool:
        """True when at least one correction is on."""
        return self.outlier_mask or self.token_mask or self.tis != "off" or self.sequence_mask != "off"


@dataclass(kw_only=True, slots=True)
class AlgorithmConfig:
    """Everything the learner's loss depends on (``algorithm``)."""

    advantage: AdvantageConfig = field(default_factory=AdvantageConfig)
    """Advantage estimator."""
    loss: LossConfig = field(default_factory=LossConfig)
    """Policy loss, reduction, KL and entropy."""
    correction: CorrectionConfig = field(default_factory=CorrectionConfig)
    """Off-policy corrections (TIS and masks), all off by default."""
    staleness_hist_max: int = 8
    """Staleness histogram buckets 0..staleness_hist_max-1 one per version, plus one for >= staleness_hist_max."""

    def __post_init__(self) -> None:
        if self.staleness_hist_max < 1:
            raise ValueError(f"algorithm.staleness_hist_max must be >= 1, got {self.staleness_hist_max}")
        if self.correction.tis != "off" and self.loss.type != "decoupled_ppo":
            raise ValueError(
                f"algorithm.correction.tis={self.correction.tis!r} needs algorithm.loss.type='decoupled_ppo'; "
                f"loss {self.loss.type!r} already weights tokens by π_θ/μ, so TIS would correct twice "
                "(use algorithm.correction.token_mask / sequence_mask to drop far-off-policy data instead)"
            )

    @property
    def needs_proximal_logprobs(self) -> bool:
        """The learner must fill ``MicroBatch.proximal_logprobs`` (π_prox, before the update)."""
        return self.loss.type == "decoupled_ppo"

    @property
    def needs_reference_logprobs(self) -> bool:
        """The learner must fill ``MicroBatch.reference_logprobs`` (frozen reference model)."""
        return self.loss.kl_coef > 0.0

    @property
    def needs_entropy(self) -> bool:
        """The backend must return ``ForwardOutput.entropy`` with grad (``with_entropy=True``)."""
        return self.loss.entropy_coef > 0.0
