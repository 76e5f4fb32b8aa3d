"""Evaluation scores (async_rl/metrics/evaluation.py): pass@k is the unbiased estimator (checked against counting
every k-subset), maj@k votes on extracted answers and scores the majority's reward, and the sums survive the
learner's checkpoint (JSON)."""

from __future__ import annotations

import itertools
import json

import pytest

from async_rl.metrics.evaluation import SourceScores, majority, pass_at_k


@pytest.mark.parametrize("n", [1, 2, 5, 8])
def test_pass_at_k_is_the_share_of_k_subsets_holding_a_correct_sample(n: int) -> None:
    for c in range(n + 1):
        correct = [True] * c + [False] * (n - c)
        for k in range(1, n + 1):
            subsets = list(itertools.combinations(correct, k))
            exact = sum(any(s) for s in subsets) / len(subsets)
            assert pass_at_k(n, c, k) == pytest.approx(exact, abs=1e-12), (n, c, k)
    assert pass_at_k(4, 2, 1) == 0.5 and pass_at_k(4, 2, 2) == pytest.approx(5 / 6)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(2, 1, 3)


def test_majority_votes_on_answers_and_takes_the_reward_of_the_first_majority_sample() -> None:
    rewards = [0.1, 1.0, 0.9, 0.2, 1.0]
    answers = ["7", "12", "12", "7", "12"]
    assert majority(answers, rewards, 1) == 0.1  # "7" alone
    assert majority(answers, rewards, 2) == 0.1  # a tie: the answer given first
    assert majority(answers, rewards, 3) == 1.0  # "12" twice, scored by its first sample's reward (not 0.9)
    assert majority(answers, rewards, 4) == 0.1  # 2 - 2: "7" came first
    assert majority(answers, rewards, 5) == 1.0
    assert majority(["12", "7", "7"], [1.0, 0.5, 0.25], 3) == 0.5  # the majority's first sample, not its last
    assert majority([None, None], [1.0, 1.0], 2) == 0.0  # nobody voted
    assert majority([None, "3"], [1.0, 0.75], 2) == 0.75  # a sample without an answer does not vote


def test_source_scores_report_mean_pass_and_maj_and_survive_json() -> None:
    scores = SourceScores()
    ks = (1, 2, 4)
    # Prompt 1: 2 of 4 right; the right answer is given first. Prompt 2: 1 of 4; the wrong answer wins the vote.
    scores.add([1.0, 0.0, 1.0, 0.0], {"exact": [1.0, 0.0, 1.0, 0.0]}, ["5", "6", "5", "6"], ks=ks,
               pass_threshold=1.0, min_version=3, max_version=4)  # fmt: skip
    restored = SourceScores.from_json(json.loads(json.dumps(scores.to_json())))  # a checkpoint in between
    restored.add([0.5, 1.0, 0.5, 0.5], {"exact": [0.0, 1.0, 0.0, 0.0]}, ["9", "8", "9", "9"], ks=ks,
                 pass_threshold=1.0, min_version=5, max_version=5)  # fmt: skip
    got = restored.metrics()
    assert got == pytest.approx({
        "reward": 4.5 / 8, "exact": 3 / 8, "mean@4": (0.5 + 0.625) / 2,
        "pass@1": (0.5 + 0.25) / 2, "pass@2": (5 / 6 + 0.5) / 2, "pass@4": 1.0,
        "maj@1": (1.0 + 0.5) / 2, "maj@2": (1.0 + 0.5) / 2, "maj@4": (1.0 + 0.5) / 2,
        "num_prompts": 2.0, "weights_version_min": 3.0, "weights_version_max": 5.0,
    })  # fmt: skip
    # pass_threshold: a sample scoring 0.5 passes at 0.5.
    lenient = SourceScores()
    lenient.add([0.5, 0.0], {}, [None, None], ks=(1,), pass_threshold=0.5)
    assert lenient.metrics()["pass@1"] == 0.5
    assert "maj@1" not in lenient.metrics()  # a task whose answers do not compare has no maj@k
    assert SourceScores().metrics() == {}
    with pytest.raises(ValueError, match="one answer per sample"):
        lenient.add([1.0], {}, [], ks=(1,), pass_threshold=1.0)
