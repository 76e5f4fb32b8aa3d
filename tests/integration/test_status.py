"""``async-rl status`` against a real run's Redis and NATS state."""

from __future__ import annotations

import asyncio
import json
import os

import numpy as np

from actors.commands.status import main as status_main
from async_rl.run.lease import LeaseConfig, RunLease
from async_rl.run.names import Names
from async_rl.servers.control import ControlPlane, Heartbeat
from async_rl.servers.embedded import ServerSet
from async_rl.wire import PromptSpec
from buffer.prompts import PromptQueue


async def test_status_reports_generators_streams_and_learner(servers: ServerSet, names: Names, redis_client, capsys):
    await PromptQueue(redis_client, names).issue([PromptSpec("p0", np.arange(3, dtype=np.int32))], version=0)
    await redis_client.hset(names.learner_state, mapping={"version": 7, "step": 7})
    lease = RunLease(servers.redis_url, names, LeaseConfig(), run_dir="runs/x")
    await asyncio.to_thread(lease.take)
    plane = await ControlPlane(servers.nats_url, name="test").connect()

    async def beat() -> None:
        for _ in range(40):
            await plane.publish(names.heartbeat_subject, Heartbeat(generator_id="gen-a", engine="torch", version=6))
            await asyncio.sleep(0.1)

    argv = ["--prefix", names.prefix, "--redis-url", servers.redis_url, "--nats-url", servers.nats_url,
            "--listen-s", "1.0", "--json"]  # fmt: skip
    beating = asyncio.create_task(beat())
    code = await asyncio.to_thread(status_main, argv)
    beating.cancel()
    await plane.close()
    assert code == 0
    snap = json.loads(capsys.readouterr().out)
    assert snap["learner"]["version"] == "7"
    assert snap["lease"]["pid"] == os.getpid() and snap["lease"]["token"] == "1" and snap["lease"]["expires_in_s"] > 0
    assert snap["buffer"]["prompts"]["in_flight"] == 1
    [gen] = snap["generators"]
    assert gen["id"] == "gen-a" and gen["version"] == 6 and gen["alive"]


def test_status_needs_a_redis_url(capsys) -> None:
    import pytest

    with pytest.raises(SystemExit):
        status_main(["--prefix", "x"])
    assert "redis-url" in capsys.readouterr().err
