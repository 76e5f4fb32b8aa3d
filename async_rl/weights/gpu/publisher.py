"""Publishing weight versions from the learner's GPU: generators on the same host copy them GPU to GPU.

At a step boundary :meth:`GpuPublisher.offer` queues a copy of the weights into a free slot of GPU buckets
(:mod:`.gpu_slots`: a side stream, nothing waits on the host) and returns; a named task then waits for the
copy and its GPU checksums, and commits the version:

1. its manifest (the tensors, the buckets' ``wsum64`` checksums, the buckets' CUDA IPC handles and the host they
   can be mapped on; HMAC-signed like every manifest) is written to ``weights:gpu:<v>:manifest`` and
   ``weights:gpu:latest`` moves forward, in one Lua script (refused by Redis unless the learner's fencing token is
   the run's current one, :mod:`async_rl.run.lease`);
2. a :class:`~async_rl.servers.control.WeightsAnnounced` with transport ``cuda`` goes out on NATS.

A generator on the same host (:mod:`.gpu_reader`) leases the version, copies its buckets into its own GPU,
checks the checksums there and stages them. **A slot is refilled only when nobody can be reading it**: never
the slot of the newest version, and another only after one Lua script deleted its old manifest (no new lease
can be taken) while no reader lease on it was live. Reader leases on GPU versions are short
(``weights.reader.gpu_lease_ttl_s``): a reader killed mid-copy holds a slot for that long at most, and a reader
that overstays its lease discards what it copied. When no slot is free the step's version is skipped (the next
boundary offers a newer one), as the host path coalesces.

**Other hosts** still get every version the host transport can carry: after a commit, when the host publisher
(:class:`~async_rl.weights.background.BackgroundPublisher`) is idle, the version just committed is handed to it
from the slot, in the background, never in the training loop, so the versions on Redis or ``peer://`` follow at the
rate that path sustains. The version is read from the slot's whole version on this GPU (``export.whole``: one rank's
slots, or every rank's mirrored on rank 0, :class:`~async_rl.weights.gpu.ranks.RankMirror`) and encoded there
(:mod:`.gpu_encoder`: a delta from the last one sent where that pays, checksums on the GPU; the slot stays held until
its buckets are in pinned host memory); with ``publisher.gpu_encode=false`` the host publisher snapshots it and encodes
on the CPU. Ranks rank 0 cannot map (other hosts): the host transport gets the gathered weights at a step boundary
whenever it is idle, as before the GPU path. Errors travel to the next :meth:`offer` / :meth:`flush`, as in the host
publisher.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable

import redis.asyncio as aioredis
import torch

from async_rl.run.lease import Fence, fenced
from async_rl.run.names import Names
from async_rl.servers.control import ControlPlane, WeightsAnnounced
from async_rl.weights.background import BackgroundPublisher, Encode, PublishRecord, Source
from async_rl.weights.config import PublisherConfig
from async_rl.weights.gpu.cuda_ipc import IpcUnavailable, fast_thread_handoffs, host_key
from async_rl.weights.gpu.encoder import GpuEncoder
from async_rl.weights.gpu.slots import GpuExport, GpuFill, GpuSlots
from async_rl.weights.manifest import DTYPES, GPU_CHECKSUM, GPU_TRANSPORT, IpcPlacement, Manifest
from async_rl.weights.publisher import RETIRE_LUA, PublishStats
from async_rl.weights.signing import run_secret

log = logging.getLogger(__name__)

TRANSPORT = GPU_TRANSPORT

# KEYS: manifest, latest; ARGV: manifest bytes, version.
_COMMIT_LUA = """
redis.call('SET', KEYS[1], ARGV[1])
local cur = redis.call('GET', KEYS[2])
if (not cur) or tonumber(cur) < tonumber(ARGV[2]) then redis.call('SET', KEYS[2], ARGV[2]) end
return 1
"""


class _NoSlots:
    """What an abandoned publisher holds instead of its slots (any use is a bug)."""

    num_slots = 0
    device_bytes = 0
    whole = None

    def drop_whole(self, reason: str) -> bool:
        return False


class GpuSlotsOutOfMemory(RuntimeError):
    """The GPU slots do not fit in the learner's GPU memory (the message says which keys to change)."""


