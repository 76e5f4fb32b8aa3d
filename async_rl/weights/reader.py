"""Reading a weight version: lease, manifest, buckets (prefetched), checksums, pieces assembled, deltas applied.

A reader takes a lease on the version before it reads the manifest (one Lua script that
refuses when the manifest is gone) and keeps it fresh while it reads; the publisher deletes a
pruned version only when no lease is live. So a slow reader is never cut off mid-version, and
a crashed one holds nothing longer than ``lease_ttl_s``.

A full version's tensors are views of the bucket buffers when one piece covers them (no copy), else assembled
from their pieces. A delta version is applied onto the version the reader holds when that is its base (or a
chain of deltas leads from it), else onto the newest full version its chain starts from, fetched first (a late
joiner, a missed version). Every bucket is checked against its checksum before anything is built from it, and
every piece a delta rebuilds against the learner's checksum of its full contents: a version is bit-exact or
refused (:class:`CorruptVersion`); :meth:`WeightReader.request_full` then asks the publisher for a full version.

Streaming (``fetch(..., stream=...)``): a full version read on its own hands its tensors over bucket by bucket,
each tensor once every bucket holding it was verified, so that the engine copies one bucket while the next is
fetched and checked. The version counts as read only when the fetch returns.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
import uuid
import warnings
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import redis.asyncio as aioredis
import torch
from redis.exceptions import RedisError

from async_rl.run.names import Names
from async_rl.weights import delta
from async_rl.weights.checksums import CHECKSUMS
from async_rl.weights.config import ReaderConfig
from async_rl.weights.manifest import DTYPES, Manifest, ManifestError, ManifestTensor
from async_rl.weights.signing import run_secret
from async_rl.weights.transport import BucketCorrupt, BucketMissing, BucketTransport

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


# Read-only buffers (shared memory) give read-only tensors: engines copy them, never write. Set once for the
# process (warnings.catch_warnings is not thread-safe, and pieces are built on several threads).
warnings.filterwarnings("ignore", message="The given buffer is not writable")

Sink = Callable[[Mapping[str, torch.Tensor]], None]
"""Takes verified tensors of a version as they are built (called on a worker thread)."""
StreamOpener = Callable[[Manifest], Sink | None]
"""Called with a full version's manifest before its buckets are read: a sink for its tensors, or None."""


class WeightsError(RuntimeError):
    """A weight version could not be read; the reader's caller keeps its current weights."""


class VersionUnavailable(WeightsError):
    """The version is not (or no longer) complete and visible."""


class LeaseOutlasted(WeightsError):
    """A copy ended after its lease: the bytes may be overwritten, so they are discarded. Transient: the version may
    still be there (a new lease is refused if it is gone, :class:`VersionUnavailable`), so the caller tries again."""


class CopyFailed(WeightsError):
    """A copy made elsewhere (a vLLM worker's, :data:`~async_rl.weights.gpu.reader.RemoteCopy`) raised: tried again
    like a transient error, then the version is given up; the engine keeps its weights and goes on."""


class CorruptVersion(WeightsError):
    """A bucket's bytes do not match the manifest (size or checksum), or the manifest is malformed."""


@dataclass(slots=True)
class FetchedVersion:
    """A complete, verified version: whole tensors (views of the fetched bucket buffers where possible; never to be
    written: the next version may share them)."""

    version: int
    manifest: Manifest
    tensors: dict[str, torch.Tensor]
    transfer_s: float
    """Time waiting for verified bucket bytes (checksums are computed by the transport while it receives)."""
    total_s: float
    bytes_fetched: int = 0
    """Bucket bytes fetched for it (every version of a chain together)."""
    chain: tuple[int, ...] = ()
    """Versions fetched to build it, oldest first (a full version, then deltas; or deltas onto the held one)."""
    streamed: bool = False
    """Every tensor already went to the sink that ``fetch``'s ``stream`` returned."""

    @property
    def gbps(self) -> float:
        return self.manifest.total_bytes / max(self.total_s, 1e-9) / 1e9


async def take_lease(redis: aioredis.Redis, manifest_key: str, readers_key: str, reader_id: str, ttl_s: float) -> bool:
    """A lease of ``ttl_s`` for ``reader_id`` on the version whose manifest is at ``manifest_key`` (one script: False
    when the manifest is gone, so a retired version can not be leased again)."""
    return bool(await redis.eval(_LEASE_LUA, 2, manifest_key, readers_key, reader_id, int(ttl_s * 1000)))


