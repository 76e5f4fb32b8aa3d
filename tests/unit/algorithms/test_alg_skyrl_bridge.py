"""The SkyRL config bridge: a real SkyRL algorithm section (YAML, dict, command-line overrides) becomes our
AlgorithmConfig, and every setting without an equivalent is named in one error; through the CLI too."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from async_rl.algorithms.config import (
    AdvantageConfig,
    AlgorithmConfig,
    CorrectionConfig,
    LossConfig,
    skyrl_algorithm_config,
)
from async_rl.algorithms.skyrl import SkyRLConfigError
from async_rl.config.configurable import ConfigError, from_dict, load_config, to_dict

FIXTURE = Path(__file__).parent / "fixtures" / "skyrl_ppo_base.yaml"

# The trainer.algorithm overrides of SkyRL's examples/train/algorithms/dapo/run_dapo_qwen3_1.7b_aime_fully_async.sh,
# with its variables filled in, except loss_reduction (the script's token_mean_legacy has no equivalent, below)
# and the two DAPO-only overlong_* keys of that example's own config class.
DAPO_ASYNC = [
    "trainer.algorithm.off_policy_correction.sequence_mask_metric=geometric",
    "trainer.algorithm.off_policy_correction.geo_mask_high=1.01",
    "trainer.algorithm.off_policy_correction.geo_mask_low=0.99",
    'trainer.algorithm.advantage_estimator="grpo"',
    'trainer.algorithm.policy_loss_type="rollout_is"',
    "trainer.algorithm.loss_reduction=token_mean",
    "trainer.algorithm.use_kl_loss=false",
    "trainer.algorithm.clip_ratio_c=10.0",
    "trainer.algorithm.eps_clip_low=0.5",
    "trainer.algorithm.eps_clip_high=4.0",
    "trainer.fully_async.enabled=true",  # another section: skipped
    "generator.n_samples_per_prompt=16",
]


def test_the_skyrl_base_config_is_regular_ppo_with_its_kl_loss() -> None:
    cfg = skyrl_algorithm_config(FIXTURE)
    # policy_loss_type regular, eps 0.2 / 0.2 (clip_ratio_c is inert for regular), token_mean, grpo with std,
    # use_kl_loss with 0.001 and k3, no entropy loss, no correction; the cispo section is inert (loss not chosen)
    expected = AlgorithmConfig(
        advantage=AdvantageConfig(estimator="grpo"),
        loss=LossConfig(type="regular", clip_eps_low=0.2, clip_eps_high=0.2, reduction="token_mean", kl_coef=0.001,
                        kl_estimator="k3", entropy_coef=0.0),
        correction=CorrectionConfig(anchor="old"),
    )  # fmt: skip
    assert cfg == expected
    assert cfg.needs_proximal_logprobs and cfg.needs_reference_logprobs and not cfg.correction.any_enabled


def test_skyrl_defaults_fill_missing_keys_not_ours() -> None:
    # {} is SkyRL's default recipe: regular PPO and use_kl_loss = true with 0.001
    cfg = skyrl_algorithm_config({})
    assert cfg.loss.type == "regular" and cfg.loss.kl_coef == 0.001
    # CISPO without a cispo section: SkyRL's anchor old and band [1 - 1, 1 + 4]
    loss = skyrl_algorithm_config({"policy_loss_type": "cispo", "use_kl_loss": False}).loss
    assert (loss.cispo_anchor, loss.cispo_eps_clip_low, loss.cispo_eps_clip_high, loss.kl_coef) == ("old", 1, 4, 0)


def test_the_fully_async_dapo_overrides() -> None:
    cfg = skyrl_algorithm_config(DAPO_ASYNC)
    expected = AlgorithmConfig(
        loss=LossConfig(type="rollout_is", clip_eps_low=0.5, clip_eps_high=4.0, kl_coef=0.0),
        correction=CorrectionConfig(sequence_mask="geometric", geometric_low=0.99, geometric_high=1.01),
    )
    assert cfg == expected
    assert cfg.needs_proximal_logprobs  # the geometric mask reads π_old, as in SkyRL
    # the script as written: token_mean_legacy and the DAPO example's own keys, named together
    script = [*DAPO_ASYNC[:5], "trainer.algorithm.loss_reduction=token_mean_legacy",
              "trainer.algorithm.overlong_buffer_len=4096",
              "trainer.algorithm.overlong_buffer_penalty_factor=1.0"]  # fmt: skip
    with pytest.raises(SkyRLConfigError) as exc:
        skyrl_algorithm_config(script)
    msg = str(exc.value)
    for needle in ("loss_reduction='token_mean_legacy'", "overlong_buffer_len (not a SkyRL trainer.algorithm key)",
                   "overlong_buffer_penalty_factor"):  # fmt: skip
        assert needle in msg, msg


def test_every_setting_without_an_equivalent_is_named_in_one_error() -> None:
    section = {
        "advantage_estimator": "gae", "policy_loss_type": "gspo", "use_kl_in_reward": True,
        "loss_reduction": "prompt_mean", "zero_variance_filter": True, "advantage_batch_normalize": True,
        "kl_estimator_type": "abs", "temperature": 1.0, "dynamic_sampling": {"type": "filter"},
        "eps_clip_hgh": 0.28, "off_policy_correction": {"tis_ratio_typ": "token"},
    }  # fmt: skip
    with pytest.raises(SkyRLConfigError) as exc:
        skyrl_algorithm_config({"trainer": {"algorithm": section}})
    msg = str(exc.value)
    for needle in ("advantage_estimator='gae'", "policy_loss_type='gspo'", "use_kl_in_reward=True",
                   "loss_reduction='prompt_mean'", "zero_variance_filter=True", "advantage_batch_normalize=True",
                   "kl_estimator_type='abs'", "temperature=1.0", "dynamic_sampling.type='filter'",
                   "eps_clip_hgh (not a SkyRL", "off_policy_correction.tis_ratio_typ (not a SkyRL"):  # fmt: skip
        assert needle in msg, needle
    assert isinstance(exc.value, ConfigError)


def test_inert_keys_are_accepted_as_skyrl_ignores_them() -> None:
    # GAE / critic knobs, the options of losses not chosen, the KL controller with use_kl_in_reward off
    cfg = skyrl_algorithm_config({"lambd": 0.95, "gamma": 0.99, "value_clip": 0.5, "sapo": {"tau_pos": 2.0},
                                  "clip_cov": {"clip_ratio": 0.1}, "kl_ctrl": {"type": "adaptive"},
                                  "dppo": {"delta_low": 0.05}, "clip_ratio_c": 1.0, "kl_estimator_type": "abs",
                                  "use_kl_loss": False})  # fmt: skip
    assert cfg.loss.type == "regular" and cfg.loss.kl_coef == 0.0 and cfg.loss.dual_clip == 3.0


def test_off_policy_correction_keys() -> None:
    opc = {
        "tis_ratio_type": "sequence", "sequence_tis_ratio_clip_high": 8.0, "token_tis_ratio_clip_high": 0.5,
        "sequence_mask_metric": "product", "product_mask_low": 0.25, "product_mask_high": 4.0,
        "outlier_token_is_threshold_high": 50.0, "token_mask_is_threshold_low": 0.6, "token_mask_is_threshold_high": 1.5,
    }  # fmt: skip
    c = skyrl_algorithm_config({"policy_loss_type": "dual_clip", "clip_ratio_c": 5.0,
                                "off_policy_correction": opc}).correction  # fmt: skip
    # the token TIS cap 0.5 is inert with sequence TIS (it would be refused here if it were used)
    assert (c.tis, c.sequence_tis_cap, c.token_tis_cap) == ("sequence", 8.0, 2.0)
    assert (c.sequence_mask, c.product_low, c.product_high) == ("product", 0.25, 4.0)
    # one outlier bound alone enables a one-sided band
    assert c.outlier_enabled and (c.outlier_low, c.outlier_high) == (None, 50.0)
    assert c.token_mask_enabled and (c.token_mask_low, c.token_mask_high) == (0.6, 1.5)
    # a single token-mask bound: off, as in SkyRL, with a warning
    with pytest.warns(UserWarning, match="needs both bounds"):
        c = skyrl_algorithm_config({"off_policy_correction": {"token_mask_is_threshold_high": 2.0}}).correction
    assert not c.token_mask_enabled
    # the deprecated use_tis is token TIS capped at tis_imp_ratio_cap, as SkyRL's validation rewrites it
    c = skyrl_algorithm_config({"use_tis": True, "tis_imp_ratio_cap": 3.0}).correction
    assert (c.tis, c.token_tis_cap) == ("token", 3.0)


def test_reductions_and_advantages() -> None:
    assert skyrl_algorithm_config({"loss_reduction": "sequence_mean"}).loss.reduction == "seq_mean_token_mean"
    loss = skyrl_algorithm_config({"loss_reduction": "seq_mean_token_sum_norm", "max_seq_len": 4096}).loss
    assert (loss.reduction, loss.max_tokens) == ("token_sum_norm", 4096)
    with pytest.raises(SkyRLConfigError, match="max_seq_len=None"):
        skyrl_algorithm_config({"loss_reduction": "seq_mean_token_sum_norm"})
    assert skyrl_algorithm_config({"grpo_norm_by_std": False}).advantage.estimator == "dr_grpo"
    assert skyrl_algorithm_config({"advantage_estimator": "rloo", "grpo_norm_by_std": False}).advantage.estimator == (
        "rloo"
    )


def test_skyrl_refusals_and_our_bounds_are_reported_as_skyrl_errors() -> None:
    with pytest.raises(SkyRLConfigError, match="twice"):  # SkyRL refuses TIS with cispo anchored on the rollout
        skyrl_algorithm_config({"policy_loss_type": "cispo", "cispo": {"cispo_anchor": "rollout"},
                                "off_policy_correction": {"tis_ratio_type": "token"}})  # fmt: skip
    with pytest.raises(SkyRLConfigError, match="algorithm.correction.geometric_low must be in"):
        skyrl_algorithm_config({"off_policy_correction": {"sequence_mask_metric": "geometric", "geo_mask_low": 1.2,
                                                          "geo_mask_high": 1.5}})  # fmt: skip
    with pytest.raises(SkyRLConfigError, match=r"eps_clip_low='0\.2' \(a number"):
        skyrl_algorithm_config({"eps_clip_low": "0.2"})


def test_from_skyrl_through_the_config_loader(tmp_path: Path) -> None:
    cfg = load_config(AlgorithmConfig, overrides=[f"from_skyrl={FIXTURE}"])
    bridged = skyrl_algorithm_config(FIXTURE)
    assert (cfg.advantage, cfg.loss, cfg.correction) == (bridged.advantage, bridged.loss, bridged.correction)
    assert cfg.from_skyrl == str(FIXTURE) and cfg.loss.type == "regular"
    # the resolved config, saved with the run, loads back
    assert from_dict(AlgorithmConfig, json.loads(json.dumps(to_dict(cfg)))) == cfg
    # a section set beside from_skyrl is refused rather than silently overwritten
    with pytest.raises(ConfigError, match="^loss and from_skyrl are both set"):  # its keys, from its own root
        load_config(AlgorithmConfig, overrides=[f"from_skyrl={FIXTURE}", "loss.type=ppo"])
    from actors.learner.config import LearnerConfig

    with pytest.raises(ConfigError, match="^algorithm.loss and algorithm.from_skyrl are both set"):  # the learner's
        load_config(LearnerConfig, overrides=[f"algorithm.from_skyrl={FIXTURE}", "algorithm.loss.type=ppo"])
    with pytest.raises(ConfigError, match="is not a file"):
        load_config(AlgorithmConfig, overrides=[f"from_skyrl={tmp_path / 'missing.yaml'}"])


def test_from_skyrl_through_the_learner_cli(tmp_path: Path) -> None:
    from actors.learner.config import LearnerConfig

    cfg = load_config(LearnerConfig, None, [f"algorithm.from_skyrl={FIXTURE}"])
    assert cfg.algorithm.loss.type == "regular" and cfg.algorithm.loss.kl_coef == 0.001
    bad = tmp_path / "skyrl.yaml"
    bad.write_text("trainer:\n  algorithm:\n    policy_loss_type: sapo\n    loss_reduction: prompt_mean\n")
    out = subprocess.run([sys.executable, "-m", "actors.commands", "learner", f"algorithm.from_skyrl={bad}"],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 2 and "Traceback" not in out.stderr, out.stderr
    assert "policy_loss_type='sapo'" in out.stderr and "loss_reduction='prompt_mean'" in out.stderr


def test_the_bridge_is_torch_free() -> None:
    probe = (f"import sys; from async_rl.algorithms.config import skyrl_algorithm_config as f; f({str(FIXTURE)!r}); "
             "print('torch' in sys.modules)")  # fmt: skip
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "False", out.stderr
