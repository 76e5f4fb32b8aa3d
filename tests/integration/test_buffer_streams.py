"""Prompt queue and rollout buffer against a real Redis: delivery, recovery, dead letters, back-pressure."""

from __future__ import annotations

import asyncio
import signal
import sys
import time

import numpy as np
import pytest

from actors.commands.bench.buffer import make_group
from async_rl.wire import PromptSpec, WireError, decode_group, encode_group
from buffer.dead_letters import DeadLetters
from buffer.prompts import PromptQueue, PromptQueueConfig
from buffer.rollout_writer import (
    LEARNER_HOLD_FIELD,
    BackpressureTimeout,
    RolloutWriter,
    RolloutWriterConfig,
)
from buffer.rollouts import RolloutReader, RolloutReaderConfig
from buffer.stats import buffer_stats


def _specs(n: int, start: int = 0) -> list[PromptSpec]:
    return [PromptSpec(f"p{i}", np.arange(i % 7 + 1, dtype=np.int32), {"answer": i}) for i in range(start, start + n)]


def _group(i: int, version: int = 0, seed: int = 0):
    return make_group(
        group_id=f"g{i}",
        prompt_tokens=5,
        response_tokens=9,
        num_samples=2,
        moe_layers=3,
        top_k=2,
        version=version,
        seed=seed + i,
    )


async def test_prompt_admission_issue_read_ack(redis_client, names):
    q = PromptQueue(redis_client, names)
    assert await q.capacity(max_staleness=1, batch_groups=3) == 6
    ids = await q.issue(_specs(4), version=7)
    assert len(ids) == 4
    assert await q.capacity(1, 3) == 2
    entries = await q.read("gen-a", count=10)
    assert [e.spec.prompt_id for e in entries] == ["p0", "p1", "p2", "p3"]
    assert all(e.issued_version == 7 and not e.reclaimed for e in entries)
    assert entries[2].spec.metadata == {"answer": 2}
    np.testing.assert_array_equal(entries[3].spec.prompt_ids, np.arange(4, dtype=np.int32))
    assert await q.ack(entries) == 4
    assert await redis_client.xlen(names.prompts_stream) == 0  # acked entries are deleted
    assert await q.capacity(1, 3) == 2  # acked prompts are still in flight until their groups finish
    assert await q.capacity(1, 3, held=3) == 5  # groups the learner holds no longer need room
    assert await q.audit.finish("trained", [("p0", "step 1"), ("p1", "step 1"), ("p1", "step 1")]) == 2
    assert await q.capacity(1, 3) == 4  # each finished once
    with pytest.raises(ValueError, match="already in flight"):
        await q.issue(_specs(1, start=2), version=7)
    assert await q.read("gen-a", count=10) == []
    with pytest.raises(ValueError, match="batch_groups"):
        await q.capacity(1, 0)


async def test_prompt_dead_generator_is_reclaimed(redis_client, names):
    q = PromptQueue(redis_client, names, PromptQueueConfig(reclaim_idle_ms=1000))
    await q.issue(_specs(3), version=0)
    taken = await q.read("gen-dead", count=2)
    assert len(taken) == 2
    # gen-dead stops without acking. Before the idle bound, another generator sees only the new entry.
    other = await q.read("gen-b", count=5)
    assert [e.spec.prompt_id for e in other] == ["p2"]
    await asyncio.sleep(1.2)
    back = await q.read("gen-b", count=5)
    assert sorted(e.spec.prompt_id for e in back) == ["p0", "p1"]
    assert all(e.reclaimed for e in back)
    await q.ack(back + other)
    assert await redis_client.xlen(names.prompts_stream) == 0
    pending = await redis_client.xpending(names.prompts_stream, names.prompts_group)
    assert pending["pending"] == 0


async def test_prompt_release_is_reclaimed_at_once(redis_client, names):
    q = PromptQueue(redis_client, names, PromptQueueConfig(reclaim_idle_ms=60_000))
    await q.issue(_specs(2), version=0)
    taken = await q.read("gen-stopping", count=2)
    assert await q.release(taken) == 2
    back = await q.read("gen-c", count=5)
    assert sorted(e.spec.prompt_id for e in back) == ["p0", "p1"]


