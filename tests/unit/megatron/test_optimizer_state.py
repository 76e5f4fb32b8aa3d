"""The distributed optimizer's resume checks on the CPU (no megatron-core import): a rank's shards against its own
parameters, refused with the reason, and checked without touching the optimizer's state (a resumed learner's first
step failed with KeyError 'exp_avg' on the GPU when it did)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from actors.learner.megatron.optimizer_state import check_shards


def _sub():  # type: ignore[no-untyped-def]
    """The parts of megatron's DistributedOptimizer the check reads: its parameter map and inner torch optimizer."""
    model = [torch.nn.Parameter(torch.zeros(4, 3)), torch.nn.Parameter(torch.zeros(5))]
    mains = [torch.zeros(12), torch.zeros(5)]  # this rank's fp32 shards (the whole of each, one rank)
    inner = torch.optim.AdamW([{"params": [mains[0]]}, {"params": [mains[1]]}])
    return SimpleNamespace(model_param_group_index_map={model[0]: (0, 0), model[1]: (1, 0)}, optimizer=inner), model


def test_shards_of_this_rank_pass_and_leave_the_optimizer_state_untouched() -> None:
    sub, model = _sub()
    names = {id(model[0]): "w", id(model[1]): "b"}
    shards = [{"w": {"param": torch.ones(12), "exp_avg": torch.ones(12)}, "b": {"param": torch.ones(5)}}]
    check_shards([sub], shards, names, "rank0.pt")
    assert len(sub.optimizer.state) == 0  # megatron's load_state_dict allocates the moments only when it is empty


@pytest.mark.parametrize(
    ("shards", "match"),
    [
        ([{"w": {"param": torch.ones(12)}, "b": {"param": torch.ones(6)}}], "optimizer shard of b does not match"),
        ([{"w": {"param": torch.ones(12)}}], "name other parameters"),
        ([{"w": {"param": torch.ones(12)}, "b": {"exp_avg": torch.ones(5)}}], "optimizer shard of b does not match"),
        ([], "has 0 optimizer shard sets, this layout builds 1"),
    ],
)
def test_shards_of_another_layout_are_refused_with_the_reason(shards, match) -> None:  # type: ignore[no-untyped-def]
    sub, model = _sub()
    with pytest.raises(ValueError, match=match):
        check_shards([sub], shards, {id(model[0]): "w", id(model[1]): "b"}, "rank0.pt")
    assert len(sub.optimizer.state) == 0
