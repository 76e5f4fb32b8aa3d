"""The audit of issued prompts on a real Redis: fates recorded once with their acks, ``async-rl audit`` and the
status totals, and a prompt lost outside the protocol is named."""

from __future__ import annotations

import asyncio

import numpy as np

from actors.commands.audit import main as audit_main
from actors.commands.status import render
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.wire import PromptSpec
from buffer.audit import Audit, AuditConfig
from buffer.entry_checks import ModelFacts
from buffer.prompts import PromptQueue
from buffer.rollout_writer import RolloutWriter
from buffer.rollouts import RolloutReader
from buffer.stats import buffer_stats
from tests.integration.poison import valid_record

FACTS = ModelFacts(vocab_size=22, max_seq_len=64, num_moe_layers=2, top_k=2, num_experts=4)


def _specs(n: int) -> list[PromptSpec]:
    return [PromptSpec(f"p{i}", np.array([1, 2, 3], dtype=np.int32)) for i in range(n)]


async def test_fates_counters_and_the_audit_command(redis_client, names: Names, servers: ServerSet, capsys):
    q = PromptQueue(redis_client, names)
    await q.issue(_specs(8), version=0)
    w, r = RolloutWriter(redis_client, names), RolloutReader(redis_client, names, check_issued=True)
    await q.ack(await q.read("gen-a", count=7))  # a generator answers p0..p6 (below); p7 waits
    for i in range(6):
        await w.append(valid_record(f"p{i}", np.array([1, 2, 3], dtype=np.int32), FACTS, version=0, num_samples=2,
                                    seed=i))  # fmt: skip
    await w.append_encoded(b"\x93garbage", generator_id="gen-x", group_id="p6")  # p6's group arrives broken
    got = await r.read("learner", count=10)
    assert [e.record.prompt_id for e in got] == [f"p{i}" for i in range(6)]
    await r.ack(got[:3], fates=[(e.record.prompt_id, "step 1") for e in got[:3]])
    await r.ack(got[:3], fates=[(e.record.prompt_id, "step 1") for e in got[:3]])  # a re-commit counts once
    await r.ack_dropped(got[3:5], fates=[("p3", "lag 5"), ("p4", "lag 6")])
    audit = Audit(redis_client, names)
    assert await audit.counters() == {"issued": 8, "trained": 3, "dropped_stale": 2, "dead_lettered": 1,
                                      "in_flight": 2}  # fmt: skip
    fates = [(f["pid"], f["fate"], f["detail"]) for f in await audit.fates()]
    assert fates[0][:2] == ("p6", "dead_lettered") and "group record" in fates[0][2]  # its reason
    assert fates[1:] == [("p0", "trained", "step 1"), ("p1", "trained", "step 1"), ("p2", "trained", "step 1"),
                         ("p3", "dropped_stale", "lag 5"), ("p4", "dropped_stale", "lag 6")]  # fmt: skip
    argv = ["--prefix", names.prefix, "--redis-url", servers.redis_url, "--fates", "2"]
    assert await asyncio.to_thread(audit_main, argv) == 0  # p5: held by the learner, p7: queued
    out = capsys.readouterr().out
    assert "issued 8 = trained 3 + dropped stale 2 + dead-lettered 1 + in flight 2" in out
    assert "1 in the prompt stream, 1 in the rollout stream, 0 in neither" in out and "p4: dropped_stale lag 6" in out
    # Status shows the same totals.
    stats = await buffer_stats(redis_client, names)
    from rich.console import Console

    console = Console(record=True, width=160)
    console.print(render({"prefix": names.prefix, "learner": {}, "weights": {"latest": None}, "generators": [],
                          "buffer": stats, "scaling": None}))  # fmt: skip
    text = console.export_text()
    assert "issued" in text and "│      8 │       3 │             2 │             1 │         2 │" in text
    # A prompt lost outside the protocol (its entry deleted by hand) is named, and the audit fails.
    (eid, _), = [(e, f) for e, f in await redis_client.xrange(names.prompts_stream)]
    await redis_client.xdel(names.prompts_stream, eid)
    assert await asyncio.to_thread(audit_main, argv + ["--json"]) == 1
    assert '"unaccounted": [\n    "p7"\n  ]' in capsys.readouterr().out


async def test_retention_trims_old_fates_but_not_the_totals(redis_client, names: Names):
    q = PromptQueue(redis_client, names)
    await q.issue(_specs(300), version=0)
    audit = Audit(redis_client, names, AuditConfig(max_fates=100))
    for i in range(0, 300, 50):
        assert await audit.finish("trained", [(f"p{j}", "step 1") for j in range(i, i + 50)]) == 50
    kept = await audit.fates()
    assert 100 <= len(kept) < 300 and kept[-1]["pid"] == "p299"  # approximate trimming keeps at least max_fates
    assert (await audit.counters())["trained"] == 300
    from buffer.audit import audit_run

    rep = await audit_run(redis_client, names)
    assert rep["ok"] and rep["fates_trimmed"] and rep["balanced"]


def test_audit_needs_a_redis_url(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit):
        audit_main(["--prefix", "x"])
    assert "redis-url" in capsys.readouterr().err