def local_slots(device: torch.device | str, cfg: PublisherConfig, rank: int = 0) -> GpuSlots:
    """GPU slots of this process as ``cfg`` sets them (``publisher.gpu_slots``, ``gpu_bucket_bytes``, ``gpu_dtype``)."""
    dtype = DTYPES[cfg.gpu_dtype] if cfg.gpu_dtype else None
    return GpuSlots(device, num_slots=cfg.gpu_slots, bucket_bytes=cfg.gpu_bucket_bytes, dtype=dtype, rank=rank)


class GpuPublisher:
    """Same-host weight versions from GPU slots, and the host publisher fed from them (module docstring)."""

    redis: aioredis.Redis
    names: Names
    cfg: PublisherConfig
    control: ControlPlane | None
    host: BackgroundPublisher | None
    encoder: GpuEncoder | None
    """Encodes the host transport's versions on the GPU (None: the host publisher snapshots and encodes them)."""
    slots: GpuExport
    slot_version: list[int]
    """The version each slot holds (-1: none)."""
    published_version: int
    """Newest committed GPU version (-1: none)."""
    versions_skipped: int
    records: list[PublishRecord]
    _latest_slot: int | None
    _held: dict[int, int]
    """Slots the host publisher is copying from (slot -> holds)."""
    _queue: asyncio.Queue[GpuFill]
    _queued: dict[int, int]
    """Slot -> version of the fills not yet committed."""
    _task: asyncio.Task | None
    _host_task: asyncio.Task | None
    _error: BaseException | None
    _hmac_key: bytes | None
    _fence: Fence | None
    _on_commit: Callable[[PublishRecord], Awaitable[None] | None] | None

    def __init__(self, redis: aioredis.Redis, names: Names, cfg: PublisherConfig, export: GpuExport, *,
                 control: ControlPlane | None = None, host: BackgroundPublisher | None = None,
                 on_commit: Callable[[PublishRecord], Awaitable[None] | None] | None = None,
                 fence: Fence | None = None) -> None:  # fmt: skip
        """``export``: where the versions are kept (:func:`local_slots` of this process, or a multi-rank backend's
        slots on every rank); ``fence``: the learner's (commits refused unless its token is the run's current one)."""
        self._fence = fence
        self.redis, self.names, self.cfg, self.control, self.host = redis, names, cfg, control, host
        self.slots = export
        self.encoder = None
        if host is not None and cfg.gpu_encode:  # used where the export holds whole versions on this GPU
            self.encoder = GpuEncoder(cfg.bucket_bytes, delta=host.use_delta)
        self.slot_version = [-1] * export.num_slots
        self.published_version = -1
        self.versions_skipped = 0
        self.records = []
        self._latest_slot = None
        self._held = {}
        self._queue = asyncio.Queue()
        self._queued = {}
        self._task = None
        self._host_task = None
        self._error = None
        self._hmac_key = run_secret(cfg.secret_file)
        self._on_commit = on_commit
        fast_thread_handoffs()

    async def clean(self) -> None:
        """Forget GPU versions a previous learner left (their buffers died with it): readers then wait for ours."""
        keys = []
        for kind in ("manifest", "readers"):
            keys += [k async for k in self.redis.scan_iter(match=self.names.key("weights", "gpu", "*", kind))]
        if keys:
            await self.redis.delete(*keys)
        await self.redis.delete(self.names.weights_gpu_latest)

    async def abandon(self) -> None:
        """Stop using the GPU path (its slots did not fit): queued commits end, the GPU versions' manifests go (readers
        move to the host transport's versions), the slots' memory is released."""
        await self._stop(timeout_s=60.0)
        self._error = None
        await self.clean()
        self.slots = _NoSlots()  # type: ignore[assignment]
        self.host = self.encoder = None

    async def latest_version(self) -> int | None:
        raw = await self.redis.get(self.names.weights_gpu_latest)
        return None if raw is None else int(raw)

    @property
    def inflight_version(self) -> int | None:
        """Newest version queued and not yet committed (None: none)."""
        return max(self._queued.values(), default=None)

    def _raise_error(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    async def _free_slot(self) -> int | None:
        """A slot nobody can be reading (its version retired), or None."""
        busy = {self._latest_slot, *self._queued, *self._held}
        order = sorted(range(self.slots.num_slots), key=lambda s: self.slot_version[s])  # empty, then oldest
        for slot in order:
            if slot in busy:
                continue
            old = self.slot_version[slot]
            if old >= 0:
                n = self.names
                free = await self.redis.eval(RETIRE_LUA, 2, n.weights_gpu_manifest(old), n.weights_gpu_readers(old))
                if not free:
                    continue
                self.slot_version[slot] = -1
            return slot
        return None

    async def offer(self, version: int, source: Source) -> bool:
        """At a step boundary: queue ``version``'s copy into a free slot; False (skipped) when none is free."""
        self._raise_error()
        slot = await self._free_slot()
        if slot is None:
            self.versions_skipped += 1
            log.debug("weights v%d skipped: every GPU slot is the newest, being committed or leased", version)
            return False
        try:
            fill = await asyncio.to_thread(self.slots.fill, slot, version, source)
        except torch.cuda.OutOfMemoryError as exc:
            raise GpuSlotsOutOfMemory(
                f"weights: no GPU memory for GPU slot {slot} ({self.slots.device_bytes / 1e9:.1f} GB held by the "
                f"others): publisher.gpu_slots={self.slots.num_slots} copies of the weights do not fit beside "
                f"training; set publisher.gpu=off (or publisher.gpu_dtype=bfloat16 for an fp32 learner)") from exc
        self._queued[slot] = version
        self._queue.put_nowait(fill)
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._commit_loop(), name="weights-gpu-commit")
        host = self.host
        if host is not None and self.slots.whole is None and host.inflight_version is None:
            # Ranks rank 0 cannot map: the host transport gets the gathered weights (the path before the GPU one),
            # whenever it is idle; publisher.gpu_host_copies=false leaves it to the flush at the end.
            await host.offer(version, source)
        return True

    async def _commit_loop(self) -> None:
        while not self._queue.empty():
            fill = self._queue.get_nowait()
            try:
                await self._commit(fill)
            except Exception as exc:  # raised by the next offer/flush: the learner fails as with a host publish
                log.error("publishing weights v%d from the GPU failed: %r", fill.version, exc)
                self._error = exc
            finally:
                self._queued.pop(fill.slot, None)

    async def _commit(self, fill: GpuFill) -> None:
        t0 = time.perf_counter()
        sums = await asyncio.to_thread(fill.wait)
        t1 = time.perf_counter()
        tensors, buckets = self.slots.manifest_parts(sums)
        placement = IpcPlacement(host_key(), self.slots.handles(fill.slot))
        manifest = Manifest(version=fill.version, tensors=tensors, buckets=buckets, transport=TRANSPORT,
                            checksum=GPU_CHECKSUM, full_version=fill.version, taken_at=fill.taken_at, ipc=placement)  # fmt: skip
        manifest.validate()
        n = self.names
        await self.redis.eval(*fenced(self._fence, _COMMIT_LUA, [n.weights_gpu_manifest(fill.version),
                                                                 n.weights_gpu_latest],
                                      [manifest.encode(self._hmac_key), str(fill.version)]))  # fmt: skip
        self.slot_version[fill.slot] = fill.version
        self._latest_slot = fill.slot
        self.published_version = max(self.published_version, fill.version)
        if self.control is not None:
            await self.control.publish(n.weights_subject, WeightsAnnounced(
                version=fill.version, manifest_key=n.weights_gpu_manifest(fill.version),
                total_bytes=manifest.total_bytes, num_buckets=manifest.num_buckets, transport=TRANSPORT))  # fmt: skip
        latency_s = time.time() - fill.taken_at
        # pack_s: waiting for the GPU's copies and checksums; put_s: the manifest's commit and announcement.
        stats = PublishStats(fill.version, manifest.total_bytes, manifest.num_buckets, t1 - t0,
                             time.perf_counter() - t1, latency_s, TRANSPORT, manifest.full_bytes)  # fmt: skip
        record = PublishRecord(fill.version, TRANSPORT, manifest.total_bytes, manifest.full_bytes, fill.block_s,
                               latency_s, stats)  # fmt: skip
        self.records.append(record)
        if self._on_commit is not None:
            result = self._on_commit(record)
            if result is not None:
                await result
        self._feed_host(fill.version, fill.slot)

    def _feed_host(self, version: int, slot: int) -> None:
        """Hand the committed version to the host publisher when it is idle (module docstring)."""
        host = self.host
        if host is None or self.slots.whole is None:
            return
        if host.inflight_version is not None or version <= host.published_version:
            return
        if self._host_task is not None and not self._host_task.done():
            return
        self._host_task = asyncio.create_task(self._to_host(version, slot), name=f"weights-gpu-to-host-v{version}")

    async def _to_host(self, version: int, slot: int, *, wait: bool = False) -> None:
        assert self.host is not None
        self._held[slot] = self._held.get(slot, 0) + 1
        try:
            await self._to_host_from_slot(version, slot, wait)
        except Exception as exc:
            if isinstance(exc, torch.cuda.OutOfMemoryError | IpcUnavailable) and self.slots.drop_whole(repr(exc)):
                self.encoder = None  # rank 0's mirror given up (the gathered weights from the next offer on), its base too
            else:
                log.error("publishing weights v%d through the host transport failed: %r", version, exc)
                self._error = exc
        finally:
            self._held[slot] -= 1
            if not self._held[slot]:
                del self._held[slot]

    async def _to_host_from_slot(self, version: int, slot: int, wait: bool) -> None:
        """The version in ``slot`` to the host publisher: encoded on the GPU, else snapshot for the CPU to encode."""
        assert self.host is not None
        encode = self._encode(version, slot)
        try:
            if encode is None:
                await self._to_host_from_cpu(version, slot, wait)
            elif wait:
                await self.host.flush(version, encode=encode)
            else:
                await self.host.offer_encoded(version, encode)  # returns once its buckets are in host memory
        except torch.cuda.OutOfMemoryError as exc:
            if encode is None:
                raise
            log.warning("weights: no GPU memory to encode versions for other hosts (%s); they are snapshot and "
                        "encoded on the CPU from now on (publisher.gpu_encode=false says so up front)", exc)  # fmt: skip
            self.encoder = None
            await self._to_host_from_cpu(version, slot, wait)

    async def _to_host_from_cpu(self, version: int, slot: int, wait: bool) -> None:
        assert self.host is not None and self.slots.whole is not None
        pieces = await asyncio.to_thread(self.slots.whole.tensors, slot)
        if wait:
            await self.host.flush(version, lambda: pieces)
        else:
            await self.host.offer(version, lambda: pieces)  # returns once the host snapshot is taken

    def _encode(self, version: int, slot: int) -> Encode | None:
        """The GPU encoding of the version in ``slot`` for the host publisher (None: it encodes on the CPU)."""
        encoder, whole = self.encoder, self.slots.whole
        if encoder is None or whole is None:
            return None

        def encode(full: bool, base_version: int, link: float | None):  # type: ignore[no-untyped-def]
            enc = encoder.encode(whole, slot, version, full=full, base_version=base_version, link_bytes_per_s=link)
            log.debug("weights v%d for the host transport: %s on the GPU in %.3fs (%s)", version, enc.kind,
                      enc.encode_s, enc.reason)  # fmt: skip
            return enc

        return encode

    async def wait_idle(self) -> None:
        """Wait until every queued version is committed and the host hand-over (if any) took its snapshot (a commit
        may start a hand-over: both are looked at again until neither runs)."""
        while True:
            running = [t for t in (self._task, self._host_task) if t is not None and not t.done()]
            if not running:
                return
            for task in running:
                with contextlib.suppress(Exception):
                    await asyncio.shield(task)

    async def flush(self, version: int, source: Source) -> None:
        """Make ``version`` the newest GPU version and the newest host version (the end of a run, the start)."""
        await self.wait_idle()
        self._raise_error()
        while version > self.published_version:
            if not await self.offer(version, source):
                await asyncio.sleep(self.cfg.gpu_retry_s)  # every slot leased: a lease ends within its short TTL
            await self.wait_idle()
            self._raise_error()
        if self.host is not None and self._latest_slot is not None:
            if self.slots.whole is not None:
                await self._to_host(version, self._latest_slot, wait=True)
            if self.slots.whole is None:  # several ranks rank 0 cannot map (or its mirror was given up): gathered
                await self.host.flush(version, source)
            self._raise_error()

    def take_records(self) -> list[PublishRecord]:
        out, self.records = self.records, []
        if self.host is not None:
            out += self.host.take_records()
        return out

    async def aclose(self, timeout_s: float = 60.0) -> None:
        """Let queued commits end (up to ``timeout_s``), then the host publisher."""
        await self._stop(timeout_s)
        if self.host is not None:
            await self.host.aclose(timeout_s)

    async def _stop(self, timeout_s: float) -> None:
        """Let queued commits and the host hand-over end (up to ``timeout_s``), then cancel what is left."""
        with contextlib.suppress(TimeoutError, Exception):
            await asyncio.wait_for(self.wait_idle(), timeout_s)
        for task in (self._task, self._host_task):
            if task is not None and not task.done():
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
