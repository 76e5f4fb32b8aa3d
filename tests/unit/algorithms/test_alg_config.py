"""AlgorithmConfig: defaults, what the learner must compute, and invalid values / combinations."""

from __future__ import annotations

import warnings

import pytest

from async_rl.algorithms import AlgorithmConfig, CorrectionConfig, LossConfig
from async_rl.config.configurable import ConfigError, from_dict, load_config


def test_defaults_are_rollout_anchored_cispo_with_every_correction_off() -> None:
    cfg = AlgorithmConfig()
    assert cfg.loss.type == "cispo" and cfg.loss.cispo_anchor == "rollout"
    # weight clip [1 - 1, 1 + 1] = [0, 2]: the band this project's default loss always had
    assert (cfg.loss.cispo_eps_clip_low, cfg.loss.cispo_eps_clip_high) == (1.0, 1.0)
    assert cfg.advantage.estimator == "grpo"
    assert cfg.loss.reduction == "token_mean" and cfg.loss.renormalize is False
    assert not cfg.correction.any_enabled
    assert cfg.correction.tis == "off" and cfg.correction.sequence_mask == "off"
    assert not cfg.needs_proximal_logprobs and not cfg.needs_reference_logprobs and not cfg.needs_entropy


def test_needs_properties_follow_the_config() -> None:
    cfg = from_dict(
        AlgorithmConfig,
        {"loss": {"type": "regular", "kl_coef": 0.01, "entropy_coef": 0.001}, "correction": {"tis": "token"}},
    )
    assert cfg.needs_proximal_logprobs and cfg.needs_reference_logprobs and cfg.needs_entropy


@pytest.mark.parametrize(
    ("loss", "correction", "needs_old"),
    [
        ({"type": "regular"}, {}, True),
        ({"type": "dual_clip"}, {}, True),
        ({"type": "cispo", "cispo_anchor": "old"}, {}, True),
        ({"type": "cispo", "cispo_anchor": "rollout"}, {}, False),
        ({"type": "rollout_is"}, {}, False),
        ({"type": "ppo"}, {}, False),
        # every correction reads π_old, whatever the loss (SkyRL) ...
        ({"type": "rollout_is"}, {"token_mask": True}, True),
        ({"type": "cispo"}, {"sequence_mask": "geometric"}, True),
        # ... unless they are told to use the current policy, or are not really on
        ({"type": "cispo"}, {"sequence_mask": "geometric", "anchor": "current"}, False),
        ({"type": "ppo"}, {"outlier_mask": True, "outlier_low": None, "outlier_high": None}, False),
    ],
)
def test_which_losses_and_corrections_need_pi_old(loss: dict, correction: dict, needs_old: bool) -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the bound-less outlier mask warns
        cfg = from_dict(AlgorithmConfig, {"loss": loss, "correction": correction})
    assert cfg.needs_proximal_logprobs is needs_old


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
            {"correction": {"token_mask_low": 0.9, "token_mask_high": 0.5}},
            "algorithm.correction.token_mask_high must be >= 1",
        ),
        ({"correction": {"token_mask_low": 2.0}}, "algorithm.correction.token_mask_low must be in (0, 1]"),
        ({"correction": {"geometric_low": 1.0, "geometric_high": 1.0}}, "algorithm.correction.geometric_low must be <"),
        ({"correction": {"outlier_low": 0.0}}, "algorithm.correction.outlier_low must be in (0, 1]"),
        ({"correction": {"outlier_high": 0.5, "outlier_low": None}}, "algorithm.correction.outlier_high must be >= 1"),
        ({"correction": {"product_low": 1.5, "product_high": 3.0}}, "algorithm.correction.product_low must be in"),
        ({"correction": {"anchor": "prox"}}, "correction.anchor must be one of"),
        (
            {"correction": {"tis": "token", "token_tis_cap": 0.5}, "loss": {"type": "regular"}},
            "token_tis_cap must be >= 1",
        ),
        ({"correction": {"sequence_tis_cap": 0.9}}, "algorithm.correction.sequence_tis_cap must be >= 1"),
        # SkyRL refuses TIS with the rollout-anchored CISPO (the default loss here); ppo is rollout-anchored too
        ({"correction": {"tis": "token"}}, "algorithm.correction.tis='token' cannot go with algorithm.loss.type=cispo"),
        ({"correction": {"tis": "sequence"}, "loss": {"type": "ppo"}}, "algorithm.correction.tis"),
        ({"loss": {"reduction": "token_sum_norm"}}, "algorithm.loss.max_tokens must be > 0"),
        ({"loss": {"reduction": "token_sum_norm", "max_tokens": 8, "renormalize": True}}, "algorithm.loss.renormalize"),
        ({"loss": {"clip_eps_low": 1.0}}, "algorithm.loss.clip_eps_low"),
        ({"loss": {"clip_eps_high": 0.0}}, "algorithm.loss.clip_eps_high"),
        ({"loss": {"dual_clip": 1.0}}, "algorithm.loss.dual_clip must be > 1"),
        ({"loss": {"type": "dual_clip", "dual_clip": 0.0}}, "algorithm.loss.dual_clip must be > 1 with"),
        ({"loss": {"cispo_eps_clip_low": 1.5}}, "algorithm.loss.cispo_eps_clip_low must be in [0, 1]"),
        ({"loss": {"cispo_eps_clip_high": -0.1}}, "algorithm.loss.cispo_eps_clip_high must be >= 0"),
        ({"loss": {"cispo_anchor": "prox"}}, "loss.cispo_anchor must be one of"),
        ({"loss": {"type": "decoupled_ppo"}}, "loss.type must be one of"),
        ({"loss": {"kl_coef": -0.1}}, "algorithm.loss.kl_coef must be >= 0"),
        ({"loss": {"entropy_coef": float("nan")}}, "algorithm.loss.entropy_coef must be a finite"),
        ({"advantage": {"std_eps": 0.0}}, "algorithm.advantage.std_eps must be > 0"),
        ({"staleness_hist_max": 0}, "algorithm.staleness_hist_max must be >= 1"),
        ({"loss": {"clip_eps": 0.2}}, "unknown config key"),
    ],
)
def test_invalid_values_name_the_dotted_field(data: dict, needle: str) -> None:
    with pytest.raises(ConfigError) as exc:
        from_dict(AlgorithmConfig, data, "algorithm")  # as the learner builds it: keys named from its root
    assert needle in str(exc.value)


