"""Publishing a weight version: buckets first, then the manifest, then visibility, then the announcement.

Protocol (keys from :class:`~async_rl.run.names.Names`):

1. ``weights:staging`` records the version and its bucket count, so a publisher that dies
   mid-way leaves nothing a later publisher cannot find and delete;
2. every rank writes its own pieces' buckets through the :class:`~async_rl.weights.transport.BucketTransport`
   (:meth:`WeightPublisher.write_rank`: payloads encoded against the rank's copy of the base version
   when the version is a delta, see :mod:`.delta`), bucket indices from ``first_bucket`` on;
3. rank 0 merges the ranks' parts into the manifest and one Lua script writes it, adds the version to
   ``weights:versions``, moves ``weights:latest`` forward and clears the staging entry
   (:meth:`WeightPublisher.commit`): the version becomes visible all at once, or not at all;
4. a :class:`~async_rl.servers.control.WeightsAnnounced` goes out on NATS (readers also poll ``latest``);
5. versions beyond the newest ``keep_versions`` are pruned, except the newest full version and those after it
   (a late joiner builds the latest from them): hidden at once (removed from ``versions``), deleted only when
   no reader holds a live lease on them (see :mod:`.reader`).

:meth:`WeightPublisher.publish` does all of it for a dict of whole tensors, as a full version, on one rank.
One publisher writes a run's weights at a time: the learner's carries its :class:`~async_rl.run.lease.Fence`, and the
staging record, the commit and the pruning of ``versions`` are refused by Redis unless its token is the run's current
one (a learner another one took the run from makes nothing visible; buckets it still puts belong to a version number
that is never committed, :mod:`actors.learner.publishing` numbers past it).
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import redis.asyncio as aioredis
import torch

from async_rl.run.lease import Fence, fenced
from async_rl.run.names import Names
from async_rl.servers.control import ControlPlane, WeightsAnnounced
from async_rl.weights import delta
from async_rl.weights.config import PublisherConfig
from async_rl.weights.manifest import (
    CHECKSUMS,
    DTYPE_NAMES,
    BucketEntry,
    Manifest,
    ManifestTensor,
    PieceEntry,
    default_checksum,
    merge_rank_tensors,
    plan_sizes,
)
from async_rl.weights.signing import run_secret
from async_rl.weights.snapshot import Piece
from async_rl.weights.transport import BucketTransport

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
# KEYS: staging; ARGV: version, buckets up to the end of this rank's range. The largest range of all ranks wins.
_STAGE_LUA = """
local cur = tonumber(redis.call('HGET', KEYS[1], ARGV[1]) or '0')
if tonumber(ARGV[2]) > cur then redis.call('HSET', KEYS[1], ARGV[1], ARGV[2]) end
return 1
"""
# KEYS: retiring, versions; ARGV: version, bucket count. Hides a pruned version (its data waits for its readers).
_HIDE_LUA = """
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
"""
# KEYS: manifest, readers. Deletes the manifest (no new lease can be taken) only when no lease is live; 1 when it did.
# The GPU path retires a slot's version with it too (async_rl/weights/gpu/publisher.py).
RETIRE_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
redis.call('ZREMRANGEBYSCORE', KEYS[2], '-inf', now)
if redis.call('ZCARD', KEYS[2]) > 0 then return 0 end
redis.call('DEL', KEYS[1], KEYS[2])
return 1
"""


@dataclass(slots=True)
class PublishStats:
    """Timings and sizes of one published version."""

    version: int
    total_bytes: int
    """Bytes stored (sent) for the version."""
    num_buckets: int
    pack_s: float
    """Encoding, checksums and packing (in worker threads)."""
    put_s: float
    total_s: float
    kind: str = "full"
    full_bytes: int = 0
    """Bytes of the full tensors: ``total_bytes / full_bytes`` is the delta ratio."""

    @property
    def gbps(self) -> float:
        return self.total_bytes / max(self.total_s, 1e-9) / 1e9

    @property
    def delta_ratio(self) -> float:
        return self.total_bytes / max(self.full_bytes, 1)


@dataclass(slots=True)
class RankPart:
    """What one rank wrote of a version: its pieces of each tensor and its buckets (global indices)."""

    rank: int
    tensors: list[ManifestTensor]
    buckets: list[BucketEntry]
    pack_s: float = 0.0
    put_s: float = 0.0
    encodings: dict[str, int] = field(default_factory=dict)
    """Pieces per encoding."""


