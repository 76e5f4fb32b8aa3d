"""Micro-batching of TrainSamples by a padded-token budget."""

from __future__ import annotations

import numpy as np
import pytest

from actors.learner.batching import collate, make_micro_batches
from actors.learner.config import BatchingConfig
from async_rl.algorithms.batch import TrainSample


def _sample(prompt_len: int, resp_len: int, seed: int, routes: bool = False) -> TrainSample:
    rng = np.random.default_rng(seed)
    t = prompt_len + resp_len
    return TrainSample(
        input_ids=rng.integers(1, 30, t).astype(np.int32), prompt_len=prompt_len,
        behaviour_logprobs=-rng.random(resp_len).astype(np.float32), versions=np.full(resp_len, seed, np.int32),
        advantages=rng.standard_normal(resp_len).astype(np.float32),
        routes=rng.integers(0, 8, (t - 1, 3, 2)).astype(np.uint8) if routes else None, group_id=f"g{seed}",
    )  # fmt: skip


def test_collate_aligns_response_fields_and_pads() -> None:
    a, b = _sample(3, 4, 1, routes=True), _sample(2, 2, 2)
    mb = collate([a, b], step_num_tokens=11, step_num_sequences=5)
    assert mb.input_ids.shape == (2, 7) and mb.input_ids.dtype.is_floating_point is False
    assert mb.input_ids[0].tolist() == a.input_ids.tolist()
    assert mb.input_ids[1].tolist() == b.input_ids.tolist() + [0, 0, 0]
    assert mb.attention_mask.sum(1).tolist() == [7, 4]
    assert mb.loss_mask[0].tolist() == [False] * 3 + [True] * 4
    assert mb.loss_mask[1].tolist() == [False, False, True, True, False, False, False]
    np.testing.assert_array_equal(mb.behaviour_logprobs[0, 3:].numpy(), a.behaviour_logprobs)
    np.testing.assert_array_equal(mb.advantages[1, 2:4].numpy(), b.advantages)
    assert float(mb.advantages[1, 4:].abs().sum()) == 0.0 and float(mb.behaviour_logprobs[:, :2].abs().sum()) == 0.0
    assert mb.token_versions[0, 3:].tolist() == [1] * 4 and mb.token_versions[0, :3].tolist() == [0] * 3
    assert mb.routes[0] is a.routes and mb.routes[1] is None
    assert (mb.step_num_tokens, mb.step_num_sequences, mb.group_ids) == (11, 5, ["g1", "g2"])
    assert mb.num_tokens == 11 and mb.num_sequences == 2


def test_micro_batches_respect_budget_and_cover_each_sample_once() -> None:
    lengths = [(4, 12), (4, 3), (5, 20), (2, 2), (4, 9), (3, 30), (6, 6), (2, 1)]
    samples = [_sample(p, r, i) for i, (p, r) in enumerate(lengths)]
    cfg = BatchingConfig(micro_batch_tokens=40)
    mbs = make_micro_batches(samples, cfg)
    seen = [g for mb in mbs for g in mb.group_ids]
    assert sorted(seen) == sorted(s.group_id for s in samples)
    total_resp = sum(r for _, r in lengths)
    for mb in mbs:
        b, t = mb.input_ids.shape
        assert b * t <= 40 or b == 1  # only a sequence over budget may exceed it, alone
        assert mb.step_num_tokens == total_resp and mb.step_num_sequences == len(samples)
    assert sum(int(mb.loss_mask.sum()) for mb in mbs) == total_resp
    # Longest first: the 33-token sequence leads, alone (33 * 2 > 40).
    assert mbs[0].group_ids == ["g5"]
    over = make_micro_batches(samples, BatchingConfig(micro_batch_tokens=10))
    assert len(over) >= 6 and all(mb.num_sequences == 1 for mb in over if mb.input_ids.shape[1] > 10)
    capped = make_micro_batches(samples, BatchingConfig(micro_batch_tokens=10_000, max_micro_batch_sequences=3))
    assert [mb.num_sequences for mb in capped] == [3, 3, 2]
    one = make_micro_batches(samples, BatchingConfig(micro_batch_tokens=10_000, sort_by_length=False))
    assert len(one) == 1 and one[0].group_ids == [s.group_id for s in samples]
    dp = make_micro_batches(samples, cfg, step_num_tokens=1000, step_num_sequences=64)
    assert {(mb.step_num_tokens, mb.step_num_sequences) for mb in dp} == {(1000, 64)}
    assert make_micro_batches([], cfg) == []


def test_bad_samples_and_config_are_named() -> None:
    s = _sample(3, 4, 1)
    s.advantages = s.advantages[:3]
    with pytest.raises(ValueError, match=r"samples\[0\] \(g1\): advantages must have shape \(4,\)"):
        make_micro_batches([s], BatchingConfig())
    s = _sample(3, 4, 1)
    s.prompt_len = 0
    with pytest.raises(ValueError, match="prompt_len must be in"):
        collate([s], step_num_tokens=1, step_num_sequences=1)
    s = _sample(3, 4, 1, routes=True)
    s.routes = np.zeros((9, 3, 2), np.uint8)
    with pytest.raises(ValueError, match="routes cover 9 tokens"):
        make_micro_batches([s], BatchingConfig())
    with pytest.raises(ValueError, match="learner.batching.micro_batch_tokens must be > 0"):
        BatchingConfig(micro_batch_tokens=0)
    with pytest.raises(ValueError, match="max_micro_batch_sequences"):
        BatchingConfig(max_micro_batch_sequences=-1)
