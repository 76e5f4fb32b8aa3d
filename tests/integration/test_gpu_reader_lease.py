"""A GPU-held version copied elsewhere (a vLLM worker's copy, ``GpuReader.fetch(copy=...)``) against its lease, on
the host: the lease has to last until the learner's buffers were read, not through what the copier does with its
copy afterwards. On the node (issue 39) each vLLM worker's first version of a slot took 2.1-2.4 s in the worker,
~1 s of it preparing views after the bytes were in, against a 2 s lease: every generator's first version was thrown
away as outlasted and copied again. And the copy may start late (the worker runs it at the engine's next step
boundary; a GPU test waited 4.4 s behind steps compiling their kernels): the lease is renewed while the copy is
under way, up to ``gpu_lease_max_s``. Real Redis; the manifest is a real GPU manifest (GPU slots filled on the CPU
device); the copier stands where the worker's RPC is and reports what the worker reports."""

from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis
import torch

from async_rl.run.names import Names
from async_rl.weights.config import ReaderConfig
from async_rl.weights.gpu.reader import GpuReader, RemoteCopied
from async_rl.weights.manifest import Manifest
from async_rl.weights.reader import CorruptVersion, LeaseOutlasted
from async_rl.weights.snapshot import Piece
from tests.gpu_manifest import gpu_manifest

TTL_S = 1.0
"""The reader's lease here (2 s by default): every copier below stays clear of it by half a second or more."""
MAX_S = 1.5
"""How long the lease may be renewed here (10 s by default)."""


def _config() -> ReaderConfig:
    return ReaderConfig(gpu_lease_ttl_s=TTL_S, gpu_lease_max_s=MAX_S)


async def _publish(redis: aioredis.Redis, names: Names, version: int) -> Manifest:
    """A GPU version's manifest under ``names``, as the learner's publisher commits it."""
    g = torch.Generator().manual_seed(version)
    m = gpu_manifest(version, [Piece("embed.weight", torch.randn(50, 16, generator=g)),
                               Piece("norm.weight", torch.randn(16, generator=g))])  # fmt: skip
    await redis.set(names.weights_gpu_manifest(version), m.encode(None))
    return m


async def test_a_copier_that_prepares_past_the_lease_after_reading_keeps_its_version(redis_client: aioredis.Redis,
                                                                                      names: Names) -> None:  # fmt: skip
    m = await _publish(redis_client, names, 3)

    async def copier(manifest: Manifest) -> RemoteCopied:
        copied_at = time.monotonic()  # the bytes are in
        await asyncio.sleep(TTL_S + 0.5)  # views, checks and the load plan's binding: a first version of a slot
        return RemoteCopied([b.checksum for b in manifest.buckets], copied_at)

    fetched = await GpuReader(redis_client, names, None, _config()).fetch(3, copy=copier)
    assert fetched.version == 3 and fetched.tensors == {} and fetched.bytes_fetched == m.total_bytes
    assert await redis_client.zcard(names.weights_gpu_readers(3)) == 0  # the lease is given back


async def test_a_copier_that_starts_late_keeps_its_version_and_its_lease_meanwhile(redis_client: aioredis.Redis,
                                                                                      names: Names) -> None:  # fmt: skip
    await _publish(redis_client, names, 7)
    readers = names.weights_gpu_readers(7)
    live: list[bool] = []

    async def copier(manifest: Manifest) -> RemoteCopied:
        await asyncio.sleep(TTL_S + 0.3)  # waiting for the engine's step boundary, past the lease's TTL
        [(_, score)] = await redis_client.zrange(readers, 0, -1, withscores=True)
        sec, usec = await redis_client.time()
        live.append(score > sec * 1000 + usec // 1000)  # the learner sees a live lease: it refills no slot of it
        return RemoteCopied([b.checksum for b in manifest.buckets], time.monotonic())

    fetched = await GpuReader(redis_client, names, None, ReaderConfig(gpu_lease_ttl_s=TTL_S)).fetch(7, copy=copier)
    assert fetched.version == 7 and live == [True]
    assert await redis_client.zcard(readers) == 0


async def test_a_copier_that_reads_after_the_renewals_loses_its_version(redis_client: aioredis.Redis,
                                                                         names: Names) -> None:  # fmt: skip
    await _publish(redis_client, names, 4)

    async def copier(manifest: Manifest) -> RemoteCopied:
        await asyncio.sleep(MAX_S + 0.5)  # an engine that does not start the copy within gpu_lease_max_s
        return RemoteCopied([b.checksum for b in manifest.buckets], time.monotonic())

    with pytest.raises(LeaseOutlasted, match=r"after its lease was taken, past the lease \(gpu_lease_ttl_s=1.0, "
                                             r"renewed for gpu_lease_max_s=1.5"):  # fmt: skip
        await GpuReader(redis_client, names, None, _config()).fetch(4, copy=copier)
    assert await redis_client.zcard(names.weights_gpu_readers(4)) == 0


async def test_a_copier_reporting_other_bytes_is_refused(redis_client: aioredis.Redis, names: Names) -> None:
    await _publish(redis_client, names, 5)

    async def copier(manifest: Manifest) -> RemoteCopied:
        return RemoteCopied([b.checksum ^ 1 for b in manifest.buckets], time.monotonic())

    with pytest.raises(CorruptVersion, match="bucket 0: wsum64"):
        await GpuReader(redis_client, names, None, _config()).fetch(5, copy=copier)


async def test_a_time_from_another_clock_counts_as_now(redis_client: aioredis.Redis, names: Names) -> None:
    await _publish(redis_client, names, 6)

    async def copier(manifest: Manifest) -> RemoteCopied:
        await asyncio.sleep(MAX_S + 0.5)
        return RemoteCopied([b.checksum for b in manifest.buckets], 0.0)  # before the lease: not this host's clock

    with pytest.raises(LeaseOutlasted):
        await GpuReader(redis_client, names, None, _config()).fetch(6, copy=copier)