@dataclass(slots=True)
class _Payload:
    piece: Piece
    entry: PieceEntry
    data: memoryview


def _encodings(tensors: Sequence[ManifestTensor]) -> dict[str, int]:
    """Pieces per encoding."""
    return dict(Counter(p.encoding for t in tensors for p in t.pieces))


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
    newest_full: int
    """The newest full version this publisher committed (-1: none yet): pruning keeps it and those after it."""
    fence: Fence | None
    """The learner's fence: staging, commits and pruning are refused unless its token is the run's current one."""
    _cleaned: bool

    def __init__(
        self,
        redis: aioredis.Redis,
        transport: BucketTransport,
        names: Names,
        cfg: PublisherConfig | None = None,
        control: ControlPlane | None = None,
        *,
        fence: Fence | None = None,
    ) -> None:
        self.redis = redis
        self.fence = fence
        self.transport = transport
        self.names = names
        self.cfg = cfg or PublisherConfig()
        self.control = control
        self.checksum = self.cfg.checksum or default_checksum()
        self.hmac_key = run_secret(self.cfg.secret_file)  # None: manifests are not signed
        self.last_stats = None
        self.newest_full = -1
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

    async def full_wanted(self) -> bool:
        """True when a reader asked for a full version since the last call (the request is consumed)."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.zcard(self.names.weights_want_full)
            pipe.delete(self.names.weights_want_full)
            count, _ = await pipe.execute()
        return bool(count)

    async def _check_version(self, version: int) -> None:
        if version < 0:
            raise ValueError(f"weights version must be >= 0, got {version}")
        if not self._cleaned:
            await self.clean_staging()
            self._cleaned = True
        latest = await self.latest_version()
        if latest is not None and version <= latest:
            raise ValueError(f"weights version {version} is not newer than the latest published version {latest}")

    async def publish(self, tensors: Mapping[str, torch.Tensor], version: int) -> Manifest:
        """Publish ``tensors`` (whole, any device) as full ``version`` (must be newer than the latest)."""
        if not tensors:
            raise ValueError("weights: nothing to publish (no tensors)")
        t0 = time.perf_counter()
        part = await self.write_rank(version, [Piece(k, v) for k, v in tensors.items()])
        return await self.commit(version, [part], started_at=t0)

    async def write_rank(
        self,
        version: int,
        pieces: Sequence[Piece],
        *,
        base: Mapping[str, torch.Tensor] | None = None,
        rank: int = 0,
        first_bucket: int = 0,
    ) -> RankPart:
        """Encode and write this rank's ``pieces`` of ``version`` into buckets ``first_bucket``, ... (the ranks'
        ranges must not overlap: rank r starts after the buckets of ranks < r). With ``base`` (this rank's pieces
        of the base version, by name) each piece is stored as a delta where that is smaller (:mod:`.delta`).
        Nothing is visible until :meth:`commit`."""
        if not pieces:
            raise ValueError("weights: nothing to publish (no tensors)")
        await self._check_version(version)
        hasher = CHECKSUMS[self.checksum]
        level = self.cfg.zstd_level

        def encode_one(p: Piece) -> _Payload:
            t = p.tensor.detach()
            if t.dtype not in DTYPE_NAMES:
                raise ValueError(f"weights: tensor {p.name!r} has unsupported dtype {t.dtype}")
            if t.device.type != "cpu":
                t = t.to("cpu")
            t = t.contiguous()
            new = delta.as_bytes(t)
            b = base.get(p.name) if base is not None else None
            old = delta.as_bytes(b) if b is not None and b.shape == t.shape and b.dtype == t.dtype else None
            encoding, data = delta.encode(new, old, t.element_size(), level)
            dim, start, length = (0, 0, -1) if p.whole else (p.dim, p.start, int(t.shape[p.dim]))
            entry = PieceEntry(0, 0, data.nbytes, hasher(new.data), dim, start, length, encoding, rank)
            return _Payload(Piece(p.name, t, p.full_shape, p.dim, p.start), entry, data)

        def encode() -> list[_Payload]:
            return delta.map_pieces(encode_one, pieces)

        t0 = time.perf_counter()
        payloads = await asyncio.to_thread(encode)
        encode_s = time.perf_counter() - t0
        places, sizes = plan_sizes([x.data.nbytes for x in payloads], self.cfg.bucket_bytes)
        for x, (bucket, offset) in zip(payloads, places, strict=True):
            x.entry.bucket, x.entry.offset = first_bucket + bucket, offset
        await self.redis.eval(*fenced(self.fence, _STAGE_LUA, [self.names.weights_staging],
                                      [str(version), str(first_bucket + len(sizes))]))  # fmt: skip
        by_bucket: list[list[_Payload]] = [[] for _ in sizes]
        for x in payloads:
            if x.data.nbytes:
                by_bucket[x.entry.bucket - first_bucket].append(x)
        # Two buffers of the largest bucket: bucket i+1 is packed and checksummed (in a worker thread; memcpy and
        # xxhash release the GIL) while bucket i is on the wire.
        buffers = [bytearray(max(sizes, default=0)) for _ in range(min(2, len(sizes)))]
        pack_times: list[float] = []
        put_times: list[float] = []

        def pack(index: int) -> tuple[memoryview, int]:
            t1 = time.perf_counter()
            view = memoryview(buffers[index % 2])[: sizes[index]]
            pos = 0
            for x in by_bucket[index]:
                view[pos : x.entry.offset] = bytes(x.entry.offset - pos)  # padding: deterministic bytes
                view[x.entry.offset : x.entry.offset + x.data.nbytes] = x.data
                pos = x.entry.offset + x.data.nbytes
            checksum = hasher(view)
            pack_times.append(time.perf_counter() - t1)
            return view, checksum

        async def put(index: int, view: memoryview) -> None:
            t1 = time.perf_counter()
            await self.transport.put(version, first_bucket + index, view)
            put_times.append(time.perf_counter() - t1)

        buckets: list[BucketEntry] = []
        if sizes:
            packed = await asyncio.to_thread(pack, 0)
        for index, size in enumerate(sizes):
            view, checksum = packed
            buckets.append(BucketEntry(first_bucket + index, size, checksum))
            try:
                async with asyncio.TaskGroup() as tg:
                    tg.create_task(put(index, view), name=f"weights-put-v{version}-b{first_bucket + index}")
                    if index + 1 < len(sizes):
                        next_pack = tg.create_task(
                            asyncio.to_thread(pack, index + 1), name=f"weights-pack-b{first_bucket + index + 1}"
                        )
            except BaseExceptionGroup as group:  # callers catch TransportError & co., not a group of them
                raise group.exceptions[0] from None
            if index + 1 < len(sizes):
                packed = next_pack.result()
        tensors = []
        for x in payloads:
            t = x.piece.tensor
            full = tuple(t.shape) if x.piece.whole else tuple(x.piece.full_shape or ())
            tensors.append(ManifestTensor(x.piece.name, DTYPE_NAMES[t.dtype], full, [x.entry]))
        return RankPart(rank, tensors, buckets, encode_s + sum(pack_times), sum(put_times), _encodings(tensors))

    async def write_encoded(self, version: int, tensors: Sequence[ManifestTensor], buckets: Sequence[memoryview],
                            sums: Sequence[int], *, encode_s: float = 0.0) -> RankPart:  # fmt: skip
        """Write a version encoded elsewhere (:mod:`.gpu_encoder`: its pieces' payloads already in ``buckets``, the
        buckets' checksums ``sums``, one rank, bucket indices from 0). Nothing is visible until :meth:`commit`."""
        if not tensors:
            raise ValueError("weights: nothing to publish (no tensors)")
        await self._check_version(version)
        await self.redis.eval(*fenced(self.fence, _STAGE_LUA, [self.names.weights_staging],
                                      [str(version), str(len(buckets))]))  # fmt: skip
        t0 = time.perf_counter()
        for index, data in enumerate(buckets):
            await self.transport.put(version, index, data)
        entries = [BucketEntry(i, b.nbytes, s) for i, (b, s) in enumerate(zip(buckets, sums, strict=True))]
        return RankPart(0, list(tensors), entries, encode_s, time.perf_counter() - t0, _encodings(tensors))

    async def commit(
        self,
        version: int,
        parts: Sequence[RankPart],
        *,
        base: int = -1,
        full_version: int = -1,
        started_at: float | None = None,
        taken_at: float = 0.0,
        checksum: str | None = None,
    ) -> Manifest:
        """Rank 0, once every rank's part is written: merge them into the manifest and make ``version`` visible.
        ``base`` (-1: a full version) is the version the parts' deltas apply to; ``full_version`` the full version
        its chain starts from. ``taken_at``: unix time the snapshot of it began (readers measure snapshot-to-applied).
        ``checksum``: the parts' checksum algorithm when they were not written by :meth:`write_rank` (None: this
        publisher's)."""
        t0 = time.perf_counter() if started_at is None else started_at
        ordered = sorted(parts, key=lambda p: p.rank)
        merged = {t.name: t for t in merge_rank_tensors([p.tensors for p in ordered])}
        buckets = sorted((b for p in parts for b in p.buckets), key=lambda b: b.index)
        delta_version = base >= 0
        manifest = Manifest(
            version=version, tensors=list(merged.values()), buckets=buckets, transport=self.transport.name,
            checksum=checksum or self.checksum, kind="delta" if delta_version else "full", base=base,
            full_version=full_version if delta_version else version, num_ranks=len(parts), taken_at=taken_at,
        )  # fmt: skip
        try:
            manifest.validate()
        except ValueError as exc:
            raise ValueError(f"weights version {version}: the ranks' pieces do not make a valid version: {exc}") from None
        n = self.names
        await self.redis.eval(*fenced(
            self.fence, _COMMIT_LUA, [n.weights_manifest(version), n.weights_versions, n.weights_latest,
                                      n.weights_staging], [manifest.encode(self.hmac_key), str(version)],
        ))  # fmt: skip
        if not delta_version:
            self.newest_full = version
        total_s = time.perf_counter() - t0
        self.last_stats = PublishStats(
            version, manifest.total_bytes, len(buckets), sum(p.pack_s for p in parts), sum(p.put_s for p in parts),
            total_s, manifest.kind, manifest.full_bytes,
        )  # fmt: skip
        log.info(
            "published weights v%d (%s): %d tensors, %d buckets, %.2f MB of %.2f MB in %.2fs",
            version, manifest.kind, len(merged), len(buckets), manifest.total_bytes / 1e6, manifest.full_bytes / 1e6,
            total_s,
        )  # fmt: skip
        if self.control is not None:
            await self.control.publish(
                n.weights_subject,
                WeightsAnnounced(
                    version=version,
                    manifest_key=n.weights_manifest(version),
                    total_bytes=manifest.total_bytes,
                    num_buckets=len(buckets),
                    transport=self.transport.name,
                ),
            )
        await self.prune()
        return manifest

    async def prune(self) -> list[int]:
        """Hide versions beyond the newest ``keep_versions`` (never the newest full one or those after it); delete
        hidden ones nobody is reading."""
        n = self.names
        versions = [int(v) for v in await self.redis.zrange(n.weights_versions, 0, -1)]  # type: ignore[arg-type]
        keep_from = versions[-self.cfg.keep_versions] if len(versions) >= self.cfg.keep_versions else 0
        if self.newest_full >= 0:
            keep_from = min(keep_from, self.newest_full)
        excess = [v for v in versions if v < keep_from]
        for version in excess:
            raw = await self.redis.get(n.weights_manifest(version))
            count = Manifest.decode(raw).num_buckets if raw is not None else 0
            await self.redis.eval(*fenced(self.fence, _HIDE_LUA, [n.weights_retiring, n.weights_versions],
                                          [str(version), str(count)]))  # fmt: skip
        deleted = []
        for raw_version, raw_count in (await self.redis.hgetall(n.weights_retiring)).items():
            version = int(raw_version)
            ok = await self.redis.eval(RETIRE_LUA, 2, n.weights_manifest(version), n.weights_readers(version))
            if ok:
                # The manifest is gone, so no new lease can be taken: the buckets are safe to delete.
                await self.transport.delete(version, int(raw_count))
                await self.redis.hdel(n.weights_retiring, raw_version)
                deleted.append(version)
        if deleted:
            log.info("deleted weight versions %s", deleted)
        return deleted
