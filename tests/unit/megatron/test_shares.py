"""The Megatron backend's data path on the CPU (actors/learner/megatron/shares.py): DP rows, dummy shares, CP/SP
padding and positions, labels, replay indices, and the schedule's shape announced before any share is cut."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from actors.learner.megatron.routes import TokenSplit
from actors.learner.megatron.shares import ShareCutter
from actors.learner.megatron.toy import make_batch, toy_config, with_routes

CFG = toy_config(num_layers=2, dense_first=False, num_experts=8, top_k=2)


def _cutter(dp_size: int = 1, dp_rank: int = 0, cp_size: int = 1, cp_rank: int = 0, experts: int = 8) -> ShareCutter:
    return ShareCutter(dp_size=dp_size, dp_rank=dp_rank, tokens=TokenSplit(cp_size=cp_size, cp_rank=cp_rank),
                       moe_indices=[0, 1], num_moe_layers=2, top_k=2, num_experts=experts,
                       device=torch.device("cpu"))  # fmt: skip


def _routed(lengths: list[int], seed: int = 0):  # type: ignore[no-untyped-def]
    mb = make_batch(CFG, lengths, seed=seed)
    rng = np.random.default_rng(seed)
    return with_routes(mb, [rng.integers(0, 8, size=(n - 1, 2, 2)).astype(np.uint8) for n in lengths])


def test_dp_ranks_take_contiguous_rows_and_an_empty_share_runs_a_masked_row() -> None:
    mb = _routed([12, 10, 9, 7, 5])
    got = [_cutter(dp_size=2, dp_rank=r).cut(mb, True) for r in range(2)]
    assert [list(s.rows) for s in got] == [[0, 1, 2], [3, 4]]
    for s in got:
        assert torch.equal(s.mb.input_ids, mb.input_ids[s.rows[0] : s.rows[-1] + 1])
        assert torch.equal(s.labels[:, :-1], s.input_ids[:, 1:]) and (s.labels[:, -1] == 0).all()
        assert s.replay is not None and len(s.replay) == 2
        assert all(r.shape == (s.input_ids.numel(), 2) for r in s.replay)
    lone = _cutter(dp_size=2, dp_rank=1).cut(_routed([6]), True)
    assert lone.rows.size == 0 and lone.input_ids.shape == (1, 6)
    assert not lone.mb.attention_mask.any() and not lone.mb.loss_mask.any() and lone.replay is None


def test_context_parallel_shares_pad_and_take_their_positions() -> None:
    mb = _routed([11, 9])  # T = 11: padded to a multiple of 2 * CP = 4 -> 12, 6 positions per CP rank
    shares = [_cutter(cp_size=2, cp_rank=r).cut(mb, True) for r in range(2)]
    seen = torch.cat([s.positions for s in shares]).sort().values
    assert torch.equal(seen, torch.arange(12))
    for s in shares:
        assert s.mb.input_ids.shape == (2, 12) and s.input_ids.shape == (2, 6)
        assert torch.equal(s.position_ids[0], s.positions)
        assert torch.equal(s.input_ids, s.mb.input_ids[:, s.positions])
    assert _cutter(cp_size=2).schedule_shape([mb, _routed([5])]) == (6, 2)


def test_schedule_shape_is_the_largest_share() -> None:
    mbs = [_routed([12, 10, 9]), _routed([7]), _routed([20, 3, 3, 3, 3])]
    for rank in range(2):
        cutter = _cutter(dp_size=2, dp_rank=rank)
        seq, rows = cutter.schedule_shape(mbs)
        shares = [cutter.cut(mb, True) for mb in mbs]
        assert seq == max(s.input_ids.shape[1] for s in shares) == 20
        assert rows == max(s.input_ids.shape[0] for s in shares) == (3 if rank == 0 else 2)


@pytest.mark.parametrize(("replay", "experts"), [(False, 8), (True, 0)])
def test_no_replay_indices_unless_asked_and_routed(replay: bool, experts: int) -> None:
    assert _cutter(experts=experts).cut(_routed([9, 6]), replay).replay is None
    assert _cutter().cut(make_batch(CFG, [9, 6]), True).replay is None  # no routes recorded
