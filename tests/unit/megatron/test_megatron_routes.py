"""Host-side route slicing for Megatron ranks (no megatron-core import)."""

from __future__ import annotations

import numpy as np
import pytest

from actors.learner.megatron.routes import (
    PipelineSplit,
    TokenSplit,
    dummy_experts,
    moe_indices_on_stage,
    replay_indices,
    scatter_recorded,
)


def test_even_split_covers_all_layers_once() -> None:
    s = PipelineSplit(num_layers=8, pp_size=4)
    assert [list(s.layers_on(r)) for r in range(4)] == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_uneven_first_last_stages_like_moonlight() -> None:
    # Moonlight: 27 layers over PP=2 as 13 + 14.
    s = PipelineSplit(num_layers=27, pp_size=2, first_stage_layers=13)
    assert (s.num_layers_on(0), s.num_layers_on(1)) == (13, 14)
    assert s.offset(1) == 13
    s = PipelineSplit(num_layers=7, pp_size=2, last_stage_layers=3)
    assert list(s.layers_on(0)) == [0, 1, 2, 3] and list(s.layers_on(1)) == [4, 5, 6]
    s = PipelineSplit(num_layers=10, pp_size=4, first_stage_layers=1, last_stage_layers=1)
    assert [list(s.layers_on(r)) for r in range(4)] == [[0], [1, 2, 3, 4], [5, 6, 7, 8], [9]]
    s = PipelineSplit(num_layers=9, pp_size=3, first_stage_layers=3)
    assert [list(s.layers_on(r)) for r in range(3)] == [[0, 1, 2], [3, 4, 5], [6, 7, 8]]


