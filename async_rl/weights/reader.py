"""Reading a weight version: lease, manifest, buckets (prefetched), checksums, zero-copy tensor views.

A reader takes a lease on the version before it reads the manifest (one Lua script that
refuses when the manifest is gone) and keeps it fresh while it reads; the publisher deletes a
pruned version only when no lease is live. So a slow reader is never cut off mid-version, and
a crashed one holds nothing longer than ``lease_ttl_s``.
"""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
import warnings
from dataclasses import dataclass

import redis.asyncio as aioredis
import torch

from async_rl.names import Names
from async_rl.transport import BucketCorrupt, BucketMissing, BucketTransport
from async_rl.weights.config import ReaderConfig
from async_rl.weights.manifest import Manifest, ManifestError, view_tensor
from async_rl.weights.signing import run_secret

log = logging.getLogger(__name__)

# KEYS: manifest, readers; ARGV: reader id, ttl ms. 0 when the version is gone (pruned or never complete).
_LEASE_LUA = """
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZADD', KEYS[2], now + tonumber(ARGV[2]), ARGV[1])
local top = redis.call('ZRANGE', KEYS[2], -1, -1, 'WITHSCORES')
redis.call('PEXPIREAT', KEYS[2], top[2])
return 1
"""


class WeightsError(RuntimeError):
    """A weight version could not be read; the reader's caller keeps its current weights."""


class VersionUnavailable(WeightsError):
    """The version is not (or no longer) complete and visible."""


class CorruptVersion(WeightsError):
    """A bucket's bytes do not match the manifest (size or checksum), or the manifest is malformed."""


@dataclass(slots=True)
class FetchedVersion:
    """A complete, verified version: tensors are views of the fetched bucket buffers."""

    version: int
    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    transfer_s: float
    """Time waiting for verified bucket bytes (checksums are computed by the transport while it receives)."""
    total_s: float

    @property
    def gbps(self) -> float:
        return self.manifest.total_bytes / max(self.total_s, 1e-9) / 1e9


class WeightReader:
    """Fetches and verifies weight versions published by :class:`~async_rl.weights.WeightPublisher`."""

    redis: aioredis.Redis
    transport: BucketTransport
    names: Names
    cfg: ReaderConfig
    reader_id: str
    hmac_key: bytes | None

    def __init__(
        self,
        redis: aioredis.Redis,
        transport: BucketTransport,
        names: Names,
        cfg: ReaderConfig | None = None,
        reader_id: str | None = None,
    ) -> None:
        self.redis = redis
        self.transport = transport
        self.names = names
        self.cfg = cfg or ReaderConfig()
        self.reader_id = reader_id or uuid.uuid4().hex
        self.hmac_key = run_secret(self.cfg.secret_file)  # with a secret, only signed manifests that check

    async def latest_version(self) -> int | None:
        """The newest complete version, or None before the first publish."""
        raw = await self.redis.get(self.names.weights_latest)
        return None if raw is None else int(raw)

    async def _lease(self, version: int) -> bool:
        ttl_ms = int(self.cfg.lease_ttl_s * 1000)
        keys = (self.names.weights_manifest(version), self.names.weights_readers(version))
        return bool(await self.redis.eval(_LEASE_LUA, 2, *keys, self.reader_id, ttl_ms))

    async def _release(self, version: int) -> None:
        await self.redis.zrem(self.names.weights_readers(version), self.reader_id)

    async def fetch(self, version: int | None = None) -> FetchedVersion:
        """Fetch and verify ``version`` (default: the latest); raises a :class:`WeightsError` subclass."""
        if version is None:
            version = await self.latest_version()
            if version is None:
                raise VersionUnavailable("no weight version has been published yet")
        t0 = time.perf_counter()
        if not await self._lease(version):
            raise VersionUnavailable(f"weights version {version} is not available (incomplete or pruned)")
        pending: dict[int, asyncio.Task] = {}
        try:
            raw = await self.redis.get(self.names.weights_manifest(version))
            if raw is None:
                raise VersionUnavailable(f"weights version {version} vanished while leased")
            try:
                manifest = Manifest.decode(raw, self.hmac_key)
            except ManifestError as exc:
                raise CorruptVersion(f"weights version {version}: {exc}") from exc
            if manifest.version != version:
                raise CorruptVersion(f"manifest of weights version {version} says version {manifest.version}")
            if manifest.transport != self.transport.name:
                raise WeightsError(
                    f"weights version {version} lives on transport {manifest.transport!r}, "
                    f"but this reader uses {self.transport.name!r}"
                )
            return await self._fetch_buckets(version, manifest, pending, t0)
        finally:
            for task in pending.values():
                task.cancel()
            await asyncio.gather(*pending.values(), return_exceptions=True)
            await self._release(version)

    async def _fetch_buckets(
        self, version: int, manifest: Manifest, pending: dict[int, asyncio.Task], t0: float
    ) -> FetchedVersion:
        n = manifest.num_buckets

        def request(i: int) -> None:
            if i < n:
                pending[i] = asyncio.create_task(
                    self.transport.get_checked(version, i, manifest.checksum, manifest.buckets[i].nbytes),
                    name=f"weights-get-v{version}-b{i}",
                )

        for i in range(min(n, 1 + self.cfg.prefetch_buckets)):
            request(i)
        buffers: list[memoryview] = []
        transfer_s = 0.0
        renew_every_s = self.cfg.lease_ttl_s / 3
        renewed_at = time.monotonic()
        for i, entry in enumerate(manifest.buckets):
            t1 = time.perf_counter()
            try:
                buf, got = await pending.pop(i)
            except BucketMissing as exc:
                raise VersionUnavailable(f"weights version {version}: {exc}") from exc
            except BucketCorrupt as exc:
                raise CorruptVersion(f"weights version {version} bucket {i}: {exc}") from exc
            request(i + 1 + self.cfg.prefetch_buckets)
            transfer_s += time.perf_counter() - t1
            if buf.nbytes != entry.nbytes:
                raise CorruptVersion(f"weights v{version} bucket {i}: {buf.nbytes} bytes, manifest says {entry.nbytes}")
            if got != entry.checksum:
                raise CorruptVersion(
                    f"weights v{version} bucket {i}: {manifest.checksum} {got:#x} != manifest {entry.checksum:#x}"
                )
            buffers.append(buf)
            if time.monotonic() - renewed_at > renew_every_s:
                renewed_at = time.monotonic()
                if not await self._lease(version):
                    raise VersionUnavailable(f"weights version {version} vanished while being read")
        with warnings.catch_warnings():
            # Read-only buffers (shared memory) give read-only tensors: engines copy them, never write.
            warnings.filterwarnings("ignore", message="The given buffer is not writable")
            tensors = {e.name: view_tensor(buffers[e.bucket], e) for e in manifest.tensors}
        total_s = time.perf_counter() - t0
        return FetchedVersion(version, manifest, tensors, transfer_s, total_s)
