"""Staleness policy over real rollout entries: what it drops is acked and counted, never lost silently."""

from __future__ import annotations

import numpy as np
import pytest

from actors.commands.bench.buffer import make_group
from async_rl.config.configurable import ConfigError, from_dict
from async_rl.wire import PromptSpec
from buffer.prompts import PromptQueue
from buffer.rollout_writer import RolloutWriter
from buffer.rollouts import RolloutReader
from buffer.staleness import StalenessConfig, StalenessPolicy, token_staleness
from buffer.stats import buffer_stats


def _group(i: int, version: int):
    # make_group gives the first third of each sample version - 1: min_version = version - 1 (or 0).
    rec = make_group(
        group_id=f"g{i}", prompt_tokens=3, response_tokens=6, num_samples=2, moe_layers=2, top_k=2, version=version
    )
    rec.prompt_id = f"p-g{i}"
    return rec


async def test_drop_mode_acks_and_counts_stale_groups(redis_client, names):
    writer, reader = RolloutWriter(redis_client, names), RolloutReader(redis_client, names)
    prompts = PromptQueue(redis_client, names)
    # make_group's prompt ids are "p-<group id>": issue them so the drops and the commit give them fates.
    await prompts.issue([PromptSpec(f"p-g{i}", np.arange(3, dtype=np.int32)) for i in range(5)], version=0)
    # min versions 9, 7, 5, 3, 1 (version - 1); learner at 10 with S = 4 keeps min_version >= 6.
    for i, v in enumerate([10, 8, 6, 4, 2]):
        await writer.append(_group(i, v))
    entries = await reader.read("learner", count=10)
    sel = StalenessPolicy(StalenessConfig(max_staleness=4, mode="drop")).select(entries, learner_version=10)
    assert [e.record.group_id for e in sel.keep] == ["g0", "g1"]
    assert [e.record.group_id for e in sel.drop] == ["g2", "g3", "g4"]
    assert sel.metrics["num_dropped_stale"] == 3 and sel.metrics["num_over_bound"] == 3
    assert sel.metrics["staleness_max"] == 9 and sel.metrics["staleness_mean"] == pytest.approx(5.0)
    assert await reader.ack_dropped(sel.drop) == 3
    assert await prompts.in_flight() == 2  # the drops finished their prompts in the same transaction
    await reader.ack(sel.keep)
    stats = await buffer_stats(redis_client, names)
    assert stats["rollouts"]["dropped_stale"] == 3
    assert stats["rollouts"]["consumed"] == 2
    assert stats["rollouts"]["backlog"] == 0
    assert stats["audit"] == {"issued": 5, "trained": 2, "dropped_stale": 3, "dead_lettered": 0, "in_flight": 0}


async def test_keep_mode_keeps_all_and_counts_over_bound(redis_client, names):
    writer, reader = RolloutWriter(redis_client, names), RolloutReader(redis_client, names)
    for i, v in enumerate([10, 3, 1]):
        await writer.append(_group(i, v))
    entries = await reader.read("learner", count=10)
    sel = StalenessPolicy(StalenessConfig(max_staleness=2, mode="keep")).select(entries, learner_version=10)
    assert len(sel.keep) == 3 and sel.drop == []
    assert sel.metrics["num_over_bound"] == 2
    await reader.count("kept_stale", int(sel.metrics["num_over_bound"]))
    await reader.ack(sel.keep)
    stats = await buffer_stats(redis_client, names)
    assert stats["rollouts"]["kept_stale"] == 2 and stats["rollouts"]["dropped_stale"] == 0


def test_boundary_and_token_staleness():
    rec = _group(0, 5)  # min_version 4
    policy = StalenessPolicy(StalenessConfig(max_staleness=1))

    class E:
        record = rec

    assert len(policy.select([E()], learner_version=5).keep) == 1  # staleness 1 == S: kept
    assert len(policy.select([E()], learner_version=6).drop) == 1  # staleness 2 > S: dropped
    hist = token_staleness([rec], learner_version=6)
    assert hist.shape == (12,) and set(np.unique(hist)) == {1, 2}
    with pytest.raises(ValueError, match="learner_version"):
        policy.select([], learner_version=-1)


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="buffer.staleness.max_staleness must be >= 0"):
        StalenessConfig(max_staleness=-1)
    with pytest.raises(ConfigError, match="mode must be one of"):
        from_dict(StalenessConfig, {"mode": "sometimes"})


def test_synchronous_mode_needs_a_zero_bound() -> None:
    assert StalenessConfig(max_staleness=0, sync=True).sync
    with pytest.raises(ValueError, match="staleness.sync needs staleness.max_staleness=0, got 2"):
        StalenessConfig(max_staleness=2, sync=True)
