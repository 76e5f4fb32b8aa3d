"""A relay in its own process for tests: pulls every bucket of a version over ``peer://``, says so per bucket, serves.

Usage: ``python -m tests.integration.peer_relay_proc REDIS_URL PREFIX VERSION URL``. Prints ``have <i>`` after
each bucket it holds, then ``done``, then serves until killed (or stdin closes).
"""

from __future__ import annotations

import asyncio
import sys

from async_rl.run.names import Names
from async_rl.weights.transport import TransportConfig, make_transport


async def main(redis_url: str, prefix: str, version: int, url: str) -> None:
    import msgpack
    import redis.asyncio as aioredis

    names = Names(prefix=prefix)
    r = aioredis.Redis.from_url(redis_url)
    raw = await r.get(names.weights_manifest(version))
    assert raw is not None, "the test writes the manifest first"
    num_buckets = len(msgpack.unpackb(raw)["buckets"])
    transport = make_transport(TransportConfig(url=url, timeout_s=30), redis_url, names)
    for i in range(num_buckets):
        await transport.get(version, i)
        print(f"have {i}", flush=True)
    print("done", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)  # serve until the test lets go
    await transport.close()
    await r.aclose()


if __name__ == "__main__":
    asyncio.run(main(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4]))
