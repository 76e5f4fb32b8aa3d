"""AlgorithmConfig: defaults, what the learner must compute, and invalid values / combinations."""

from __future__ import annotations

import pytest

from async_rl.algorithms import AlgorithmConfig, CorrectionConfig, LossConfig
from async_rl.configurable import ConfigError, from_dict, load_config


def test_defaults_are_rollout_is_with_every_correction_off() -> None:
    cfg = AlgorithmConfig()
    assert cfg.loss.type == "rollout_is"
    assert cfg.advantage.estimator == "grpo"
    assert cfg.loss.reduction == "token_mean" and cfg.loss.renormalize is False
    assert not cfg.correction.any_enabled
    assert cfg.correction.tis == "off" and cfg.correction.sequence_mask == "off"
    assert not cfg.needs_proximal_logprobs and not cfg.needs_reference_logprobs and not cfg.needs_entropy


def test_needs_properties_follow_the_config() -> None:
    cfg = from_dict(
        AlgorithmConfig,
        {"loss": {"type": "decoupled_ppo", "kl_coef": 0.01, "entropy_coef": 0.001}, "correction": {"tis": "token"}},
    )
    assert cfg.needs_proximal_logprobs and cfg.needs_reference_logprobs and cfg.needs_entropy


def test_overrides_build_nested_sections() -> None:
    cfg = load_config(AlgorithmConfig, overrides=["loss.type=ppo", "loss.dual_clip=0", "correction.token_mask=true"])
    assert cfg.loss.type == "ppo" and cfg.loss.dual_clip == 0.0 and cfg.correction.token_mask


@pytest.mark.parametrize(
    ("data", "needle"),
    [
        ({"loss": {"type": "grpo"}}, "loss.type"),
        ({"advantage": {"estimator": "gae"}}, "advantage.estimator"),
        ({"loss": {"reduction": "mean"}}, "loss.reduction"),
        ({"loss": {"kl_estimator": "k4"}}, "loss.kl_estimator"),
        ({"correction": {"tis": "both"}}, "correction.tis"),
        (
            {"correction": {"token_mask_low": 2.0, "token_mask_high": 0.5}},
            "algorithm.correction.token_mask_low must be <",
        ),
        ({"correction": {"geometric_low": 1.0, "geometric_high": 1.0}}, "algorithm.correction.geometric_low must be <"),
        ({"correction": {"outlier_low": 0.0}}, "algorithm.correction.outlier_low must be > 0"),
        ({"correction": {"product_low": 1.5, "product_high": 3.0}}, "algorithm.correction.product_low <= 1"),
        (
            {"correction": {"tis": "token", "token_tis_cap": 0.5}, "loss": {"type": "decoupled_ppo"}},
            "token_tis_cap must be >= 1",
        ),
        ({"correction": {"sequence_tis_cap": 0.9}}, "algorithm.correction.sequence_tis_cap must be >= 1"),
        (
            {"correction": {"tis": "token"}},
            "algorithm.correction.tis='token' needs algorithm.loss.type='decoupled_ppo'",
        ),
        ({"correction": {"tis": "sequence"}, "loss": {"type": "ppo"}}, "algorithm.correction.tis"),
        ({"loss": {"reduction": "token_sum_norm"}}, "algorithm.loss.max_tokens must be > 0"),
        ({"loss": {"reduction": "token_sum_norm", "max_tokens": 8, "renormalize": True}}, "algorithm.loss.renormalize"),
        ({"loss": {"clip_eps_low": 1.0}}, "algorithm.loss.clip_eps_low"),
        ({"loss": {"clip_eps_high": 0.0}}, "algorithm.loss.clip_eps_high"),
        ({"loss": {"dual_clip": 1.0}}, "algorithm.loss.dual_clip must be > 1"),
        ({"loss": {"rollout_is_high": 1.0}}, "algorithm.loss.rollout_is_high must be > 1"),
        ({"loss": {"rollout_is_low": 1.0}}, "algorithm.loss.rollout_is_low"),
        ({"loss": {"kl_coef": -0.1}}, "algorithm.loss.kl_coef must be >= 0"),
        ({"loss": {"entropy_coef": float("nan")}}, "algorithm.loss.entropy_coef must be a finite"),
        ({"advantage": {"std_eps": 0.0}}, "algorithm.advantage.std_eps must be > 0"),
        ({"staleness_hist_max": 0}, "algorithm.staleness_hist_max must be >= 1"),
        ({"loss": {"clip_eps": 0.2}}, "unknown config key"),
    ],
)
def test_invalid_values_name_the_dotted_field(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        from_dict(AlgorithmConfig, data)
    assert needle in str(exc.value)


def test_direct_construction_validates_literals_too() -> None:
    with pytest.raises(ValueError, match="algorithm.loss.type must be one of"):
        LossConfig(type="reinforce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="algorithm.correction.sequence_mask must be one of"):
        CorrectionConfig(sequence_mask="arith")  # type: ignore[arg-type]
