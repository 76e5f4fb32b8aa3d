"""The run's lease and its fencing token on a real Redis (async_rl/run/lease.py): one holder at a time, a second one
refused naming it or standing by, and every fenced write of an old token refused by Redis in the same atomic step,
leaving the run's keys as they were."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis
import torch
from redis.exceptions import ResponseError

from async_rl.run.end import announce_run_end
from async_rl.run.lease import FENCED_MARK, Fence, FencedOut, LeaseConfig, LeaseHeld, RunLease, fenced_hset, is_fenced
from async_rl.run.names import Names
from async_rl.servers.control import RunEnded
from async_rl.servers.embedded import ServerSet
from async_rl.weights import WeightPublisher
from async_rl.weights.redis_transport import RedisTransport
from async_rl.wire import PromptSpec
from buffer.audit import Audit
from buffer.entry_checks import ModelFacts
from buffer.prompts import PromptQueue
from buffer.rollout_writer import RolloutWriter
from buffer.rollouts import RolloutReader
from tests.integration.poison import valid_record

FACTS = ModelFacts(vocab_size=22, max_seq_len=64, num_moe_layers=2, top_k=2, num_experts=4)
TTL_S = 1.0
ROOT = Path(__file__).resolve().parents[2]


def _lease(servers: ServerSet, names: Names, *, wait: bool = False, run_dir: str = "runs/a") -> RunLease:
    return RunLease(servers.redis_url, names, LeaseConfig(ttl_s=TTL_S, wait=wait), run_dir=run_dir)


def _specs(n: int, start: int = 0) -> list[PromptSpec]:
    return [PromptSpec(f"p{i}", np.array([1, 2, 3], dtype=np.int32)) for i in range(start, start + n)]


def test_one_holder_a_second_is_refused_naming_it_and_a_standby_takes_over(servers: ServerSet, names: Names) -> None:
    a = _lease(servers, names)
    assert a.take() is None and a.fence is not None and a.token_number == "1"
    b = _lease(servers, names, run_dir="runs/b")
    t0 = time.monotonic()
    with pytest.raises(LeaseHeld) as refused:
        b.take()
    assert time.monotonic() - t0 < 1.0 and b.fence is None
    line = str(refused.value)
    assert "\n" not in line and f"run {names.prefix!r} already has a learner" in line
    assert f"pid {refused.value.holder.pid} on host" in line and "token 1" in line and "lease.wait=true" in line
    # A standby takes the run as soon as the holder releases it, with the next token.
    standby = _lease(servers, names, wait=True, run_dir="runs/b")
    released_at: list[float] = []

    def release_soon() -> None:
        time.sleep(0.3)
        released_at.append(time.monotonic())
        assert a.release()

    import threading

    t = threading.Thread(target=release_soon)
    t.start()
    waited_for = standby.take()
    t.join()
    assert waited_for is not None and waited_for.token == a.fence.token
    assert time.monotonic() - released_at[0] < TTL_S / 2 + 0.2  # polled every ttl/4 at most
    assert standby.token_number == "2" and not a.release()  # a's token is no longer anything


async def test_a_killed_holder_is_replaced_within_the_ttl_and_renewal_finds_it_out(servers: ServerSet,
                                                                                  names: Names) -> None:  # fmt: skip
    a = _lease(servers, names)
    a.take()
    # a "dies" (stops renewing): its lease expires after TTL_S, and a standby takes the run then, not before.
    standby = _lease(servers, names, wait=True)
    t0 = time.monotonic()
    await asyncio.to_thread(standby.take)
    took_s = time.monotonic() - t0
    assert 0.5 < took_s < TTL_S + 0.5, took_s
    # a wakes up: its first renewal learns another learner took the run, and says who.
    with pytest.raises(FencedOut) as lost:
        await a.keep()
    assert is_fenced(lost.value) and f"another learner took run {names.prefix!r}" in str(lost.value)
    assert "token 2" in str(lost.value)
    assert "another learner took run" in a.fenced_line()


async def test_an_expired_lease_nobody_took_is_renewed(servers: ServerSet, names: Names,
                                                       redis_client: aioredis.Redis) -> None:  # fmt: skip
    a = _lease(servers, names)
    a.take()
    await redis_client.delete(names.learner_lease)  # as if it expired during a long pause
    keeper = asyncio.create_task(a.keep())
    await asyncio.sleep(TTL_S / 3 + 0.3)
    assert not keeper.done()
    assert (await redis_client.hget(names.learner_lease, "token")).decode() == a.fence.token  # type: ignore[union-attr]
    keeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await keeper


def test_a_renewer_started_late_renews_on_the_lease_s_cadence_not_an_interval_later(servers: ServerSet, names: Names,
                                                                                     ) -> None:  # fmt: skip
    # The learner takes the lease, builds its backend (a renewing thread), then starts its loop (another): a hand-off
    # late in an interval must renew at once, or the lease lapses before the new renewer's first turn.
    # A TTL of 6 s (renewals every 2 s) leaves the new renewer 1.5 s before the lease lapses: a loaded machine's late
    # thread start fits in it, and a renewer on the old cadence (its first renewal 2 s after its start) does not.
    a = RunLease(servers.redis_url, names, LeaseConfig(ttl_s=6.0), run_dir="runs/a")
    a.take()
    time.sleep(4.5)  # past the first renewal's time (2 s), 1.5 s before the lease expires
    r = redis.Redis.from_url(servers.redis_url)
    with a.kept_alive():
        deadline = time.monotonic() + 1.4  # before the lapse, and well before the old cadence's 2 s
        while r.pttl(names.learner_lease) < 4000 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert r.pttl(names.learner_lease) >= 4000, "not renewed at once: the lease would have lapsed"
    r.close()
    a.release()


async def test_a_blocked_event_loop_keeps_the_lease(servers: ServerSet, names: Names) -> None:
    a = _lease(servers, names)
    a.take()
    keeper = asyncio.create_task(a.keep())
    await asyncio.sleep(0)  # the renewing thread starts
    time.sleep(3 * TTL_S)  # noqa: ASYNC251 (on purpose) the learner's event loop busy for three TTLs (a long checkpoint, a starved CPU)
    with pytest.raises(LeaseHeld):  # renewed all along from its own thread: a second learner still finds it held
        _lease(servers, names).take()
    assert not keeper.done()
    keeper.cancel()
    with pytest.raises(asyncio.CancelledError):
        await keeper
    a.release()


async def test_every_fenced_write_of_a_stale_token_is_refused(servers: ServerSet, names: Names,
                                                              redis_client: aioredis.Redis) -> None:  # fmt: skip
    old, new = _lease(servers, names), _lease(servers, names, wait=True)
    old.take()
    assert old.fence is not None
    stale = old.fence
    # The old learner issues and reads while it holds the run.
    q_old = PromptQueue(redis_client, names, fence=stale)
    await q_old.issue(_specs(4), version=0)
    writer = RolloutWriter(redis_client, names)
    await PromptQueue(redis_client, names).ack(await PromptQueue(redis_client, names).read("gen", count=4))
    for i in range(4):
        await writer.append(valid_record(f"p{i}", np.array([1, 2, 3], dtype=np.int32), FACTS, version=0,
                                         num_samples=2, seed=i))  # fmt: skip
    reader_old = RolloutReader(redis_client, names, check_issued=True, fence=stale)
    held = await reader_old.read("learner", count=4)
    assert len(held) == 4
    pub_old = WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names, fence=stale)
    await pub_old.publish({"w": torch.ones(4)}, 0)
    # Another learner takes the run (the old one's lease expired during a pause).
    await redis_client.delete(names.learner_lease)
    await asyncio.to_thread(new.take)
    assert new.fence is not None and new.fence.token != stale.token

    async def snapshot() -> dict[str, object]:
        r = redis.Redis.from_url(servers.redis_url)
        try:
            keys = sorted(r.scan_iter(match=names.all_key_pattern()))
            return {k.decode(): r.dump(k) for k in keys}
        finally:
            r.close()

    before = await snapshot()
    refusals = [
        q_old.issue(_specs(2, start=10), version=1),  # admission
        reader_old.ack(held[:2], fates=[("p0", "step 1"), ("p1", "step 1")]),  # the commit's acks and fates
        reader_old.ack_dropped(held[2:3], fates=[("p2", "lag 9")]),  # a stale drop
        reader_old.quarantine(held[3:], "refused by the backend"),  # a dead letter
        pub_old.publish({"w": torch.zeros(4)}, 1),  # a weight version (staging, then the commit)
        fenced_hset(redis_client, stale, names.learner_state, {"step": 99}),
        announce_run_end(redis_client, None, names, RunEnded(step=9, version=9, reason="max_steps"), fence=stale),
        Fence(names.learner_fence, stale.token).check(redis_client),
    ]
    for write in refusals:
        with pytest.raises((ResponseError, FencedOut)) as refused:
            await write
        assert is_fenced(refused.value) and FENCED_MARK in str(refused.value), refused.value
    assert await snapshot() == before  # nothing of the run changed: not a stream entry, fate, counter or version
    assert await redis_client.get(names.weights_latest) == b"0"
    assert (await Audit(redis_client, names).counters())["in_flight"] == 4
    # The holder's writes go through: it commits what the old one read (the entries are pending on the same consumer).
    reader_new = RolloutReader(redis_client, names, check_issued=True, fence=new.fence)
    assert await reader_new.ack([e.entry_id for e in held], fates=[(e.record.prompt_id, "step 1") for e in held]) == 4
    await PromptQueue(redis_client, names, fence=new.fence).issue(_specs(2, start=10), version=1)
    await WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names,
                          fence=new.fence).publish({"w": torch.zeros(4)}, 1)  # fmt: skip
    await PromptQueue(redis_client, names).ack(await PromptQueue(redis_client, names).read("gen", count=1))
    await writer.append(valid_record("p10", np.array([1, 2, 3], dtype=np.int32), FACTS, version=1, num_samples=2,
                                     seed=10))  # fmt: skip
    [entry] = await reader_new.read("learner", count=1)
    await reader_new.quarantine([entry], "refused by the backend")  # its dead letter, under the current token
    counters = await Audit(redis_client, names).counters()
    assert counters == {"issued": 6, "trained": 4, "dropped_stale": 0, "dead_lettered": 1, "in_flight": 1}
    assert await redis_client.get(names.weights_latest) == b"1"


def test_a_holder_killed_on_this_host_is_replaced_at_once(servers: ServerSet, names: Names) -> None:
    """Same machine and pid namespace: the holder's pid is looked at, so a restart after a kill -9 need not wait for
    the lease's time-to-live (10 s here); a live holder, or a pid reused by another process, is not taken for gone."""
    import os
    import signal
    import subprocess
    import sys

    script = ("import sys, time; from async_rl.run.lease import LeaseConfig, RunLease; from async_rl.run.names import "
              "Names; RunLease(sys.argv[1], Names(prefix=sys.argv[2]), LeaseConfig(ttl_s=10), run_dir='.').take(); "
              "print('held', flush=True); time.sleep(60)")  # fmt: skip
    proc = subprocess.Popen([sys.executable, "-c", script, servers.redis_url, names.prefix], stdout=subprocess.PIPE,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"held"
        with pytest.raises(LeaseHeld) as refused:  # alive: refused, naming it
            _lease(servers, names).take()
        holder = refused.value.holder
        assert holder.pid == proc.pid and not holder.gone_here() and holder.ttl_s > 8
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        t0 = time.monotonic()
        restarted = _lease(servers, names)
        assert restarted.take() is None and restarted.token_number == "2"
        assert time.monotonic() - t0 < 1.0
    finally:
        proc.kill()
        proc.wait()
    # A pid that runs another process than the one that took the lease is gone too; this process is not.
    import dataclasses

    from async_rl.run.lease import process_start

    me = dataclasses.replace(holder, pid=os.getpid(), pid_start=process_start(os.getpid()))
    assert not me.gone_here() and dataclasses.replace(me, pid_start="1").gone_here()
    assert not dataclasses.replace(me, pid_start="1", node="another-machine/1").gone_here()
