"""The rollout reader against poison pills, on a real Redis: every class is dead-lettered with its reason,
the valid entries around them come through, and no key outside the run is read or deleted."""

from __future__ import annotations

import numpy as np
import redis

from async_rl.wire import PromptSpec, encode_group
from buffer.audit import audit_run
from buffer.dead_letters import DeadLetters
from buffer.entry_checks import EntryChecker, ModelFacts
from buffer.prompts import PromptQueue
from buffer.rollout_writer import RolloutWriter, RolloutWriterConfig
from buffer.rollouts import RolloutReader, RolloutReaderConfig
from tests.integration.poison import fields_of, poison_entries, push, valid_record

FACTS = ModelFacts(vocab_size=22, max_seq_len=64, num_moe_layers=2, top_k=2, num_experts=4)


def _specs(n: int) -> list[PromptSpec]:
    return [PromptSpec(f"p{i}", np.arange(1, 4 + i % 3, dtype=np.int32) % 22) for i in range(n)]


async def test_every_poison_class_is_dead_lettered_and_nothing_outside_is_touched(redis_client, names, other,
                                                                                  servers):  # fmt: skip
    q = PromptQueue(redis_client, names)
    specs = _specs(60)
    await q.issue(specs, version=0)
    sync = redis.Redis.from_url(servers.redis_url)
    good = [valid_record(s.prompt_id, s.prompt_ids, FACTS, version=0, num_samples=2, seed=i)
            for i, s in enumerate(specs)]  # fmt: skip
    kinds = poison_entries(sync, names, good[0], FACTS, other=other, max_entry_bytes=400_000, published=3)
    assert len(kinds) >= 20
    writer = RolloutWriter(redis_client, names, RolloutWriterConfig(inline_max_bytes=300))  # some by key
    expected: dict[str, str] = {}
    valid_ids = []
    for i in range(len(kinds)):
        # Poison i is built around prompt i (its fate: dead_lettered), and a valid group follows it.
        p = poison_entries(sync, names, good[i], FACTS, other=other, max_entry_bytes=400_000, published=3)[i]
        expected[push(sync, names, p.fields)] = p.reason
        valid_ids.append(await writer.append(good[30 + i]))
    canary_before = sync.get(other.rollout_payload("ef" * 16))
    assert canary_before is not None
    reader = RolloutReader(redis_client, names, RolloutReaderConfig(max_entry_bytes=400_000),
                           checker=EntryChecker(FACTS, num_samples=2, max_version=3), check_issued=True)  # fmt: skip
    got = []
    for _ in range(5):
        got += await reader.read("learner", count=100)
    assert [e.entry_id for e in got] == valid_ids
    letters = {d.source_id: d for d in await DeadLetters(redis_client, names).read(count=1000)}
    assert set(letters) == set(expected), "every poison entry is dead-lettered, nothing else"
    for eid, reason in expected.items():
        assert reason in letters[eid].reason, (reason, letters[eid].reason)
        assert letters[eid].error.startswith(("async_rl.wire.WireError", "buffer.entry_checks.EntryError",
                                              "EntryError")), letters[eid].error  # fmt: skip
    # Nothing outside the run was read or deleted; the run's own wrong-type key went with its letter.
    assert sync.get(other.rollout_payload("ef" * 16)) == canary_before
    assert sync.lrange(other.key("canary-list"), 0, -1) == [b"keep me"]
    assert not sync.exists(names.rollout_payload("ab" * 16))
    # Fates: each poison closed its own prompt once (the never-issued one has none); the valid ones train.
    await reader.ack(got, fates=[(e.record.prompt_id, "step 1") for e in got])
    assert [k for k in sync.scan_iter(match=names.rollout_payload("*"))] == []
    report = await audit_run(redis_client, names)
    c = report["counters"]
    assert c["trained"] == len(kinds) and c["dead_lettered"] == len(kinds) - 1
    assert c["issued"] == 60 and c["in_flight"] == 60 - 2 * len(kinds) + 1
    assert report["balanced"] and report["fates_match_counters"]
    sync.close()


async def test_delivery_limit_dead_letters_with_the_last_error(redis_client, names):
    q = PromptQueue(redis_client, names)
    specs = _specs(2)
    await q.issue(specs, version=0)
    recs = [valid_record(s.prompt_id, s.prompt_ids, FACTS, version=0, num_samples=2, seed=i)
            for i, s in enumerate(specs)]  # fmt: skip
    w = RolloutWriter(redis_client, names)
    for rec in recs:
        await w.append(rec)
    cfg = RolloutReaderConfig(max_deliveries=3)
    checker = EntryChecker(FACTS, num_samples=2, max_version=0)
    first = RolloutReader(redis_client, names, cfg, checker=checker, check_issued=True)
    held = await first.read("learner", count=2)
    assert len(held) == 2
    # The backend fails on the batch (in process): given back with the error, delivered again at once.
    await first.retry(held, "IndexError: index out of range in self")
    again = await first.read("learner", count=2)
    assert sorted(e.record.group_id for e in again) == ["p0", "p1"]
    await first.record_error(again[:1], "RuntimeError: CUDA error: device-side assert triggered")
    # The learner dies twice holding them: restarted readers get them back (deliveries 3, then 4 > limit).
    third = await RolloutReader(redis_client, names, cfg, checker=checker, check_issued=True).read("learner", 2)
    assert len(third) == 2
    last = RolloutReader(redis_client, names, cfg, checker=checker, check_issued=True)
    assert await last.read("learner", count=2) == []
    letters = await DeadLetters(redis_client, names).read()
    by_group = {d.group_id: d for d in letters}
    assert "delivered 4 times" in by_group["p0"].reason and "device-side assert" in by_group["p0"].reason
    assert by_group["p0"].error == "RuntimeError: CUDA error: device-side assert triggered"
    assert "IndexError" in by_group["p1"].reason
    assert by_group["p0"].payload == encode_group(recs[0])
    counters = (await audit_run(redis_client, names))["counters"]
    assert counters["dead_lettered"] == 2 and counters["in_flight"] == 0
    assert not await redis_client.exists(names.rollout_errors)  # errors leave with their entries


async def test_dead_entry_without_an_error_names_the_dead_learner(redis_client, names):
    q = PromptQueue(redis_client, names)
    await q.issue(_specs(1), version=0)
    rec = valid_record("p0", _specs(1)[0].prompt_ids, FACTS, version=0, num_samples=2, seed=0)
    sync_fields = fields_of(encode_group(rec), "p0")
    await redis_client.xadd(names.rollouts_stream, sync_fields)
    cfg = RolloutReaderConfig(max_deliveries=1)
    assert len(await RolloutReader(redis_client, names, cfg).read("learner", count=1)) == 1
    assert await RolloutReader(redis_client, names, cfg).read("learner", count=1) == []
    (letter,) = await DeadLetters(redis_client, names).read()
    assert "delivered 2 times" in letter.reason and "died while holding it" in letter.reason
