"""Killing a publishing process in the middle of a version: the shared step of the kill-mid-publish tests."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time

import redis.asyncio as aioredis

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet


async def kill_mid_version(script: str, servers: ServerSet, names: Names, redis_client: aioredis.Redis,
                           lines: tuple[bytes, ...], version: int = 1, bucket: int = 3) -> int:  # fmt: skip
    """Run ``script`` (``python -c``, argv: the Redis URL and the run prefix); once it has printed ``lines`` in
    order and bucket ``bucket`` of ``version`` is written (the version is going out), SIGKILL it. Returns its
    exit code."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, servers.redis_url, names.prefix, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        for line in lines:
            assert (await asyncio.wait_for(proc.stdout.readline(), 120)).strip() == line
        deadline = time.monotonic() + 60
        while await redis_client.exists(names.weights_bucket(version, bucket)) == 0:
            assert time.monotonic() < deadline and proc.returncode is None, f"v{version} never started going out"
            await asyncio.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        return await asyncio.wait_for(proc.wait(), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
