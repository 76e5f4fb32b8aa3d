"""A step's rows spread over DP ranks by tokens (actors/learner/megatron/balance.py): every row once, the cap kept,
the ranks' micro-batches of a round close in cost, and the rows' data unchanged."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.learner.megatron.balance import balanced_rounds, rebalance, take_rows
from actors.learner.megatron.toy import make_batch, toy_config, with_routes

CFG = toy_config(num_layers=2, dense_first=False, num_experts=8, top_k=2)
SLICE = [[6436, 5687], [5114, 4643, 4278], [4248, 4155, 3913], [3797, 3402, 3300, 3209], [3178, 2660, 2642, 2048]]
"""The Qwen3-30B-A3B slice's step in micro-batches of 16k tokens, as `bench backends` cuts it."""


def _cost(lengths: list[int], part: list[int]) -> int:
    return max((lengths[i] for i in part), default=0) * len(part)


def _contiguous_cost(mbs: list[list[int]], dp: int) -> int:
    """What the ranks wait for when each micro-batch's rows are split in contiguous runs of equal count."""
    return sum(max(max(s, default=0) * len(s) for s in np.array_split(np.array(mb), dp)) for mb in mbs)


def test_the_slice_step_waits_on_fewer_tokens_and_every_row_trains_once() -> None:
    lengths = [n for mb in SLICE for n in mb]
    cap = max(-(-len(mb) * max(mb) // 2) for mb in SLICE)
    rounds = balanced_rounds(lengths, 2, cap)
    assert sorted(i for parts in rounds for part in parts for i in part) == list(range(len(lengths)))
    assert all(len(parts) == 2 for parts in rounds)
    assert all(_cost(lengths, part) <= cap or len(part) == 1 for parts in rounds for part in parts)
    waited = sum(max(_cost(lengths, part) for part in parts) for parts in rounds)
    assert waited < 0.9 * _contiguous_cost(SLICE, 2)  # 33,933 against 39,110 padded tokens
    assert waited <= 1.1 * sum(lengths) / 2  # within 10 % of a perfect split (31,355)
    per_rank = [sum(_cost(lengths, parts[r]) for parts in rounds) for r in range(2)]
    assert max(per_rank) / min(per_rank) < 1.15  # 33,933 against 30,615: a round's longest row opens rank 0


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_random_steps_keep_every_row_and_the_cap(dp: int) -> None:
    rng = np.random.default_rng(dp)
    for _ in range(50):
        lengths = [int(x) for x in rng.integers(1, 300, size=int(rng.integers(1, 40)))]
        cap = int(rng.integers(1, 900))
        rounds = balanced_rounds(lengths, dp, cap)
        assert sorted(i for parts in rounds for part in parts for i in part) == list(range(len(lengths)))
        for parts in rounds:
            assert len(parts) == dp and parts[0]  # the first rank of a round always has a row
            assert all(_cost(lengths, p) <= cap or len(p) == 1 for p in parts)


def test_rebalance_moves_rows_with_their_data_and_pads_to_the_round() -> None:
    rng = np.random.default_rng(0)
    lens = [[12, 10, 9], [8, 7, 7], [5]]
    mbs = [with_routes(make_batch(CFG, ls, seed=k), [rng.integers(0, 8, size=(n - 1, 2, 2)).astype(np.uint8)
                                                     for n in ls]) for k, ls in enumerate(lens)]  # fmt: skip
    for mb in mbs:
        mb.proximal_logprobs = (mb.behaviour_logprobs + 0.5) * mb.loss_mask
    plan = rebalance(mbs, 2)
    assert all(len(r) == 2 for r in plan)
    seen = {}
    for parts in plan:
        width = max(p.input_ids.shape[1] for p in parts)
        for p in parts:
            assert p.input_ids.shape[1] == width  # every part of a round, an empty one too, has the round's width
            assert p.step_num_tokens == mbs[0].step_num_tokens and p.step_num_sequences == mbs[0].step_num_sequences
            for r in range(p.num_sequences):
                n = int(p.attention_mask[r].sum())
                seen[tuple(p.input_ids[r, :n].tolist())] = (p, r, n)
    assert len(seen) == sum(mb.num_sequences for mb in mbs)
    for mb in mbs:
        for r in range(mb.num_sequences):
            n = int(mb.attention_mask[r].sum())
            p, pr, pn = seen[tuple(mb.input_ids[r, :n].tolist())]
            assert pn == n and p.routes[pr] is mb.routes[r]
            for f in ("loss_mask", "behaviour_logprobs", "advantages", "token_versions", "proximal_logprobs"):
                got, want = getattr(p, f)[pr], getattr(mb, f)[r]
                assert torch.equal(got[:n], want[:n]) and not got[n:].any(), f
    total = sum(float((mb.advantages * mb.loss_mask).sum()) for mb in mbs)
    assert sum(float((p.advantages * p.loss_mask).sum()) for parts in plan for p in parts) == pytest.approx(total)


def test_an_empty_part_has_no_rows_and_the_given_width() -> None:
    like = make_batch(CFG, [6, 4])
    empty = take_rows([], like=like, width=6)
    assert empty.input_ids.shape == (0, 6) and empty.attention_mask.dtype == torch.bool and empty.routes == []
    assert take_rows([(like, 1)], like=like).input_ids.shape == (1, 4)
    plan = rebalance([make_batch(CFG, [9])], 2)
    assert [p.num_sequences for p in plan[0]] == [1, 0] and plan[0][1].input_ids.shape == (0, 9)