def test_direct_construction_validates_literals_too() -> None:
    with pytest.raises(ValueError, match="algorithm.loss.type must be one of"):
        LossConfig(type="reinforce")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="algorithm.correction.sequence_mask must be one of"):
        CorrectionConfig(sequence_mask="arith")  # type: ignore[arg-type]


def test_tis_with_rollout_is_is_allowed_as_in_skyrl_but_warns() -> None:
    with pytest.warns(UserWarning, match="counts the off-policy gap twice"):
        cfg = from_dict(AlgorithmConfig, {"loss": {"type": "rollout_is"}, "correction": {"tis": "token"}})
    assert cfg.correction.tis == "token"
    # CISPO anchored on π_old takes TIS silently (its ratio is π_θ/π_old, TIS is π_old/μ)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        cfg = from_dict(AlgorithmConfig, {"loss": {"type": "cispo", "cispo_anchor": "old"},
                                          "correction": {"tis": "sequence"}})  # fmt: skip
    assert cfg.needs_proximal_logprobs


def test_one_sided_token_mask_is_off_and_warns_one_sided_outlier_band_is_on() -> None:
    with pytest.warns(UserWarning, match="needs both bounds and is off"):
        cfg = CorrectionConfig(token_mask=True, token_mask_high=None)
    assert not cfg.token_mask_enabled and not cfg.any_enabled
    cfg = CorrectionConfig(outlier_mask=True, outlier_low=None)
    assert cfg.outlier_enabled and cfg.outlier_high == 100.0
    with pytest.warns(UserWarning, match="neither bound"):
        assert not CorrectionConfig(outlier_mask=True, outlier_low=None, outlier_high=None).any_enabled