async def test_prompt_poison_and_malformed_go_to_dead_letters(redis_client, names):
    q = PromptQueue(redis_client, names, PromptQueueConfig(reclaim_idle_ms=1, max_deliveries=2))
    await redis_client.xadd(names.prompts_stream, {b"spec": b"\x93garbage", b"ver": b"0"})
    await q.issue(_specs(1), version=0)
    got = await q.read("g1", count=5)
    assert [e.spec.prompt_id for e in got] == ["p0"]  # the garbage entry was set aside
    for consumer in ("g2", "g3"):  # two more deliveries of p0 via reclaim; the third exceeds max_deliveries
        await asyncio.sleep(0.01)
        got = await q.read(consumer, count=5)
    assert got == []
    letters = await DeadLetters(redis_client, names).read()
    reasons = sorted(d.reason for d in letters)
    assert len(letters) == 2
    assert "delivered 3 times" in reasons[0]
    assert "msgpack" in reasons[1] or "malformed" in reasons[1]
    stats = await buffer_stats(redis_client, names)
    assert stats["prompts"]["dead_letters"] == 2


async def test_rollout_roundtrip_ack_and_counters(redis_client, names):
    w = RolloutWriter(redis_client, names)
    r = RolloutReader(redis_client, names)
    recs = [_group(i) for i in range(3)]
    ids = [await w.append(rec) for rec in recs]
    got = await r.read("learner", count=10)
    assert [e.entry_id for e in got] == ids
    for rec, e in zip(recs, got, strict=True):
        assert encode_group(e.record) == encode_group(rec)
    assert await r.ack(got[:2]) == 2
    stats = await buffer_stats(redis_client, names)
    assert stats["rollouts"]["appended"] == 3
    assert stats["rollouts"]["consumed"] == 2
    assert stats["rollouts"]["backlog"] == 1
    assert stats["rollouts"]["stream"]["pending"] == 1


@pytest.mark.parametrize("inline_max_bytes", [256 * 1024, 0], ids=["in-the-stream", "beside-the-stream"])
async def test_records_appended_together_arrive_in_order_and_a_bad_one_appends_none(redis_client, names,
                                                                                   inline_max_bytes):  # fmt: skip
    w = RolloutWriter(redis_client, names, RolloutWriterConfig(inline_max_bytes=inline_max_bytes))
    r = RolloutReader(redis_client, names)
    bad = _group(9)
    bad.group_id = ""
    with pytest.raises(WireError, match="group_id must not be empty"):
        await w.append_many([_group(7), bad])
    assert await redis_client.xlen(names.rollouts_stream) == 0
    recs = [_group(i) for i in range(4)]
    ids = await w.append_many(recs)
    got = await r.read("learner", count=10)
    assert [e.entry_id for e in got] == ids
    assert [encode_group(e.record) for e in got] == [encode_group(rec) for rec in recs]
    assert (await buffer_stats(redis_client, names))["rollouts"]["appended"] == 4
    assert await w.append_many([]) == []


async def test_rollout_killed_learner_loses_nothing(redis_client, names):
    # Four deliveries here (read, re-read, two take-overs): above the default delivery limit, tested on its own.
    w = RolloutWriter(redis_client, names)
    for i in range(4):
        await w.append(_group(i))
    first = RolloutReader(redis_client, names, RolloutReaderConfig(reclaim_idle_ms=1000, max_deliveries=10))
    held = await first.read("learner-0", count=3)
    assert len(held) == 3
    del first  # killed before acking
    # A restarted learner with the same consumer name gets its pending entries back at once.
    same = RolloutReader(redis_client, names, RolloutReaderConfig(reclaim_idle_ms=1000, max_deliveries=10))
    again = await same.read("learner-0", count=10)
    assert sorted(e.record.group_id for e in again) == ["g0", "g1", "g2", "g3"]
    # A different consumer takes over what learner-0 leaves idle, once idle long enough.
    other = RolloutReader(redis_client, names, RolloutReaderConfig(reclaim_idle_ms=1000, max_deliveries=10))
    assert await other.read("learner-1", count=10) == []
    await asyncio.sleep(1.2)
    taken = await other.read("learner-1", count=10)
    assert sorted(e.record.group_id for e in taken) == ["g0", "g1", "g2", "g3"]
    # Acked once, trained groups are skipped by id and counted when they come around again.
    assert await other.ack(taken[:2]) == 2
    await asyncio.sleep(1.2)
    third = RolloutReader(redis_client, names, RolloutReaderConfig(reclaim_idle_ms=1000, max_deliveries=10))
    dup = await third.read("learner-2", count=10, seen={"g2"})
    assert [e.record.group_id for e in dup] == ["g3"]
    stats = await buffer_stats(redis_client, names)
    assert stats["rollouts"]["duplicates"] == 1
    assert stats["rollouts"]["backlog"] == 1


async def test_rollout_reader_does_not_reclaim_its_own_in_flight(redis_client, names):
    w = RolloutWriter(redis_client, names)
    await w.append(_group(0))
    r = RolloutReader(redis_client, names, RolloutReaderConfig(reclaim_idle_ms=1))
    assert len(await r.read("learner", count=1)) == 1
    await asyncio.sleep(0.01)
    assert await r.read("learner", count=1) == []  # still held (a long step), not returned twice
    assert len(r.in_flight) == 1


