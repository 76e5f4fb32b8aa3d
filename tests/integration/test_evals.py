"""The evaluation queue and the learner's rounds on a real Redis: held-out prompts are accounted for in their own
audit, never in training's (admission room, fates, ``async-rl audit``), results are read once by cursor, and a
round is reported when complete."""

from __future__ import annotations

from actors.commands.status import render, snapshot
from actors.learner.checkpoint import LearnerState
from actors.learner.evaluation import EvalConfig, Evaluator
from async_rl.run.config import RunConfig
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.tasks import TaskConfig, build_task
from async_rl.wire.sampling import Sampling
from buffer.audit import audit_run
from buffer.evals import GREEDY_KEY, ROUND_KEY, EvalQueue, EvalResult
from buffer.prompts import PromptQueue, PromptQueueConfig


def _answer(task, entry) -> EvalResult:  # type: ignore[no-untyped-def]
    """What a generator sends for a perfect (or, for odd entries, empty) answer, scored by the task itself."""
    meta = entry.spec.metadata
    from async_rl.model import toy_tokenizer as tt

    good = int(entry.spec.prompt_id.split("-eval-")[1].split("@")[0]) % 2 == 0
    ids = [*tt.encode(meta["target"]), tt.EOS_ID] if good else [tt.EOS_ID]
    s = task.score(meta, ids)
    return EvalResult(prompt_id=entry.spec.prompt_id, round=meta[ROUND_KEY], label=meta["source"], rewards=[s.reward],
                      info={k: [v] for k, v in s.info.items()}, answers=[task.answer(meta, ids)], min_version=3,
                      max_version=3, generator_id="g")  # fmt: skip


async def test_rounds_are_accounted_apart_from_training(redis_client, names: Names, servers: ServerSet) -> None:
    task = build_task(TaskConfig(name="copy"))
    queue = EvalQueue(redis_client, names)
    state = LearnerState()
    ev = Evaluator(EvalConfig(interval_versions=4, num_prompts=4), task, queue, state, Sampling(n=8))
    training = PromptQueue(redis_client, names)
    room = await training.capacity(2, 8)
    assert await ev.maybe_issue(0) == 4 and await ev.maybe_issue(3) == 0  # the next round is due at version 4
    entries = await queue.read("g", 10)
    assert len(entries) == 4 and all(e.spec.min_version == 0 and e.spec.metadata[GREEDY_KEY] for e in entries)
    assert entries[0].spec.sampling == Sampling(n=1, max_new_tokens=task.max_new_tokens, temperature=1.0)
    assert entries[0].spec.prompt_id == "copy-0-eval-0@v0"
    # Never training's: admission room, the training audit and its stream are untouched.
    assert await training.capacity(2, 8) == room and await training.read("g", 10) == []
    report = await audit_run(redis_client, names)
    assert report["ok"] and report["counters"]["issued"] == 0
    assert (await queue.counters()) == {"issued": 4, "evaluated": 0, "dead_lettered": 0, "in_flight": 4}

    for e in entries[:3]:
        await queue.finish(e, _answer(task, e))
    assert await ev.collect() == {}  # 3 of 4: not complete
    await queue.finish(entries[3], _answer(task, entries[3]))
    got = await ev.collect()
    assert got == {"eval/copy/reward": 0.5, "eval/copy/exact": 0.5, "eval/copy/length_ok": 0.5,
                   "eval/copy/mean@1": 0.5, "eval/copy/pass@1": 0.5, "eval/copy/maj@1": 0.5,
                   "eval/copy/num_prompts": 4.0, "eval/copy/version": 0.0, "eval/copy/weights_version_min": 3.0,
                   "eval/copy/weights_version_max": 3.0}  # fmt: skip
    assert await ev.collect() == {}  # each result is read once (the cursor lives in the learner state)
    assert (await queue.counters())["evaluated"] == 4 and (await queue.counters())["in_flight"] == 0

    # A restarted learner from a checkpoint before round 4's issue re-issues only the prompts not open.
    assert await ev.maybe_issue(5) == 4
    restored = LearnerState(extra={"eval": {**state.extra["eval"], "next_round": 4}})
    again = Evaluator(EvalConfig(interval_versions=4, num_prompts=4), task, queue, restored, Sampling(n=8))
    assert await again.maybe_issue(5) == 0
    assert (await queue.counters())["issued"] == 8

    snap = await snapshot(RunConfig(prefix=names.prefix, redis_url=servers.redis_url), {}, 0.0)
    assert snap["eval"]["prompts"]["in_flight"] == 4
    render(snap)


async def test_a_dead_lettered_eval_prompt_is_counted_and_the_round_closes_with_the_next(redis_client,
                                                                                          names: Names) -> None:
    task = build_task(TaskConfig(name="copy"))
    queue = EvalQueue(redis_client, names, PromptQueueConfig(reclaim_idle_ms=1, max_deliveries=1))
    ev = Evaluator(EvalConfig(interval_versions=1, num_prompts=2), task, queue, LearnerState(), Sampling(n=4))
    await ev.maybe_issue(0)
    first = await queue.read("a", 10)
    await queue.finish(first[0], _answer(task, first[0]))
    await queue.read("b", 10)  # first[1] is reclaimed once ...
    assert await queue.read("c", 10) == []  # ... and dead-lettered on the next delivery
    assert (await queue.counters()) == {"issued": 2, "evaluated": 1, "dead_lettered": 1, "in_flight": 0}
    assert await ev.collect() == {}
    await ev.maybe_issue(1)
    for e in await queue.read("a", 10):
        await queue.finish(e, _answer(task, e))
    got = await ev.collect()
    assert got["eval/copy/version"] == 1.0 and got["eval/copy/num_prompts"] == 2.0
    assert ev._book["rounds"] == {}  # round 0 closed with round 1


async def test_a_round_reissued_after_a_restart_is_reported_once(redis_client, names: Names) -> None:
    """A learner killed after its round was answered but before a checkpoint read the results: the restarted one
    issues the round again (answered prompts are not open), so each prompt comes back twice; the round is still
    reported once, over its 4 prompts."""
    task = build_task(TaskConfig(name="copy"))
    queue = EvalQueue(redis_client, names)
    cfg = EvalConfig(interval_versions=4, num_prompts=4)
    ev = Evaluator(cfg, task, queue, LearnerState(), Sampling(n=8))
    checkpoint = LearnerState(extra={"eval": {"next_round": 0, "cursor": "0-0", "rounds": {}}})  # before round 0
    assert await ev.maybe_issue(0) == 4
    for e in await queue.read("g", 10):
        await queue.finish(e, _answer(task, e))
    want = await ev.collect()
    assert want["eval/copy/num_prompts"] == 4.0
    restarted = Evaluator(cfg, task, queue, checkpoint, Sampling(n=8))  # an older checkpoint's book (no "reported")
    assert await restarted.maybe_issue(0) == 4  # answered prompts are not open: issued again
    entries = await queue.read("g", 10)
    for e in entries[:2]:  # half the copies answered before the restarted learner first reads results
        await queue.finish(e, _answer(task, e))
    assert await restarted.collect() == want  # the first 4 results; the 2 copies counted nowhere
    for e in entries[2:]:
        await queue.finish(e, _answer(task, e))
    assert await restarted.collect() == {}  # a reported round takes no more results
    assert restarted._book["rounds"] == {}
