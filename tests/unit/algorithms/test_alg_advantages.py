"""Advantages against hand-computed values, groups of one, equal rewards, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest

from async_rl.algorithms import AdvantageConfig, AlgorithmConfig, broadcast_to_tokens, compute_advantages


def _cfg(estimator: str) -> AlgorithmConfig:
    return AlgorithmConfig(advantage=AdvantageConfig(estimator=estimator, std_eps=1e-6))  # type: ignore[arg-type]


def test_grpo_hand_computed() -> None:
    adv, m = compute_advantages(np.array([[1.0, 0.0, 0.0, 1.0]]), _cfg("grpo"))
    # mean 0.5, unbiased std sqrt(1/3)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    np.testing.assert_allclose(adv, [[expected, -expected, -expected, expected]], rtol=1e-6)
    assert adv.dtype == np.float32 and adv.shape == (1, 4)
    assert m["adv_groups_count"] == 1 and m["adv_singleton_groups_count"] == 0 and m["adv_samples_count"] == 4


def test_dr_grpo_and_rloo_hand_computed() -> None:
    r = np.array([[1.0, 0.0, 0.0, 1.0], [3.0, 1.0, 2.0, 2.0]])
    adv, _ = compute_advantages(r, _cfg("dr_grpo"))
    np.testing.assert_allclose(adv, [[0.5, -0.5, -0.5, 0.5], [1.0, -1.0, 0.0, 0.0]], rtol=1e-6)
    adv, _ = compute_advantages(r, _cfg("rloo"))
    # r_i - mean(others): 1 - 1/3, 0 - 2/3 ; 3 - 5/3, 1 - 7/3, 2 - 2, 2 - 2
    np.testing.assert_allclose(adv, [[2 / 3, -2 / 3, -2 / 3, 2 / 3], [4 / 3, -4 / 3, 0.0, 0.0]], rtol=1e-6)


@pytest.mark.parametrize("estimator", ["grpo", "dr_grpo", "rloo"])
def test_ragged_groups_singletons_and_equal_rewards(estimator: str) -> None:
    groups = [np.array([2.0]), np.array([1.0, 1.0, 1.0]), np.array([0.0, 1.0])]
    adv, m = compute_advantages(groups, _cfg(estimator))
    assert isinstance(adv, list) and [a.shape for a in adv] == [(1,), (3,), (2,)]
    assert adv[0].tolist() == [0.0]
    assert adv[1].tolist() == [0.0, 0.0, 0.0]
    assert adv[2][0] < 0 < adv[2][1] and abs(adv[2].sum()) < 1e-6
    assert m["adv_singleton_groups_count"] == 1 and m["adv_zero_std_groups_count"] == 1
    assert m["adv_groups_count"] == 3 and m["adv_samples_count"] == 6
    assert all(np.isfinite(a).all() for a in adv)


def test_bad_rewards_are_named() -> None:
    with pytest.raises(ValueError, match="group 1 contain NaN"):
        compute_advantages([np.array([1.0, 0.0]), np.array([np.nan, 1.0])], _cfg("grpo"))
    with pytest.raises(ValueError, match="group 0 must be a non-empty"):
        compute_advantages([np.array([])], _cfg("grpo"))
    with pytest.raises(ValueError, match=r"\[num_groups, n\]"):
        compute_advantages(np.zeros(4), _cfg("grpo"))


def test_broadcast_to_tokens() -> None:
    a = broadcast_to_tokens(-0.5, 3)
    assert a.dtype == np.float32 and a.tolist() == [-0.5, -0.5, -0.5]
    assert broadcast_to_tokens(1.0, 0).shape == (0,)
    with pytest.raises(ValueError, match="num_tokens"):
        broadcast_to_tokens(1.0, -1)