async def test_rollout_malformed_entries_to_dead_letters(redis_client, names):
    w = RolloutWriter(redis_client, names)
    r = RolloutReader(redis_client, names)
    good = _group(1)
    await w.append(_group(0))
    data = bytearray(encode_group(good))
    await w.append_encoded(bytes(data[:-10]), generator_id="gen-7", group_id="g-trunc")
    await redis_client.xadd(names.rollouts_stream, {b"gen": b"gen-8", b"other": b"x"})
    await w.append(good)
    got = await r.read("learner", count=10)
    assert [e.record.group_id for e in got] == ["g0", "g1"]
    letters = await DeadLetters(redis_client, names).read(newest_first=False)
    assert [d.generator for d in letters] == ["gen-7", "gen-8"]
    assert letters[0].group_id == "g-trunc" and letters[0].source_stream == names.rollouts_stream
    assert letters[0].payload == bytes(data[:-10])
    assert "no 'rec' field" in letters[1].reason
    stats = await buffer_stats(redis_client, names)
    assert stats["rollouts"]["dead_letters"] == 2
    assert stats["rollouts"]["backlog"] == 2


async def test_rollout_backpressure_blocks_and_resumes(redis_client, names):
    w = RolloutWriter(redis_client, names, RolloutWriterConfig(max_backlog=2, backpressure_timeout_s=10))
    r = RolloutReader(redis_client, names)
    await w.append(_group(0))
    await w.append(_group(1))
    blocked = asyncio.create_task(w.append(_group(2)), name="blocked-append")
    await asyncio.sleep(0.3)
    assert not blocked.done()
    assert await redis_client.xlen(names.rollouts_stream) == 2  # nothing trimmed, nothing added
    got = await r.read("learner", count=1)
    await asyncio.sleep(0.2)
    assert not blocked.done()  # read but not acked: still in the backlog
    t0 = time.monotonic()
    await r.ack(got)
    await asyncio.wait_for(blocked, timeout=5)
    assert time.monotonic() - t0 < 4.0  # woken by the ack, not by a timer
    assert await redis_client.xlen(names.rollouts_stream) == 2


async def test_rollout_backpressure_times_out(redis_client, names):
    w = RolloutWriter(redis_client, names, RolloutWriterConfig(max_backlog=1, backpressure_timeout_s=0.3))
    await w.append(_group(0))
    with pytest.raises(BackpressureTimeout, match="max_backlog 1"):
        await w.append(_group(1))
    assert await redis_client.xlen(names.rollouts_stream) == 1


async def test_the_learners_hold_counts_on_top_of_the_backlog_bound(redis_client, names):
    # The learner acks at checkpoints: 3 x 4 groups stay in the stream, read but unacked. A bound of 2 counts on top
    # of them: 14 groups go in, the 15th waits for an ack (a bound below the hold would wait for acks forever).
    await redis_client.hset(names.learner_state, mapping={LEARNER_HOLD_FIELD: 12})
    w = RolloutWriter(redis_client, names, RolloutWriterConfig(max_backlog=2, backpressure_timeout_s=60))
    for i in range(14):
        await asyncio.wait_for(w.append(_group(i)), timeout=5)
    blocked = asyncio.create_task(w.append(_group(14)), name="blocked-append")
    await asyncio.sleep(0.3)
    assert not blocked.done() and await redis_client.xlen(names.rollouts_stream) == 14
    r = RolloutReader(redis_client, names)
    await r.ack(await r.read("learner", count=1))
    await asyncio.wait_for(blocked, timeout=5)
    assert await redis_client.xlen(names.rollouts_stream) == 14


async def test_decoded_record_is_zero_copy(redis_client, names):
    w = RolloutWriter(redis_client, names)
    await w.append(_group(0))
    (e,) = await RolloutReader(redis_client, names).read("learner", count=1)
    routes = e.record.samples[0].routes
    assert routes is not None and not routes.flags.writeable and not routes.flags.owndata
    assert decode_group(encode_group(e.record)).group_id == "g0"