async def read_manifest(redis: aioredis.Redis, key: str, version: int, hmac_key: bytes | None, what: str,
                        gone: str) -> Manifest:  # fmt: skip
    """The manifest of ``version`` at ``key``, decoded (its HMAC checked with ``hmac_key``); VersionUnavailable (``what``
    ``version`` ``gone``) when absent, CorruptVersion when malformed or of another version."""
    raw = await redis.get(key)
    if raw is None:
        raise VersionUnavailable(f"{what} {version} {gone}")
    try:
        manifest = Manifest.decode(raw, hmac_key)
    except ManifestError as exc:
        raise CorruptVersion(f"{what} {version}: {exc}") from exc
    if manifest.version != version:
        raise CorruptVersion(f"manifest of {what} {version} says version {manifest.version}")
    return manifest


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
        keys = (self.names.weights_manifest(version), self.names.weights_readers(version))
        return await take_lease(self.redis, *keys, self.reader_id, self.cfg.lease_ttl_s)

    async def _release(self, version: int) -> None:
        await self.redis.zrem(self.names.weights_readers(version), self.reader_id)

    async def request_full(self) -> bool:
        """Ask the publisher for a full version (its next one is full); False when this reader may not (an ACL)."""
        try:
            await self.redis.zadd(self.names.weights_want_full, {self.reader_id: int(time.time() * 1000)})
        except RedisError as exc:
            log.warning("could not ask for a full weight version (%r); waiting for the next periodic one", exc)
            return False
        return True

    async def _manifest(self, version: int) -> Manifest:
        return await read_manifest(self.redis, self.names.weights_manifest(version), version, self.hmac_key,
                                   "weights version", "is not available (incomplete or pruned)")  # fmt: skip

    async def fetch(
        self, version: int | None = None, have: FetchedVersion | None = None, stream: StreamOpener | None = None
    ) -> FetchedVersion:
        """Fetch, verify and assemble ``version`` (default: the latest); raises a :class:`WeightsError` subclass.

        A delta is applied onto ``have`` (the version this reader holds) when a chain of deltas leads from it;
        otherwise the chain is built from its newest full version. :class:`VersionUnavailable` when a version
        of the chain is gone (then :meth:`request_full`). ``stream``: when ``version`` is a full version, its
        tensors go to the sink it returns as their buckets are verified (module docstring)."""
        if version is None:
            version = await self.latest_version()
            if version is None:
                raise VersionUnavailable("no weight version has been published yet")
        t0 = time.perf_counter()
        manifest = await self._manifest(version)
        chain = [manifest]
        start: FetchedVersion | None = None
        while chain[-1].kind == "delta":
            if have is not None and chain[-1].base == have.version:
                start = have
                break
            chain.append(await self._manifest(chain[-1].base))
        if start is None:
            sink = stream(manifest) if stream is not None and len(chain) == 1 else None
            start = await self._read(chain.pop().version, None, sink)
        transfer_s, nbytes, versions = start.transfer_s, start.bytes_fetched, list(start.chain) if start is not have else []
        for m in reversed(chain):
            start = await self._read(m.version, start)
            transfer_s += start.transfer_s
            nbytes += start.bytes_fetched
            versions.append(m.version)
        total_s = time.perf_counter() - t0
        return FetchedVersion(start.version, start.manifest, start.tensors, transfer_s, total_s, nbytes, tuple(versions),
                              start.streamed)  # fmt: skip

    async def _read(self, version: int, base: FetchedVersion | None, sink: Sink | None = None) -> FetchedVersion:
        """Lease ``version``, fetch and verify its buckets, build its tensors (a delta onto ``base``; a full
        version's bucket by bucket into ``sink`` when there is one)."""
        t0 = time.perf_counter()
        if not await self._lease(version):
            raise VersionUnavailable(f"weights version {version} is not available (incomplete or pruned)")
        pending: dict[int, asyncio.Task] = {}
        try:
            manifest = await self._manifest(version)
            if manifest.transport != self.transport.name:
                raise WeightsError(
                    f"weights version {version} lives on transport {manifest.transport!r}, "
                    f"but this reader uses {self.transport.name!r}"
                )
            if manifest.kind == "delta" and (base is None or base.version != manifest.base):
                have = "none" if base is None else f"v{base.version}"
                raise VersionUnavailable(f"weights version {version} is a delta from v{manifest.base}; held: {have}")
            streamer = _Streamer(manifest, sink) if sink is not None and manifest.kind == "full" else None
            on_bucket = streamer.bucket_verified if streamer is not None else None
            buffers, transfer_s = await self._fetch_buckets(version, manifest, pending, on_bucket)
        finally:
            for task in pending.values():
                task.cancel()
            await asyncio.gather(*pending.values(), return_exceptions=True)
            await self._release(version)
        if streamer is None:
            built = await asyncio.to_thread(_build, manifest, buffers, base.tensors if base is not None else None)
        else:
            built = streamer.finish(buffers)
        total_s = time.perf_counter() - t0
        return FetchedVersion(version, manifest, built, transfer_s, total_s, manifest.total_bytes, (version,),
                              streamer is not None)  # fmt: skip

    async def _fetch_buckets(
        self,
        version: int,
        manifest: Manifest,
        pending: dict[int, asyncio.Task],
        on_bucket: Callable[[list[memoryview]], None] | None = None,
    ) -> tuple[list[memoryview], float]:
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
            if on_bucket is not None:
                await asyncio.to_thread(on_bucket, buffers)
            if time.monotonic() - renewed_at > renew_every_s:
                renewed_at = time.monotonic()
                if not await self._lease(version):
                    raise VersionUnavailable(f"weights version {version} vanished while being read")
        return buffers, transfer_s


