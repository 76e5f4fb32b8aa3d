"""Evaluation across learner SIGKILLs: a learner evaluating every 3 versions is killed at random points of its step
three times; afterwards every committed step still has one metrics row, no evaluation round is reported twice, the
training audit is training's alone, and the evaluation audit accounts for every evaluation prompt.

Two threads stand in for generators (as in test_learner_kills.py): one answers training prompts with valid groups,
one answers evaluation prompts through the evaluation queue with reward 1."""

from __future__ import annotations

import asyncio
import random
import signal
import threading
import time

import pytest
import redis
import redis.asyncio as aioredis

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from buffer.audit import audit_run
from buffer.evals import ROUND_KEY, EvalQueue, EvalResult
from buffer.prompts import PromptQueueConfig
from tests.integration.killing import answer_prompts
from tests.integration.procs import Procs
from tests.integration.test_learner_kills import BATCH

pytestmark = pytest.mark.slow

NUM_KILLS = 3
MAX_STEPS = 24
EVAL_EVERY = 3
EVAL_PROMPTS = 4


def _evaluate(url: str, names: Names, stop: threading.Event, errors: list[BaseException]) -> None:
    async def answer() -> None:
        client = aioredis.Redis.from_url(url)
        queue = EvalQueue(client, names, PromptQueueConfig(reclaim_idle_ms=1000))
        try:
            while not stop.is_set():
                entries = await queue.read("evaluator", 16)
                if not entries:
                    await asyncio.sleep(0.05)
                    continue
                for e in entries:
                    meta = e.spec.metadata
                    await queue.finish(e, EvalResult(
                        prompt_id=e.spec.prompt_id, round=int(meta[ROUND_KEY]), label=str(meta["task"]),
                        rewards=[1.0], info={"exact": [1.0]}, min_version=e.spec.min_version,
                        max_version=e.spec.min_version, generator_id="evaluator"))  # fmt: skip
        finally:
            await client.aclose()

    try:
        asyncio.run(answer())
    except BaseException as exc:  # reported by the test
        errors.append(exc)


def test_evaluation_rounds_survive_learner_kills_once_each(procs: Procs, servers: ServerSet, names: Names) -> None:
    args = (f"batch_groups={BATCH}", "sampling.n=2", f"max_steps={MAX_STEPS}", f"eval.interval_versions={EVAL_EVERY}",
            f"eval.num_prompts={EVAL_PROMPTS}")  # fmt: skip
    r = redis.Redis.from_url(servers.redis_url)

    def committed() -> int:
        return int(r.hget(names.learner_state, "step") or 0)

    stop, errors = threading.Event(), []
    threads = [threading.Thread(target=answer_prompts, args=(servers.redis_url, names, stop, errors, BATCH),
                                name="fake-generator"),
               threading.Thread(target=_evaluate, args=(servers.redis_url, names, stop, errors), name="evaluator")]  # fmt: skip
    for t in threads:
        t.start()
    rng = random.Random(7)
    try:
        procs.learner(*args, name="learner-0")
        for k in range(NUM_KILLS):
            start = committed()
            procs.wait_for(f"learner-{k}'s next steps", lambda s=start: committed() > s + 1, timeout_s=240)
            time.sleep(rng.uniform(0, 0.5))
            procs.stop(f"learner-{k}", signal.SIGKILL)
            procs.learner(*args, name=f"learner-{k + 1}")
        last = procs.procs[f"learner-{NUM_KILLS}"]
        procs.wait_for("the last learner to finish", lambda: last.poll() is not None, timeout_s=240)
        assert last.returncode == 0, procs.tails()
    finally:
        stop.set()
        for t in threads:
            t.join(30)
    assert not errors, errors

    rows = procs.metrics()
    assert [row["step"] for row in rows] == list(range(1, MAX_STEPS + 1))  # one row per committed step, as ever
    rounds = [int(row["eval/copy/version"]) for row in rows if "eval/copy/version" in row]
    assert len(rounds) >= 3 and rounds == sorted(set(rounds)), rounds  # never a round twice
    # One round per interval of versions. Not always at a multiple: a learner killed between a publish and the
    # checkpoint covering it resumes past the versions it lost, and its round is then due at the first version after.
    assert len({v // EVAL_EVERY for v in rounds}) == len(rounds), rounds
    assert all(row["eval/copy/reward"] == 1.0 for row in rows if "eval/copy/reward" in row)

    async def audits() -> tuple[dict, dict]:
        client = aioredis.Redis.from_url(servers.redis_url)
        try:
            return await audit_run(client, names), await EvalQueue(client, names).counters()
        finally:
            await client.aclose()

    training, evaluation = asyncio.run(audits())
    c = training["counters"]
    assert training["ok"] and c["trained"] == MAX_STEPS * BATCH, training  # evaluation prompts are not in it
    assert evaluation["issued"] == evaluation["evaluated"] + evaluation["dead_lettered"] + evaluation["in_flight"]
    assert evaluation["dead_lettered"] == 0 and evaluation["evaluated"] >= len(rounds) * EVAL_PROMPTS, evaluation
    assert r.xlen(names.eval_results_stream) == evaluation["evaluated"]  # each prompt answered once
    print(f"\nrounds reported {rounds}; evaluation prompts {evaluation}")
    r.close()