def test_account_for_embedding_and_loss() -> None:
    s = PipelineSplit(num_layers=6, pp_size=4, account_for_embedding=True, account_for_loss=True)
    assert [list(s.layers_on(r)) for r in range(4)] == [[0], [1, 2], [3, 4], [5]]
    s = PipelineSplit(num_layers=7, pp_size=2, account_for_embedding=True)
    assert [list(s.layers_on(r)) for r in range(2)] == [[0, 1, 2], [3, 4, 5, 6]]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"num_layers": 7, "pp_size": 2}, "not divisible"),
        ({"num_layers": 7, "pp_size": 3, "first_stage_layers": 2}, "do not divide"),
        ({"num_layers": 4, "pp_size": 2, "first_stage_layers": 5}, "exceed"),
        ({"num_layers": 4, "pp_size": 1, "first_stage_layers": 2}, "pipeline size > 1"),
        ({"num_layers": 4, "pp_size": 2, "first_stage_layers": 1, "account_for_loss": True}, "cannot be combined"),
        ({"num_layers": 5, "pp_size": 2, "first_stage_layers": 2, "last_stage_layers": 2}, "no middle stage"),
    ],
)
def test_bad_splits_raise(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        PipelineSplit(**kwargs)


def test_dense_layers_skipped_by_global_number() -> None:
    # 7 layers, layer 0 dense (DeepSeek style), PP=2 as 4 + 3: stage 0 holds MoE layers 1..3 (MoE idx 0..2).
    moe = [False, True, True, True, True, True, True]
    s = PipelineSplit(num_layers=7, pp_size=2, first_stage_layers=4)
    assert moe_indices_on_stage(s, 0, moe) == [0, 1, 2]
    assert moe_indices_on_stage(s, 1, moe) == [3, 4, 5]
    # Dense layer in the middle of stage 1.
    moe2 = [True, True, True, True, False, True, True]
    assert moe_indices_on_stage(s, 1, moe2) == [4, 5]
    with pytest.raises(ValueError, match="moe_layers has 3 entries"):
        moe_indices_on_stage(s, 0, [True] * 3)


def test_cp_positions_chunk_and_mirror() -> None:
    t = TokenSplit(cp_size=2, cp_rank=0)
    assert t.cp_positions(8).tolist() == [0, 1, 6, 7]
    assert TokenSplit(cp_size=2, cp_rank=1).cp_positions(8).tolist() == [2, 3, 4, 5]
    # Every position lands on exactly one rank.
    all_pos = np.concatenate([TokenSplit(cp_size=4, cp_rank=r).cp_positions(16) for r in range(4)])
    assert sorted(all_pos.tolist()) == list(range(16))
    with pytest.raises(ValueError, match="divisible by 2\\*cp"):
        t.cp_positions(6)


def test_sp_takes_contiguous_slice_after_cp() -> None:
    t = TokenSplit(cp_size=2, cp_rank=1, tp_size=2, tp_rank=1, sequence_parallel=True)
    # cp rank 1 of 8 -> [2,3,4,5]; tp rank 1 of 2 -> [4,5]
    assert t.positions(8).tolist() == [4, 5]
    assert t.multiple == 8 and t.padded_length(9) == 16
    # Without SP every TP rank sees the whole (CP-local) sequence.
    assert TokenSplit(tp_size=2, tp_rank=1).positions(5).tolist() == [0, 1, 2, 3, 4]


def test_dummy_experts_distinct_and_spread() -> None:
    d = dummy_experts(10, 3, 8)
    assert all(len(set(row)) == 3 for row in d.tolist())
    counts = np.bincount(d.ravel(), minlength=8)
    assert counts.max() - counts.min() <= 1
    with pytest.raises(ValueError, match="top_k 9 exceeds"):
        dummy_experts(1, 9, 8)


def _routes(rng: np.random.Generator, t_run: int, layers: int, k: int, e: int) -> np.ndarray:
    return np.stack([np.stack([rng.permutation(e)[:k] for _ in range(layers)]) for _ in range(t_run)]).astype(np.uint8)


def test_replay_indices_sequence_major_and_masks_unrun_positions() -> None:
    rng = np.random.default_rng(0)
    layers, k, e, seq = 4, 2, 8, 6
    r0 = _routes(rng, 5, layers, k, e)  # sample 0: 6 tokens, 5 ran
    r1 = _routes(rng, 2, layers, k, e)  # sample 1: 3 tokens, 2 ran, padded to 6
    plan = replay_indices([r0, r1], seq_len=seq, positions=np.arange(seq), moe_indices=[1, 3],
                          num_moe_layers=layers, top_k=k, num_experts=e, lengths=[6, 3])  # fmt: skip
    assert plan.indices.shape == (2, seq * 2, k) and plan.indices.dtype == np.int64
    # Row s*B + b.
    assert plan.indices[0, 3 * 2 + 0].tolist() == r0[3, 1].tolist()
    assert plan.indices[1, 1 * 2 + 1].tolist() == r1[1, 3].tolist()
    replayed = plan.replayed.reshape(seq, 2)
    assert replayed[:, 0].tolist() == [True] * 5 + [False]
    assert replayed[:, 1].tolist() == [True, True] + [False] * 4
    # Unreplayed rows hold distinct valid experts.
    for row in plan.indices[0][~plan.replayed]:
        assert len(set(row.tolist())) == k and row.max() < e
    layers_list = plan.per_layer()
    assert len(layers_list) == 2 and layers_list[0].flags["C_CONTIGUOUS"]


def test_replay_and_scatter_roundtrip_over_cp_and_sp_ranks() -> None:
    rng = np.random.default_rng(1)
    layers, k, e, batch = 3, 2, 6, 2
    ts = [TokenSplit(cp_size=2, cp_rank=c, tp_size=2, tp_rank=t, sequence_parallel=True)
          for c in range(2) for t in range(2)]  # fmt: skip
    seq = ts[0].padded_length(13)
    assert seq == 16
    routes = [_routes(rng, seq, layers, k, e), _routes(rng, seq, layers, k, e)]
    full = np.full((batch, seq, layers, k), -1, dtype=np.int64)
    for t in ts:
        pos = t.positions(seq)
        plan = replay_indices(routes, seq_len=seq, positions=pos, moe_indices=[0, 1, 2], num_moe_layers=layers,
                              top_k=k, num_experts=e)  # fmt: skip
        assert plan.indices.shape[1] == seq // 4 * batch
        scatter_recorded(plan.per_layer(), batch=batch, positions=pos, moe_indices=[0, 1, 2], full=full)
    assert (full == np.stack(routes).astype(np.int64)).all()


def test_replay_indices_rejects_bad_routes() -> None:
    good = np.zeros((3, 2, 2), dtype=np.uint8)
    good[:, :, 1] = 1
    kw = dict(seq_len=4, positions=np.arange(4), moe_indices=[0, 1], num_moe_layers=2, top_k=2, num_experts=4)
    with pytest.raises(ValueError, match="sample 1 have shape"):
        replay_indices([good, np.zeros((3, 3, 2), np.uint8)], **kw)
    bad = good.copy()
    bad[0, 0, 0] = 7
    with pytest.raises(ValueError, match="sample 0 hold experts outside"):
        replay_indices([bad], **kw)
    with pytest.raises(ValueError, match="cover 5 positions"):
        replay_indices([np.zeros((5, 2, 2), np.uint8)], **kw)
    with pytest.raises(ValueError, match="integer dtype"):
        replay_indices([good.astype(np.float32)], **kw)
    with pytest.raises(ValueError, match="MoE layer index 2"):
        replay_indices([good], **{**kw, "moe_indices": [2]})
    # None routes: all rows unreplayed.
    plan = replay_indices([None], **kw)
    assert not plan.replayed.any()
