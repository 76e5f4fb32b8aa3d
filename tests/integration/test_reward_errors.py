"""A reward that raises (issue 37): with real learner and generator processes, a ``KeyError`` on
``metadata["answr"]`` costs its groups (dead-lettered with the error, their prompts' fate recorded), is logged once
with its traceback, and the generator goes on while the learner trains on the other groups; a generator on which
every sample fails exits 1 after ``max_failed_groups`` groups with one line naming ``task.reward``."""

from __future__ import annotations

import asyncio
import os
import sys
from pathlib import Path

import pytest
import redis

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from buffer.audit import Audit
from buffer.dead_letters import DeadLetters
from tests.integration.procs import Procs

REWARD = '''\
import os


def score(text, metadata):
    if os.environ.get("REWARD_BROKEN") or metadata["index"] % 2:  # odd prompts, or all of them
        return float(text == metadata["answr"])
    return float(text == metadata["target"])
'''
RAISES_AT = "flaky.py:6"
REASON = f"task.reward='flaky:score' raised KeyError at {RAISES_AT}"


@pytest.fixture
def reward_module(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    (tmp_path / "mod").mkdir()
    (tmp_path / "mod" / "flaky.py").write_text(REWARD)
    paths = [str(tmp_path / "mod"), *sys.path]  # the children import it (and this tree) from PYTHONPATH
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([paths[0], os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    return "task.reward=flaky:score"


def test_a_raising_reward_costs_its_groups_not_the_generator(procs: Procs, servers: ServerSet, names: Names,
                                                              reward_module: str,
                                                              monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    procs.learner(reward_module, "max_steps=100")
    procs.generator("gen-ok", reward_module)
    monkeypatch.setenv("REWARD_BROKEN", "1")  # every sample of this one fails
    procs.generator("gen-broken", reward_module, "max_failed_groups=3", "torch.max_batch_prompts=2")
    monkeypatch.delenv("REWARD_BROKEN")

    broken = procs.procs["gen-broken"]
    procs.wait_for("gen-broken to give up", lambda: broken.poll() is not None, timeout_s=240)
    assert broken.returncode == 1, procs.tails()
    lines = procs.log("gen-broken").strip().splitlines()
    assert lines[-1] == (f"async-rl generator: gen-broken: every sample of the last 3 groups failed to score: {REASON}: "
                         "KeyError: 'answr' (fix task.reward; the groups are in the dead letters, and "
                         "max_failed_groups=3 sets this limit); exiting"), lines[-1]  # fmt: skip
    assert procs.log("gen-broken").count("Traceback") == 1  # the first error of its reason, once

    procs.wait_for("2 learner steps", lambda: len(procs.metrics()) >= 2, timeout_s=240)
    assert procs.procs["gen-ok"].poll() is None, procs.tails()  # half its groups failed; it goes on
    assert procs.stop("gen-ok") == 0
    procs.stop("learner")
    log = procs.log("gen-ok")
    assert log.count("Traceback") == 1 and log.count(f"scoring raised on 1 sample(s): {REASON}: KeyError") == 1, log
    assert "File \"" in log and RAISES_AT.split(":")[0] in log  # the traceback names the user's file

    async def letters_and_counters() -> tuple[list, dict[str, int]]:
        import redis.asyncio as aioredis

        client = aioredis.Redis.from_url(servers.redis_url)
        try:
            return await DeadLetters(client, names).read(1000), await Audit(client, names).counters()
        finally:
            await client.aclose()

    letters, counters = asyncio.run(letters_and_counters())
    ours = [d for d in letters if d.generator in ("gen-ok", "gen-broken")]
    assert {d.generator for d in ours} == {"gen-ok", "gen-broken"}, letters
    for d in ours:  # the whole group (8 samples), the error, the prompt as it was issued
        assert d.reason == f"scoring failed on 8 of 8 samples: {REASON}" and d.error == "KeyError: 'answr'", d
        assert d.source_stream == names.prompts_stream and d.payload is not None and d.group_id
    assert counters["dead_lettered"] == len(ours) >= 4  # three from gen-broken, at least one from gen-ok
    r = redis.Redis.from_url(servers.redis_url)
    assert int(r.hget(names.prompt_counters, "dead_letters") or 0) == len(ours)
    assert counters["trained"] >= 16  # two steps of 8 groups, all from even prompts
