"""A run that ends, ends everywhere: real learner and generator processes against real Redis and NATS.

The learner reaches ``max_steps``, exits 0 and announces the end (NATS and a Redis record); a generator of the run
drains and exits 0, one started with ``on_run_end=wait`` keeps waiting and serves a successor learner of the same
prefix, and a generator started after the end reads the record and exits 0 at once.
"""

from __future__ import annotations

import asyncio
import signal
import time

import pytest
import redis.asyncio as aioredis

from async_rl.run.end import read_run_end
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from tests.integration.procs import Procs

pytestmark = pytest.mark.slow


def _recorded_end(servers: ServerSet, names: Names):  # type: ignore[no-untyped-def]
    async def read():  # type: ignore[no-untyped-def]
        client = aioredis.Redis.from_url(servers.redis_url)
        try:
            return await read_run_end(client, names)
        finally:
            await client.aclose()

    return asyncio.run(read())


def _exited(procs: Procs, name: str) -> bool:
    return procs.procs[name].poll() is not None


def test_a_finished_run_ends_its_generators(procs: Procs, servers: ServerSet, names: Names) -> None:
    procs.learner("max_steps=3")
    procs.generator("gen-exit")
    procs.generator("gen-wait", "on_run_end=wait")
    procs.wait_for("the learner to finish 3 steps", lambda: _exited(procs, "learner"), timeout_s=300)
    assert procs.procs["learner"].returncode == 0, procs.tails()
    assert "ended (max_steps) at step 3" in procs.log("learner")
    ended = _recorded_end(servers, names)
    assert ended is not None and (ended.step, ended.version, ended.reason) == (3, 3, "max_steps")

    t_end = time.monotonic()
    procs.wait_for("gen-exit to leave", lambda: _exited(procs, "gen-exit"), timeout_s=60)
    assert procs.procs["gen-exit"].returncode == 0, procs.tails()
    left_s = time.monotonic() - t_end
    assert f"run '{names.prefix}' ended at step 3, version 3 (max_steps); draining and exiting" in procs.log("gen-exit")
    assert "generator gen-exit exited" in procs.log("gen-exit")

    # Started after the end: the Redis record stops it before it builds anything.
    procs.generator("gen-late")
    procs.wait_for("gen-late to leave", lambda: _exited(procs, "gen-late"), timeout_s=60)
    assert procs.procs["gen-late"].returncode == 0, procs.tails()
    assert "stopped before the first weights arrived (the run has ended)" in procs.log("gen-late")

    # on_run_end=wait: still there, and a successor learner (resuming the run to 5 steps) is served by it alone.
    assert not _exited(procs, "gen-wait"), procs.tails()
    assert "waiting for a successor learner (on_run_end=wait)" in procs.log("gen-wait")
    procs.learner("max_steps=5", name="learner-2")
    procs.wait_for("the successor to finish", lambda: _exited(procs, "learner-2"), timeout_s=300)
    assert procs.procs["learner-2"].returncode == 0, procs.tails()
    assert "resumed from checkpoint: step 3" in procs.log("learner-2")
    ended = _recorded_end(servers, names)
    assert ended is not None and ended.step == 5
    assert f"run '{names.prefix}' ended at step 5" in procs.log("gen-wait")
    assert not _exited(procs, "gen-wait"), procs.tails()
    assert procs.stop("gen-wait", signal.SIGTERM) == 0, procs.tails()
    print(f"gen-exit left {left_s:.1f}s after the learner exited")
