"""A reader's lease on a GPU-held version, renewed while its copy runs.

The learner refills no slot a reader holds a live lease on (:mod:`.publisher`), and a lease is short
(``weights.reader.gpu_lease_ttl_s``): a reader killed mid-copy holds a slot no longer than that. But a copy may start
late: a vLLM worker runs it at its engine's next step boundary, and a step can take seconds (the first steps of a
batch size compile their kernels). So the lease is renewed every third of its TTL while the copy is under way, for
``weights.reader.gpu_lease_max_s`` at most in all: a live reader holds a slot only as long as its copy can still
be kept. :attr:`HeldLease.until` is when the lease last renewed ends; a copy that read the learner's buffers after
it is discarded by the caller (:class:`~async_rl.weights.reader.LeaseOutlasted`).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from async_rl.weights.reader import take_lease


class HeldLease:
    """One reader's lease on one version (module docstring); times are ``time.monotonic()``."""

    taken_at: float
    """When the lease was asked for (0: not taken)."""
    until: float
    """When the lease ends as last taken or renewed (counted from when it was asked for: never later than Redis's)."""

    def __init__(self, redis: aioredis.Redis, manifest_key: str, readers_key: str, reader_id: str, ttl_s: float,
                 max_s: float) -> None:  # fmt: skip
        self._redis, self._keys, self._reader_id = redis, (manifest_key, readers_key), reader_id
        self.ttl_s, self.max_s = ttl_s, max_s
        self.taken_at = self.until = 0.0

    async def _take(self) -> bool:
        sent = time.monotonic()
        if not await take_lease(self._redis, *self._keys, self._reader_id, self.ttl_s):
            return False
        self.until = sent + self.ttl_s
        return True

    async def take(self) -> bool:
        """Take the lease; False when the version is gone."""
        self.taken_at = time.monotonic()
        return await self._take()

    @contextlib.asynccontextmanager
    async def renewed(self) -> AsyncIterator[HeldLease]:
        """Renew the lease in the background while the body runs (for :attr:`max_s` from :meth:`take` at most)."""
        task = asyncio.create_task(self._renew(), name="gpu-lease-renewal")
        try:
            yield self
        finally:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def _renew(self) -> None:
        """Stops at the cap, when the version is gone, or when Redis does not answer (the lease then runs out and
        the caller discards a copy that ends after it)."""
        while True:
            await asyncio.sleep(self.ttl_s / 3)
            if time.monotonic() + self.ttl_s > self.taken_at + self.max_s:
                return
            try:
                if not await self._take():
                    return
            except (RedisError, OSError, TimeoutError):
                return
