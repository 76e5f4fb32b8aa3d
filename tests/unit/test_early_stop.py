"""learner.target_metric: early stopping on the mean reward or on a named reward component (e.g. the exact-match rate)."""

from __future__ import annotations

import pytest

from actors.learner.config import LearnerConfig
from actors.learner.loop import target_value
from async_rl.config.configurable import ConfigError, load_config

URLS = ["run.redis_url=redis://127.0.0.1:1/0", "run.nats_url=nats://127.0.0.1:1"]


def test_target_metric_is_the_reward_or_a_reward_component() -> None:
    cfg = load_config(LearnerConfig, None, [*URLS, "target_reward=0.9", "target_metric=reward/exact"])
    assert cfg.target_metric == "reward/exact" and load_config(LearnerConfig, None, URLS).target_metric == "reward"
    for bad in ("loss", "reward/", "exact"):
        with pytest.raises(ConfigError, match="^target_metric must be 'reward' or 'reward/<component>'"):
            load_config(LearnerConfig, None, [*URLS, f"target_metric={bad}"])


def test_target_value_names_what_the_task_reports() -> None:
    metrics = {"reward": 0.8, "reward/exact": 0.25, "reward/length_ok": 1.0, "grad_norm": 0.1}
    assert target_value(metrics, "reward/exact") == 0.25 and target_value(metrics, "reward") == 0.8
    with pytest.raises(ValueError, match=r"'reward/solved' is not reported .*'reward/exact', 'reward/length_ok'"):
        target_value(metrics, "reward/solved")
