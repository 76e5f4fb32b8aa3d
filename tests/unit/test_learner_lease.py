"""The learner's side of one learner per run that needs no server: which rank holds the lease, the lease's config,
and how a refused write is recognised wherever it surfaces (tests/integration/test_lease.py runs them on Redis)."""

from __future__ import annotations

import pytest
from redis.exceptions import ResponseError

from actors.learner.config import LearnerConfig
from actors.learner.main import _takes_lease
from async_rl.process.lifecycle import TaskFailed
from async_rl.run.lease import FENCED_MARK, Fence, LeaseConfig, LeaseLost, fenced, is_fenced


def test_rank_zero_holds_the_lease_and_the_other_ranks_never_touch_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    assert _takes_lease(LearnerConfig()) and _takes_lease(LearnerConfig(backend="megatron"))
    for rank, holds in (("0", True), ("1", False), ("7", False)):
        monkeypatch.setenv("RANK", rank)
        assert _takes_lease(LearnerConfig(backend="megatron")) is holds
        assert _takes_lease(LearnerConfig())  # the torch backend is one process, whatever a launcher sets


def test_the_lease_config_is_bounded_and_named() -> None:
    assert LeaseConfig().ttl_s == 10.0 and not LeaseConfig().wait
    with pytest.raises(ValueError, match="learner.lease.ttl_s must be >= 1"):
        LeaseConfig(ttl_s=0.5)


def test_fenced_calls_carry_the_fence_first_and_leave_unfenced_ones_alone() -> None:
    assert fenced(None, "return 1", ["k1", "k2"], ["a"]) == ("return 1", 2, "k1", "k2", "a")
    script, num_keys, *rest = fenced(Fence("p:learner:fence", "3:abc"), "return 1", ["k1"], ["a", "b"])
    assert script.endswith("return 1") and "HGET" in script and FENCED_MARK in script
    assert num_keys == 2 and rest == ["p:learner:fence", "k1", "3:abc", "a", "b"]


def test_a_refusal_is_recognised_inside_groups_causes_and_pipeline_errors() -> None:
    # redis-py prefixes an error inside a MULTI with the command's place; TaskGroups wrap it; tasks are named.
    refused = ResponseError(f"Command # 1 (EVAL ...) of pipeline caused error: {FENCED_MARK} learner token 1 is not")
    wrapped = TaskFailed("run lease", LeaseLost("another learner took run 'x'"))
    wrapped.__cause__ = LeaseLost("another learner took run 'x'")
    for exc in (refused, ExceptionGroup("g", [ValueError("x"), refused]), wrapped):
        assert is_fenced(exc)
    assert not is_fenced(ResponseError("WRONGTYPE Operation against a key holding the wrong kind of value"))
    assert not is_fenced(ExceptionGroup("g", [ValueError("x")]))
