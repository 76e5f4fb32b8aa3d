"""Publishing a weight version: buckets first, then the manifest, then visibility, then the announcement.

Protocol (keys from :class:`~async_rl.names.Names`):

1. ``weights:staging`` records the version and its bucket count, so a publisher that dies
   mid-way leaves nothing a later publisher cannot find and delete;
2. every bucket is written through the :class:`~async_rl.transport.BucketTransport`;
3. one Lua script writes the manifest, adds the version to ``weights:versions``, moves
   ``weights:latest`` forward and clears the staging entry: the version becomes visible all at
   once, or not at all;
4. a :class:`~async_rl.control.WeightsAnnounced` goes out on NATS (readers also poll ``latest``);
5. versions beyond the newest ``keep_versions`` are pruned: hidden at once (removed from
   ``versions``), deleted only when no reader holds a live lease on them (see :mod:`.reader`).

One publisher (the learner's rank 0) writes a run's weights at a time.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis
import torch

from async_rl.control import ControlPlane, WeightsAnnounced
from async_rl.names import Names
from async_rl.transport import BucketTransport
from async_rl.weights.config import PublisherConfig
from async_rl.weights.manifest import CHECKSUMS, BucketEntry, Manifest, default_checksum, pack_bucket, plan_buckets
from async_rl.weights.signing import run_secret

log = logging.getLogger(__name__)

# KEYS: manifest, versions, latest, staging; ARGV: manifest bytes, version.
_COMMIT_LUA = """
redis.call('SET', KEYS[1], ARGV[1])
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[2])
local cur = redis.call('GET', KEYS[3])
if (not cur) or tonumber(cur) < tonumber(ARGV[2]) then redis.call('SET', KEYS[3], ARGV[2]) end
redis.call('HDEL', KEYS[4], ARGV[2])
return 1
"""
# KEYS: manifest, readers, retiring; ARGV: version. Deletes the manifest only when no lease is live.
_RETIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) > 0 then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""


@dataclass(slots=True)
class PublishStats:
    """Timings of one publish."""

    version: int
    total_bytes: int
    num_buckets: int
    pack_s: float
    put_s: float
    total_s: float

    @property
    def gbps(self) -> float:
        return self.total_bytes / max(self.total_s, 1e-9) / 1e9


class WeightPublisher:
    """Writes versions of named tensors through a transport and makes them visible atomically."""

    redis: aioredis.Redis
    transport: BucketTransport
    names: Names
    cfg: PublisherConfig
    control: ControlPlane | None
    checksum: str
    hmac_key: bytes | None
    last_stats: PublishStats | None
    _cleaned: bool

    def __init__(
        self,
        redis: aioredis.Redis,
        transport: BucketTransport,
        names: Names,
        cfg: PublisherConfig | None = None,
        control: ControlPlane | None = None,
    ) -> None:
        self.redis = redis
        self.transport = transport
        self.names = names
        self.cfg = cfg or PublisherConfig()
        self.control = control
        self.checksum = self.cfg.checksum or default_checksum()
        self.hmac_key = run_secret(self.cfg.secret_file)  # None: manifests are not signed
        self.last_stats = None
        self._cleaned = False

    async def latest_version(self) -> int | None:
        raw = await self.redis.get(self.names.weights_latest)
        return None if raw is None else int(raw)

    async def clean_staging(self) -> list[int]:
        """Delete what earlier publishers left half-written (versions staged but never committed)."""
        staged = await self.redis.hgetall(self.names.weights_staging)
        removed = []
        for raw_version, raw_count in staged.items():
            version = int(raw_version)
            if await self.redis.zscore(self.names.weights_versions, version) is None:
                await self.transport.delete(version, int(raw_count))
                removed.append(version)
            await self.redis.hdel(self.names.weights_staging, raw_version)
        if removed:
            log.warning("deleted half-written weight versions %s left by an earlier publisher", removed)
        return removed

    async def publish(self, tensors: Mapping[str, torch.Tensor], version: int) -> Manifest:
        """Publish ``tensors`` as ``version`` (must be newer than the latest); returns its manifest."""
        if version < 0:
            raise ValueError(f"weights version must be >= 0, got {version}")
        if not tensors:
            raise ValueError("weights: nothing to publish (no tensors)")
        if not self._cleaned:
            await self.clean_staging()
            self._cleaned = True
        latest = await self.latest_version()
        if latest is not None and version <= latest:
            raise ValueError(f"weights version {version} is not newer than the latest published version {latest}")
        t0 = time.perf_counter()
        entries, sizes = plan_buckets(tensors, self.cfg.bucket_bytes)
        await self.redis.hset(self.names.weights_staging, str(version), str(len(sizes)))
        by_bucket: list[list] = [[] for _ in sizes]
        for e in entries:
            by_bucket[e.bucket].append(e)
        hasher = CHECKSUMS[self.checksum]
        # Two buffers of the largest bucket: bucket i+1 is packed and checksummed (in a worker thread; torch's
        # copy and xxhash release the GIL) while bucket i is on the wire.
        buffers = [bytearray(max(sizes)) for _ in range(min(2, len(sizes)))]
        pack_times: list[float] = []
        put_times: list[float] = []

        def pack(index: int) -> tuple[memoryview, int]:
            t1 = time.perf_counter()
            view = memoryview(buffers[index % 2])[: sizes[index]]
            pack_bucket(tensors, by_bucket[index], view)
            checksum = hasher(view)
            pack_times.append(time.perf_counter() - t1)
            return view, checksum

        async def put(index: int, view: memoryview) -> None:
            t1 = time.perf_counter()
            await self.transport.put(version, index, view)
            put_times.append(time.perf_counter() - t1)

        buckets: list[BucketEntry] = []
        packed = await asyncio.to_thread(pack, 0)
        for index, size in enumerate(sizes):
            view, checksum = packed
            buckets.append(BucketEntry(index, size, checksum))
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(put(index, view), name=f"weights-put-v{version}-b{index}")
                    if index + 1 < len(sizes):
                        next_pack = tg.create_task(
                            asyncio.to_thread(pack, index + 1), name=f"weights-pack-b{index + 1}"
                        )
            except BaseExceptionGroup as group:  # callers catch TransportError & co., not a group of them
                raise group.exceptions[0] from None
            if index + 1 < len(sizes):
                packed = next_pack.result()
        pack_s, put_s = sum(pack_times), sum(put_times)
        manifest = Manifest(
            version=version, tensors=entries, buckets=buckets, transport=self.transport.name, checksum=self.checksum
        )
        n = self.names
        await self.redis.eval(
            _COMMIT_LUA, 4, n.weights_manifest(version), n.weights_versions, n.weights_latest, n.weights_staging,
            manifest.encode(self.hmac_key), str(version),
        )  # fmt: skip
        total_s = time.perf_counter() - t0
        self.last_stats = PublishStats(version, manifest.total_bytes, len(sizes), pack_s, put_s, total_s)
        log.info(
            "published weights v%d: %d tensors, %d buckets, %.1f MB in %.2fs (%.2f GB/s)",
            version, len(entries), len(sizes), manifest.total_bytes / 1e6, total_s, self.last_stats.gbps,
        )  # fmt: skip
        if self.control is not None:
            await self.control.publish(
                n.weights_subject,
                WeightsAnnounced(
                    version=version,
                    manifest_key=n.weights_manifest(version),
                    total_bytes=manifest.total_bytes,
                    num_buckets=len(sizes),
                    transport=self.transport.name,
                ),
            )
        await self.prune()
        return manifest

    async def prune(self) -> list[int]:
        """Hide versions beyond the newest ``keep_versions``; delete hidden ones nobody is reading."""
        n = self.names
        versions = [int(v) for v in await self.redis.zrange(n.weights_versions, 0, -1)]  # type: ignore[arg-type]
        excess = versions[: max(0, len(versions) - self.cfg.keep_versions)]
        for version in excess:
            raw = await self.redis.get(n.weights_manifest(version))
            count = Manifest.decode(raw).num_buckets if raw is not None else 0
            async with self.redis.pipeline(transaction=True) as pipe:
                pipe.hset(n.weights_retiring, str(version), str(count))
                pipe.zrem(n.weights_versions, version)
                await pipe.execute()
        deleted = []
        for raw_version, raw_count in (await self.redis.hgetall(n.weights_retiring)).items():
            version = int(raw_version)
            ok = await self.redis.eval(
                _RETIRE_LUA, 3, n.weights_manifest(version), n.weights_readers(version), n.weights_retiring, version
            )
            if ok:
                # The manifest is gone, so no new lease can be taken: the buckets are safe to delete.
                await self.transport.delete(version, int(raw_count))
                await self.redis.hdel(n.weights_retiring, raw_version)
                deleted.append(version)
        if deleted:
            log.info("deleted weight versions %s", deleted)
        return deleted