async def test_large_records_travel_beside_the_stream(redis_client, names):
    w = RolloutWriter(redis_client, names, RolloutWriterConfig(inline_max_bytes=0))
    r = RolloutReader(redis_client, names)
    recs = [_group(i) for i in range(3)]
    for rec in recs:
        await w.append(rec)
    payload_keys = [k async for k in redis_client.scan_iter(match=names.rollout_payload("*"))]
    assert len(payload_keys) == 3
    await redis_client.delete(payload_keys[0])  # a lost payload must not be lost silently
    got = await r.read("learner", count=10)
    assert len(got) == 2
    for e in got:
        assert encode_group(e.record) == encode_group(recs[int(e.record.group_id[1:])])
    (letter,) = await DeadLetters(redis_client, names).read()
    assert "is gone" in letter.reason and letter.generator == "bench"
    await r.ack(got[:1])
    # Acked by id through another reader (a restarted learner): the record key still goes.
    assert await RolloutReader(redis_client, names).ack([got[1].entry_id]) == 1
    assert [k async for k in redis_client.scan_iter(match=names.rollout_payload("*"))] == []
    assert await redis_client.xlen(names.rollouts_stream) == 0


async def test_generator_killed_with_sigkill_loses_no_prompt(redis_client, names, servers):
    """A real process reads prompts and dies by SIGKILL; a survivor reclaims every one of them."""
    q = PromptQueue(redis_client, names, PromptQueueConfig(reclaim_idle_ms=200))
    await q.issue(_specs(5), version=0)
    script = (
        "import asyncio, os, signal, redis.asyncio as r\n"
        "from async_rl.run.names import Names\n"
        "from buffer.prompts import PromptQueue\n"
        "async def main():\n"
        f"    q = PromptQueue(r.Redis.from_url({servers.redis_url!r}), Names(prefix={names.prefix!r}))\n"
        "    got = await q.read('doomed', count=3)\n"
        "    assert len(got) == 3, got\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "asyncio.run(main())\n"
    )
    proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script)
    assert await asyncio.wait_for(proc.wait(), timeout=60) == -signal.SIGKILL
    first = await q.read("survivor", count=10)
    await asyncio.sleep(0.3)
    second = await q.read("survivor", count=10)
    got = first + second
    assert sorted(e.spec.prompt_id for e in got) == ["p0", "p1", "p2", "p3", "p4"]
    assert sorted(e.spec.prompt_id for e in got if e.reclaimed) == ["p0", "p1", "p2"]
    await q.ack(got)
    assert (await redis_client.xpending(names.prompts_stream, names.prompts_group))["pending"] == 0


async def test_stats_of_an_empty_run_and_client_checks(redis_client, names, servers):
    stats = await buffer_stats(redis_client, names)
    assert stats["prompts"]["in_flight"] == 0 and stats["rollouts"]["backlog"] == 0
    assert stats["rollouts"]["stream"]["consumers"] == [] and stats["dead_letters"]["length"] == 0
    import redis.asyncio as aioredis

    text_client = aioredis.Redis.from_url(servers.redis_url, decode_responses=True)
    try:
        with pytest.raises(ValueError, match="decode_responses=False"):
            RolloutReader(text_client, names)
    finally:
        await text_client.aclose()
    with pytest.raises(ValueError, match="redis.asyncio.Redis"):
        PromptQueue(object(), names)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="buffer.rollouts.max_backlog must be >= 1"):
        RolloutWriterConfig(max_backlog=0)


async def test_prompt_touch_keeps_a_live_generators_prompts(redis_client, names):
    q = PromptQueue(redis_client, names, PromptQueueConfig(reclaim_idle_ms=1000))
    other = PromptQueue(redis_client, names, PromptQueueConfig(reclaim_idle_ms=1000))
    await q.issue(_specs(1), version=0)
    held = await q.read("gen-slow", count=1)
    await asyncio.sleep(0.7)
    assert await q.touch("gen-slow", held) == 1
    await asyncio.sleep(0.5)  # 1.2 s since the read, 0.5 s since the touch
    assert await other.read("gen-b", count=1) == []
    await asyncio.sleep(0.7)  # now idle 1.2 s since the touch: abandoned
    assert [e.spec.prompt_id for e in await other.read("gen-b", count=1)] == ["p0"]


async def test_dead_letters_give_their_admission_slots_back(redis_client, names):
    """A poison prompt and a malformed rollout will never be consumed: admission must not wait for them."""
    q = PromptQueue(redis_client, names, PromptQueueConfig(reclaim_idle_ms=1, max_deliveries=1))
    await q.issue(_specs(2), version=0)
    assert await q.capacity(max_staleness=0, batch_groups=2) == 0
    first = await q.read("g1", count=1)  # p0 delivered once ...
    await asyncio.sleep(0.01)
    assert [e.spec.prompt_id for e in await q.read("g2", count=1)] != [first[0].spec.prompt_id]  # ... then poisoned
    assert await q.capacity(0, 2) == 1
    w, r = RolloutWriter(redis_client, names), RolloutReader(redis_client, names)
    await w.append_encoded(b"\x93garbage", generator_id="gen-1", group_id="p1")  # p1's group arrives malformed
    assert await r.read("learner", count=5) == []
    assert await q.capacity(0, 2) == 2
