"""Configuration of the RL algorithm: advantages, policy loss, reduction, regularisers, off-policy corrections.

Nested sections (``algorithm.advantage``, ``algorithm.loss``, ``algorithm.correction``), each field
documented; invalid values and invalid combinations raise ``ValueError`` naming the dotted field.
Every off-policy correction is off by default and, when on, follows SkyRL's order and semantics
(``async_rl.algorithms.corrections``). ``algorithm.from_skyrl`` builds the three sections from a SkyRL
``trainer.algorithm`` section (``async_rl.algorithms.skyrl``). Torch-free: configs parse before heavy
imports. See ``docs/algorithms.md`` for when to use what.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from async_rl.algorithms.skyrl import SkyRLConfigError, load_skyrl_sections, skyrl_sections

AdvantageEstimator = Literal["grpo", "dr_grpo", "rloo"]
PolicyLossType = Literal["cispo", "rollout_is", "regular", "dual_clip", "ppo"]
CispoAnchor = Literal["old", "rollout"]
Reduction = Literal["token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm"]
KLEstimator = Literal["k1", "k2", "k3"]
TISMode = Literal["off", "token", "sequence"]
SequenceMaskMode = Literal["off", "geometric", "product"]
CorrectionAnchor = Literal["old", "current"]

ADVANTAGE_ESTIMATORS: tuple[str, ...] = ("grpo", "dr_grpo", "rloo")
POLICY_LOSSES: tuple[str, ...] = ("cispo", "rollout_is", "regular", "dual_clip", "ppo")
CISPO_ANCHORS: tuple[str, ...] = ("old", "rollout")
REDUCTIONS: tuple[str, ...] = ("token_mean", "seq_mean_token_mean", "seq_mean_token_sum", "token_sum_norm")
KL_ESTIMATORS: tuple[str, ...] = ("k1", "k2", "k3")
TIS_MODES: tuple[str, ...] = ("off", "token", "sequence")
SEQUENCE_MASK_MODES: tuple[str, ...] = ("off", "geometric", "product")
CORRECTION_ANCHORS: tuple[str, ...] = ("old", "current")


def _check_choice(path: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{path} must be one of {list(choices)}, got {value!r}")


def _check_finite(path: str, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"{path} must be a finite number, got {value!r}")


def _check_band(path: str, low: float | None, high: float | None) -> None:
    """A keep-band ``[low, high]`` on a ratio, either side possibly absent (None): a present low is in (0, 1],
    a present high is >= 1 (on-policy data, ratio 1, is always kept), and low < high when both are present."""
    if low is not None:
        _check_finite(f"{path}_low", low)
        if not 0.0 < low <= 1.0:
            raise ValueError(f"{path}_low must be in (0, 1] (a ratio bound that keeps on-policy tokens), got {low}")
    if high is not None:
        _check_finite(f"{path}_high", high)
        if high < 1.0:
            raise ValueError(f"{path}_high must be >= 1 (a ratio bound that keeps on-policy tokens), got {high}")
    if low is not None and high is not None and low >= high:
        raise ValueError(f"{path}_low must be < {path}_high, got {low} >= {high}")


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

    type: PolicyLossType = "cispo"
    """The per-token policy loss (SkyRL's ``policy_loss_type``; π_old = the learner's logprobs before the step,
    μ = the generator's): ``cispo``: -sg(clip(π_θ/π_anchor, 1 - cispo_eps_clip_low, 1 + cispo_eps_clip_high))
    · A · log π_θ with π_anchor per ``cispo_anchor``; ``rollout_is``: -sg(ρ · 1[1 - clip_eps_low < ρ <
    1 + clip_eps_high]) · A · log π_θ, ρ = π_θ/μ (hard zero outside the band); ``regular``: PPO clip on
    π_θ/π_old; ``dual_clip``: ``regular`` with the loss of A < 0 tokens capped at -A · dual_clip; ``ppo``
    (this project's, not SkyRL's): PPO clip on π_θ/μ, dual clip when ``dual_clip`` > 0."""
    cispo_anchor: CispoAnchor = "rollout"
    """``cispo``: the policy its ratio is taken against: ``rollout`` (μ: the clip engages on stale data, and no
    π_old forward is needed) or ``old`` (π_old, the original CISPO; ratio ~1 with one optimizer step per batch).
    SkyRL's default is ``old`` (the bridge keeps it); ours is ``rollout``, for fully asynchronous runs."""
    cispo_eps_clip_low: float = 1.0
    """``cispo``: the IS weight is clipped below at 1 - cispo_eps_clip_low (in [0, 1]; 1 = no lower clip)."""
    cispo_eps_clip_high: float = 1.0
    """``cispo``: the IS weight is clipped above at 1 + cispo_eps_clip_high (>= 0; SkyRL's default is 4)."""
    clip_eps_low: float = 0.2
    """``regular`` / ``dual_clip`` / ``ppo``: the ratio is clipped below at 1 - clip_eps_low; ``rollout_is``: the
    keep-band's open lower end (in (0, 1); SkyRL's ``eps_clip_low``)."""
    clip_eps_high: float = 0.2
    """Upper counterpart of ``clip_eps_low``: 1 + clip_eps_high (> 0; e.g. 0.28 = clip-higher; SkyRL's
    ``eps_clip_high``)."""
    dual_clip: float = 3.0
    """``dual_clip`` (and ``ppo`` when > 0): for negative advantages the loss is capped at -A * dual_clip (> 1;
    0 = off, allowed only for the other losses; SkyRL's ``clip_ratio_c``)."""
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
        _check_choice(f"{p}.cispo_anchor", self.cispo_anchor, CISPO_ANCHORS)
        for name in ("cispo_eps_clip_low", "cispo_eps_clip_high", "clip_eps_low", "clip_eps_high", "dual_clip",
                     "kl_coef", "entropy_coef"):  # fmt: skip
            _check_finite(f"{p}.{name}", getattr(self, name))
        if not 0.0 <= self.cispo_eps_clip_low <= 1.0:
            raise ValueError(f"{p}.cispo_eps_clip_low must be in [0, 1], got {self.cispo_eps_clip_low}")
        if self.cispo_eps_clip_high < 0.0:
            raise ValueError(f"{p}.cispo_eps_clip_high must be >= 0, got {self.cispo_eps_clip_high}")
        if not 0.0 < self.clip_eps_low < 1.0:
            raise ValueError(f"{p}.clip_eps_low must be in (0, 1), got {self.clip_eps_low}")
        if self.clip_eps_high <= 0.0:
            raise ValueError(f"{p}.clip_eps_high must be > 0, got {self.clip_eps_high}")
        if self.dual_clip != 0.0 and self.dual_clip <= 1.0:
            raise ValueError(f"{p}.dual_clip must be > 1 (or 0 = off), got {self.dual_clip}")
        if self.type == "dual_clip" and self.dual_clip == 0.0:
            raise ValueError(f"{p}.dual_clip must be > 1 with {p}.type='dual_clip' (0 = off is for the other losses)")
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
    """Off-policy corrections on ρ_t = π_old/μ, all off by default (``algorithm.correction``).

    SkyRL's order, each step on the mask the previous ones left: outlier sequence mask (on the loss mask),
    token mask, (this project's) M2 mask, TIS, sequence mask; a token or row already dropped never enters a later statistic.
    Per-token ratios are exp(log ρ) with log ρ clamped to ±20, compared with the bounds as ratios.
    """

    anchor: CorrectionAnchor = "old"
    """π in ρ = π/μ: ``old`` (π_old, the learner's logprobs before the step, as in SkyRL: turning any
    correction on makes the learner compute them) or ``current`` (the detached π_θ of the forward pass, which
    equals π_old with one optimizer step per batch and saves that extra forward; this project's option)."""
    outlier_mask: bool = False
    """Drop a whole sequence when any of its tokens has ρ_t < outlier_low or ρ_t > outlier_high."""
    outlier_low: float | None = 1e-4
    """Lower bound of the outlier mask's per-token ratio band (None: that side unchecked, SkyRL's one-sided band)."""
    outlier_high: float | None = 100.0
    """Upper bound of the outlier mask's per-token ratio band (None: that side unchecked)."""
    token_mask: bool = False
    """Drop single tokens with ρ_t outside [token_mask_low, token_mask_high] ("icepop"); needs both bounds
    (as SkyRL, a one-sided token mask is off; the config warns)."""
    token_mask_low: float | None = 0.5
    """Lower bound of the token mask's ratio band (inclusive)."""
    token_mask_high: float | None = 2.0
    """Upper bound of the token mask's ratio band (inclusive)."""
    m2_mask: bool = False
    """Second-moment trust region in the spirit of M2PO (Zheng et al. 2025, "Prosperity before Collapse"): drop the
    tokens with the largest (log ρ_t)² (among those the masks before it kept), fewest first, until the mean of
    (log ρ_t)² over the tokens left is <= m2_threshold. Bounds the batch's distance from μ as a whole instead of
    each token's: a stale batch keeps most of its tokens and loses only its outliers."""
    m2_threshold: float = 0.04
    """The M2 mask's bound on mean (log ρ_t)² over the kept tokens (> 0; M2PO's τ = 0.04), per micro-batch."""
    tis: TISMode = "off"
    """Truncated importance sampling on the tokens the masks before it kept: ``token``: weight sg(min(ρ_t,
    token_tis_cap)) (no lower clip); ``sequence``: one weight sg(min(exp(clamp(Σ_t log ρ_t, ±20)),
    sequence_tis_cap)) per sequence. Refused with ``ppo`` and with ``cispo`` anchored on the rollout (their
    ratio already is π/μ); allowed with ``rollout_is`` as in SkyRL, with a warning (it counts π/μ twice)."""
    token_tis_cap: float = 2.0
    """Cap C of token TIS (>= 1)."""
    sequence_tis_cap: float = 5.0
    """Cap C of sequence TIS (>= 1)."""
    sequence_mask: SequenceMaskMode = "off"
    """``geometric``: drop a sequence when exp(mean_t log ρ_t) is outside [geometric_low, geometric_high];
    ``product``: drop it when Π_t ρ_t is outside [product_low, product_high]. Both over the tokens the outlier
    and token masks kept, exp of the clamped (±20) sum; a row with none left counts as ratio 1."""
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
        _check_choice(f"{p}.anchor", self.anchor, CORRECTION_ANCHORS)
        _check_choice(f"{p}.tis", self.tis, TIS_MODES)
        _check_choice(f"{p}.sequence_mask", self.sequence_mask, SEQUENCE_MASK_MODES)
        _check_band(f"{p}.outlier", self.outlier_low, self.outlier_high)
        _check_band(f"{p}.token_mask", self.token_mask_low, self.token_mask_high)
        _check_band(f"{p}.geometric", self.geometric_low, self.geometric_high)
        _check_band(f"{p}.product", self.product_low, self.product_high)
        _check_finite(f"{p}.m2_threshold", self.m2_threshold)
        if self.m2_threshold <= 0.0:
            raise ValueError(f"{p}.m2_threshold must be > 0, got {self.m2_threshold}")
        for name in ("token_tis_cap", "sequence_tis_cap"):
            value = getattr(self, name)
            _check_finite(f"{p}.{name}", value)
            if value < 1.0:
                raise ValueError(f"{p}.{name} must be >= 1 (a cap below 1 down-weights on-policy tokens), got {value}")
        if self.outlier_mask and self.outlier_low is None and self.outlier_high is None:
            warnings.warn(f"{p}.outlier_mask is on with neither bound set: it does nothing", stacklevel=3)
        if self.token_mask and (self.token_mask_low is None or self.token_mask_high is None):
            warnings.warn(
                f"{p}.token_mask is on with only one of token_mask_low / token_mask_high set: like SkyRL, a token "
                "mask needs both bounds and is off",
                stacklevel=3,
            )

    @property
    def outlier_enabled(self) -> bool:
        """The outlier sequence mask is on: switched on and at least one bound set."""
        return self.outlier_mask and (self.outlier_low is not None or self.outlier_high is not None)

    @property
    def token_mask_enabled(self) -> bool:
        """The token mask is on: switched on and both bounds set."""
        return self.token_mask and self.token_mask_low is not None and self.token_mask_high is not None

    @property
    def any_enabled(self) -> bool:
        """True when at least one correction is on."""
        return (self.outlier_enabled or self.token_mask_enabled or self.m2_mask or self.tis != "off"
                or self.sequence_mask != "off")  # fmt: skip


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
    from_skyrl: str = ""
    """Path of a SkyRL config (YAML: the whole config, its ``trainer`` or its ``trainer.algorithm`` section) that
    sets ``advantage``, ``loss`` and ``correction`` (``async_rl.algorithms.skyrl``); those sections must then be
    left at their defaults. Empty: not used."""

    def __post_init__(self) -> None:
        if self.staleness_hist_max < 1:
            raise ValueError(f"algorithm.staleness_hist_max must be >= 1, got {self.staleness_hist_max}")
        if self.from_skyrl:
            self._take_skyrl_sections()
        tis, loss = self.correction.tis, self.loss
        if tis != "off" and (loss.type == "ppo" or (loss.type == "cispo" and loss.cispo_anchor == "rollout")):
            what = "ppo" if loss.type == "ppo" else "cispo with algorithm.loss.cispo_anchor='rollout'"
            raise ValueError(
                f"algorithm.correction.tis={tis!r} cannot go with algorithm.loss.type={what}: that loss's ratio is "
                "already π_θ/μ, so TIS would count the off-policy gap twice (set algorithm.correction.tis='off'; "
                "token_mask / sequence_mask can still drop far-off-policy data)"
            )
        if tis != "off" and loss.type == "rollout_is":
            warnings.warn(
                f"algorithm.correction.tis={tis!r} with algorithm.loss.type='rollout_is' weights tokens by π_old/μ "
                "on top of the loss's own π_θ/μ (SkyRL allows it; it counts the off-policy gap twice)",
                stacklevel=3,
            )

    def _take_skyrl_sections(self) -> None:
        bridged = _skyrl_config(load_skyrl_sections(self.from_skyrl))
        for name in ("advantage", "loss", "correction"):
            ours, theirs = getattr(self, name), getattr(bridged, name)
            if ours != type(ours)() and ours != theirs:
                raise ValueError(
                    f"algorithm.{name} and algorithm.from_skyrl are both set: set the section in the SkyRL file, "
                    "or drop from_skyrl"
                )
            setattr(self, name, theirs)

    @property
    def needs_proximal_logprobs(self) -> bool:
        """The learner must fill ``MicroBatch.proximal_logprobs`` with π_old (its logprobs before the step): the
        loss reads them (``regular``, ``dual_clip``, ``cispo`` anchored on ``old``) or a correction does."""
        loss = self.loss
        loss_reads_old = loss.type in ("regular", "dual_clip") or (loss.type == "cispo" and loss.cispo_anchor == "old")
        return loss_reads_old or (self.correction.any_enabled and self.correction.anchor == "old")

    @property
    def needs_reference_logprobs(self) -> bool:
        """The learner must fill ``MicroBatch.reference_logprobs`` (frozen reference model)."""
        return self.loss.kl_coef > 0.0

    @property
    def needs_entropy(self) -> bool:
        """The backend must return ``ForwardOutput.entropy`` with grad (``with_entropy=True``)."""
        return self.loss.entropy_coef > 0.0


def skyrl_algorithm_config(source: Mapping[str, Any] | str | Path | Sequence[str]) -> AlgorithmConfig:
    """Our :class:`AlgorithmConfig` for a SkyRL algorithm section: a mapping, a YAML file or SkyRL command-line
    overrides (``async_rl.algorithms.skyrl``)."""
    return _skyrl_config(skyrl_sections(source))


def _skyrl_config(sections: dict[str, dict[str, Any]]) -> AlgorithmConfig:
    try:
        return AlgorithmConfig(advantage=AdvantageConfig(**sections["advantage"]), loss=LossConfig(**sections["loss"]),
                               correction=CorrectionConfig(**sections["correction"]))  # fmt: skip
    except ValueError as exc:
        raise SkyRLConfigError(f"SkyRL trainer.algorithm section: {exc}") from exc