class _Streamer:
    """Builds a full version's tensors as its buckets are verified and hands each batch to the sink."""

    __slots__ = ("manifest", "built", "sink", "due", "hasher")

    def __init__(self, manifest: Manifest, sink: Sink) -> None:
        self.manifest, self.sink = manifest, sink
        self.built: dict[str, torch.Tensor] = {}
        self.hasher = CHECKSUMS[manifest.checksum]
        self.due: dict[int, list[ManifestTensor]] = {}
        """Bucket index -> the tensors whose last piece lies in it."""
        for t in manifest.tensors:
            self.due.setdefault(max((p.bucket for p in t.pieces), default=0), []).append(t)

    def bucket_verified(self, buffers: list[memoryview]) -> None:
        """Worker thread: the tensors complete once bucket ``len(buffers) - 1`` is verified, to the sink."""
        self._send(buffers, self.due.get(len(buffers) - 1, []))

    def finish(self, buffers: list[memoryview]) -> dict[str, torch.Tensor]:
        """Every tensor of the version, the ones no bucket brought (no bytes, a version of no buckets) sent now."""
        self._send(buffers, [t for t in self.manifest.tensors if t.name not in self.built])
        return self.built

    def _send(self, buffers: list[memoryview], ready: list[ManifestTensor]) -> None:
        if not ready:
            return
        part = {t.name: _build_tensor(self.manifest, t, buffers, None, self.hasher) for t in ready}
        self.built.update(part)
        self.sink(part)


def _piece_base(base: torch.Tensor, dim: int, start: int, length: int) -> np.ndarray:
    part = base if length < 0 else base.narrow(dim, start, length)
    return delta.as_bytes(part.contiguous())


def _build(manifest: Manifest, buffers: list[memoryview], base: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Worker thread: every tensor of ``manifest`` from its pieces' payloads (deltas onto ``base``), each piece
    checked against its checksum; CorruptVersion naming the tensor otherwise."""
    hasher = CHECKSUMS[manifest.checksum]

    def build(t: ManifestTensor) -> torch.Tensor:  # on one of the piece threads
        return _build_tensor(manifest, t, buffers, base, hasher)

    built = delta.map_pieces(build, manifest.tensors)
    return {t.name: tensor for t, tensor in zip(manifest.tensors, built, strict=True)}


def _build_tensor(manifest: Manifest, t: ManifestTensor, buffers: list[memoryview],
                  base: dict[str, torch.Tensor] | None, hasher) -> torch.Tensor:  # type: ignore[no-untyped-def]  # fmt: skip
    dtype = DTYPES[t.dtype]
    held = base.get(t.name) if base is not None else None
    if held is not None and (held.dtype != dtype or tuple(held.shape) != t.shape):
        raise CorruptVersion(f"weights v{manifest.version} tensor {t.name!r}: {t.dtype} {t.shape} does not match "
                             f"the held v{manifest.base}'s {held.dtype} {tuple(held.shape)}")  # fmt: skip
    if manifest.kind == "delta" and held is None:
        raise CorruptVersion(f"weights v{manifest.version} tensor {t.name!r} is not in the held v{manifest.base}")
    full: torch.Tensor | None = None
    for p in t.pieces:
        shape = p.shape(t.shape)
        nbytes = math.prod(shape) * dtype.itemsize
        payload = buffers[p.bucket][p.offset : p.offset + p.nbytes] if p.nbytes else memoryview(b"")
        old = _piece_base(held, p.dim, p.start, p.length) if held is not None and p.encoding != "raw" else None
        try:
            data = delta.decode(p.encoding, payload, old, nbytes, dtype.itemsize)
        except ValueError as exc:
            raise CorruptVersion(f"weights v{manifest.version} tensor {t.name!r}: {exc}") from None
        # A raw piece's bytes are those of its bucket, whose checksum was checked (_fetch_buckets): hashing them
        # again would be a second pass over the whole version for nothing. Decoded pieces are new bytes: checked.
        got = p.checksum if p.encoding == "raw" else hasher(data.data)
        if got != p.checksum:
            how = f"after applying the delta to v{manifest.base}" if p.encoding != "raw" else "as stored"
            raise CorruptVersion(f"weights v{manifest.version} tensor {t.name!r}: {manifest.checksum} {got:#x} "
                                 f"{how} != the learner's {p.checksum:#x}")  # fmt: skip
        if p.length < 0:  # the whole tensor
            if p.encoding == "same" and held is not None:
                return held  # unchanged: shared with the held version (never written)
            if nbytes == 0:
                return torch.empty(shape, dtype=dtype)
            return torch.frombuffer(data, dtype=dtype).view(shape)  # type: ignore[call-overload]
        if full is None:
            full = torch.empty(t.shape, dtype=dtype)
        if nbytes:
            piece = torch.frombuffer(data, dtype=dtype).view(shape)  # type: ignore[call-overload]
            full.narrow(p.dim, p.start, p.length).copy_(piece)
    assert full is not None
    return full
