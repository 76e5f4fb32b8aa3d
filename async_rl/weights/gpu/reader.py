"""Reading a GPU-held weight version on the learner's host: lease, map, copy GPU to GPU, check on the GPU.

:meth:`GpuReader.fetch` takes a short lease on the version (the learner refills no leased slot,
:mod:`.gpu_publisher`), reads and checks its manifest (HMAC where the run has a secret), maps the learner's
buckets (:mod:`.cuda_ipc`, once per buffer), copies each into a fresh buffer on the reader's own GPU on a side
stream, computes every bucket's ``wsum64`` there, and waits once. A version whose checksums differ is
:class:`~async_rl.weights.reader.CorruptVersion`; one whose copy read the buffers after its lease ended (renewed
while the copy is under way, for a bounded time: :mod:`.lease`) may have been overwritten, so it is discarded
(:class:`~async_rl.weights.reader.LeaseOutlasted`: the caller tries again, and a new lease is refused if the
version is gone).
The tensors it returns are views of the reader's buffers (pieces of several ranks assembled on the GPU), ready
for :meth:`~actors.generator.engine.Engine.stage_weights`. With ``copy`` the copy is made elsewhere (a vLLM worker
maps the learner's buffers itself, :func:`copy_buckets` there): this process takes the lease, checks the manifest
and the checksums the copy reports, and never touches CUDA (``device=None``).

:class:`~async_rl.weights.gpu.cuda_ipc.IpcUnavailable` says this process cannot use the path at all (another host
or namespace, a device it cannot see): the caller then reads versions through the host transport.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass

import redis.asyncio as aioredis
import torch

from async_rl.run.names import Names
from async_rl.weights.config import ReaderConfig
from async_rl.weights.gpu.checksum import ALIGN_BYTES, to_unsigned, wsum64
from async_rl.weights.gpu.cuda_ipc import (
    COPY_PRIORITY,
    IpcMapper,
    IpcUnavailable,
    fast_thread_handoffs,
    host_key,
    local_device,
)
from async_rl.weights.gpu.lease import HeldLease
from async_rl.weights.manifest import DTYPES, Manifest, ManifestTensor
from async_rl.weights.reader import (
    CorruptVersion,
    FetchedVersion,
    LeaseOutlasted,
    VersionUnavailable,
    read_manifest,
)
from async_rl.weights.signing import run_secret


@dataclass(frozen=True)
class RemoteCopied:
    """What a :data:`RemoteCopy` reports: every bucket's wsum64, and when it had read the learner's buffers."""

    sums: list[int]
    copied_at: float
    """``time.monotonic()`` (one clock for every process of a host, the only place a CUDA IPC copy runs) once the
    last byte was read from the learner's buffers: the lease has to last until then, not through what the copier
    does with its copy afterwards (a vLLM worker's first version of a slot is prepared for seconds)."""


RemoteCopy = Callable[[Manifest], Awaitable[RemoteCopied]]
"""Copies a GPU-held version somewhere else (e.g. inside a vLLM worker): :class:`RemoteCopied`."""


class GpuReader:
    """Fetches GPU-held versions over CUDA IPC into ``device`` (module docstring)."""

    redis: aioredis.Redis
    names: Names
    cfg: ReaderConfig
    device: torch.device | None
    """Where this process copies versions (None: it never does; every fetch passes ``copy``)."""
    reader_id: str
    hmac_key: bytes | None
    mapper: IpcMapper
    _stream: torch.cuda.Stream | None

    def __init__(self, redis: aioredis.Redis, names: Names, device: torch.device | str | None,
                 cfg: ReaderConfig | None = None, reader_id: str | None = None) -> None:  # fmt: skip
        self.redis, self.names = redis, names
        self.device = None if device is None else torch.device(device)
        if self.device is not None and self.device.type != "cuda":
            raise IpcUnavailable(f"the GPU weight path needs a CUDA engine, not {self.device}")
        if self.device is not None and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.cfg = cfg or ReaderConfig()
        self.reader_id = reader_id or uuid.uuid4().hex
        self.hmac_key = run_secret(self.cfg.secret_file)
        self.mapper = IpcMapper()
        self._stream = None if self.device is None else copy_stream(self.device)
        fast_thread_handoffs()

    async def latest_version(self) -> int | None:
        raw = await self.redis.get(self.names.weights_gpu_latest)
        return None if raw is None else int(raw)

    async def fetch(self, version: int, copy: RemoteCopy | None = None) -> FetchedVersion:
        """``version`` copied into this reader's GPU and verified (module docstring); with ``copy``, copied by
        ``copy(manifest)`` (:class:`RemoteCopied`) and verified here: the result then has no tensors. The lease has to
        last until the learner's buffers were read (:attr:`RemoteCopied.copied_at` with ``copy``)."""
        t0 = time.perf_counter()
        n = self.names
        key = n.weights_gpu_manifest(version)
        lease = HeldLease(self.redis, key, n.weights_gpu_readers(version), self.reader_id, self.cfg.gpu_lease_ttl_s,
                          self.cfg.gpu_lease_max_s)  # fmt: skip
        if not await lease.take():
            raise VersionUnavailable(f"GPU-held weights version {version} is gone (the learner reused its buffers)")
        try:
            manifest = await read_manifest(self.redis, key, version, self.hmac_key, "GPU-held weights version",
                                           "is gone")  # fmt: skip
            if manifest.ipc is None:
                raise CorruptVersion(f"GPU-held weights version {version}: the manifest is not one of a GPU version")
            if manifest.ipc.host != host_key():
                raise IpcUnavailable("the learner's GPU buffers are on another host (or network/IPC namespace)")
            t1 = time.perf_counter()
            buffers: list[torch.Tensor] = []
            async with lease.renewed():
                if copy is not None:
                    copied = await copy(manifest)
                    sums, now = copied.sums, time.monotonic()
                    # A time outside the lease's span is another clock's (a time namespace): now, to be safe.
                    copied_at = copied.copied_at if lease.taken_at <= copied.copied_at <= now else now
                else:
                    buffers, sums = await asyncio.to_thread(self._copy, manifest)
                    copied_at = time.monotonic()
            transfer_s = time.perf_counter() - t1
            if copied_at >= lease.until:
                raise LeaseOutlasted(f"GPU-held weights version {version}: the copy read the learner's buffers "
                                     f"{copied_at - lease.taken_at:.2f} s after its lease was taken, past the lease "
                                     f"(gpu_lease_ttl_s={lease.ttl_s}, renewed for gpu_lease_max_s={lease.max_s} at "
                                     "most; the learner may have refilled the buffers); discarded")  # fmt: skip
        finally:
            await self.redis.zrem(n.weights_gpu_readers(version), self.reader_id)
        for b, got in zip(manifest.buckets, sums, strict=True):
            if got != b.checksum:
                raise CorruptVersion(f"GPU-held weights v{version} bucket {b.index}: wsum64 {got:#x} != manifest "
                                     f"{b.checksum:#x}")  # fmt: skip
        tensors: dict[str, torch.Tensor] = {}
        if copy is None:
            assert self.device is not None
            tensors = await asyncio.to_thread(assemble, manifest, buffers, self.device)
        return FetchedVersion(version, manifest, tensors, transfer_s, time.perf_counter() - t0, manifest.total_bytes,
                              (version,))  # fmt: skip

    def _copy(self, manifest: Manifest) -> tuple[list[torch.Tensor], list[int]]:
        if self.device is None or self._stream is None:
            raise RuntimeError("this GpuReader has no device: pass copy= to fetch")
        return copy_buckets(manifest, self.device, self.mapper, self._stream)

    def close(self) -> None:
        self.mapper.close()


def _piece(buffers: list[torch.Tensor], t: ManifestTensor, i: int) -> torch.Tensor:
    p = t.pieces[i]
    if p.nbytes == 0:
        return torch.empty(p.shape(t.shape), dtype=DTYPES[t.dtype], device=buffers[0].device if buffers else "cpu")
    return _bytes_as(buffers[p.bucket], t, i)


def _bytes_as(bucket: torch.Tensor, t: ManifestTensor, i: int) -> torch.Tensor:
    """Piece ``i`` of ``t`` as a view of its bucket's bytes."""
    p = t.pieces[i]
    return bucket[p.offset : p.offset + p.nbytes].view(DTYPES[t.dtype]).view(p.shape(t.shape))


def _place(full: torch.Tensor, t: ManifestTensor, i: int) -> torch.Tensor:
    """Where piece ``i`` of ``t`` goes in ``full`` (a view)."""
    p = t.pieces[i]
    return full if t.whole else full.narrow(p.dim, p.start, p.length)


def copy_stream(device: torch.device) -> torch.cuda.Stream:
    """The side stream :func:`copy_buckets` copies and checks on, with the one-time costs of a first copy paid now,
    before any lease: the table of this process's devices, the stream, the checksum's first kernels and its column
    multipliers. A vLLM worker's first copy of moe-5b took 0.65-0.98 s against 0.04 s for the next ones; taken
    inside a 2 s lease, such costs made a first version outlast it."""
    local_device("")  # builds this process's table of devices (cached)
    stream = torch.cuda.Stream(device=device, priority=COPY_PRIORITY)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        int(wsum64(torch.zeros(ALIGN_BYTES, dtype=torch.uint8, device=device)))
    return stream


@functools.cache
def _side_stream(device_index: int, k: int) -> torch.cuda.Stream:
    """The ``k``-th extra stream :func:`copy_buckets` copies on, on that device (made once)."""
    return torch.cuda.Stream(device=device_index, priority=COPY_PRIORITY)


def copy_buckets(manifest: Manifest, device: torch.device, mapper: IpcMapper, stream: torch.cuda.Stream,
                 into: list[torch.Tensor] | None = None, then: Callable[[int], None] | None = None,
                 ) -> tuple[list[torch.Tensor], list[int]]:  # fmt: skip
    """Map, copy into buffers on ``device`` (fresh ones, or ``into``: one per bucket, of its size) and checksum
    every bucket of a GPU-held version; waits once. Returns the buffers and each bucket's wsum64 (for the caller to
    compare with the manifest).

    The buckets of each source GPU (a learner rank's) arrive on a stream of their own, side by side: ``stream`` for
    the first, :func:`_side_stream` for the others, each starting after the work queued on ``stream`` so far. (torch
    runs a copy between GPUs on the source GPU's current stream, fenced both ways with the destination's current
    stream: on one destination stream every bucket's copy, checksum and assembly waited for the one before.) The
    copies alone are bound by the destination's links either way (moe-5b's 10.1 GB from two H200s in 28 ms, 390 GB/s:
    scripts/gpu/copy_costs.py); side by side, one source's checksums and assembly run beside the other's copies. Each
    bucket's checksum is queued after its copy on the same stream, and ``then(i)`` too where given (what the caller
    does with bucket ``i`` once it is here, e.g. assembling its pieces: on the current stream)."""
    assert manifest.ipc is not None
    with torch.cuda.device(device), torch.cuda.stream(stream):
        sources = mapper.open_all(manifest.ipc.handles, [b.nbytes for b in manifest.buckets])
        if into is None:
            buffers = [torch.empty(b.nbytes, dtype=torch.uint8, device=device) for b in manifest.buckets]
        else:
            assert [t.numel() for t in into] == [b.nbytes for b in manifest.buckets], "buffers of other sizes"
            buffers = into
        by_source: dict[int | None, list[int]] = {}
        for i, src in enumerate(sources):
            by_source.setdefault(src.device.index, []).append(i)
        index = device.index if device.index is not None else torch.cuda.current_device()
        streams = [stream, *(_side_stream(index, k) for k in range(1, len(by_source)))]
        for side in streams[1:]:
            side.wait_stream(stream)  # after what the caller queued: a load still reading these buffers, their making
        sums: dict[int, torch.Tensor] = {}
        for on, indices in zip(streams, by_source.values(), strict=True):
            with torch.cuda.stream(on):
                for i in indices:
                    buffers[i].copy_(sources[i], non_blocking=True)
                    sums[i] = wsum64(buffers[i])
                    if then is not None:
                        then(i)
        for side in streams[1:]:
            stream.wait_stream(side)
        ordered = [sums[i] for i in range(len(buffers))]
        host = torch.stack(ordered).cpu() if ordered else torch.zeros(0, dtype=torch.int64)
    return buffers, [to_unsigned(int(x)) for x in host.tolist()]


def pieces_by_bucket(manifest: Manifest) -> dict[int, list[tuple[ManifestTensor, int]]]:
    """Every piece with bytes, as ``(tensor, piece index)``, by the bucket holding it."""
    out: dict[int, list[tuple[ManifestTensor, int]]] = {}
    for t in manifest.tensors:
        for i, p in enumerate(t.pieces):
            if p.nbytes:
                out.setdefault(p.bucket, []).append((t, i))
    return out


class BucketAssembly:
    """Each bucket's pieces copied to their places in tensors that :func:`assemble` with ``own`` made (``into``), as
    the bucket arrives (``then`` of :func:`copy_buckets`): one batched copy a bucket (``torch._foreach_copy_``), its
    views of ``buckets`` and ``into`` made once. Piece by piece, a version of moe-5b was some 350 kernels and several
    torch calls each, from a thread beside the vLLM engine core's (each call lets go of the interpreter's lock and
    waits for it again) onto a GPU that decodes meanwhile (each kernel waits for SMs): its copy took 86 ms, 60 in
    batches, against 52 from the engine core's own thread while it stood still (four H200s)."""

    def __init__(self, manifest: Manifest, buckets: list[torch.Tensor], into: Mapping[str, torch.Tensor]) -> None:
        self.buckets, self.into = buckets, into
        self._copies: dict[int, tuple[list[torch.Tensor], list[torch.Tensor]]] = {}
        for b, pieces in pieces_by_bucket(manifest).items():
            dsts, srcs = self._copies.setdefault(b, ([], []))
            for t, i in pieces:
                dsts.append(_place(into[t.name], t, i))
                srcs.append(_bytes_as(buckets[b], t, i))

    def serves(self, buckets: list[torch.Tensor], into: Mapping[str, torch.Tensor]) -> bool:
        """Made for these very buckets and tensors (the views it holds are theirs)."""
        return buckets is self.buckets and into is self.into

    def __call__(self, bucket: int) -> None:
        """Bucket ``bucket``'s pieces into their places, on the current stream."""
        copies = self._copies.get(bucket)
        if copies is not None:
            torch._foreach_copy_(*copies)


def assemble(manifest: Manifest, buffers: list[torch.Tensor], device: torch.device,
             into: Mapping[str, torch.Tensor] | None = None, own: bool = False) -> dict[str, torch.Tensor]:  # fmt: skip
    """Each tensor a view of its bucket, or assembled on ``device`` from the pieces of several ranks: into new
    tensors, or into ``into``'s (the tensors an earlier call assembled for a version of the same layout). With
    ``own``, whole tensors are copied out of the buckets too (the buckets may then take the next version)."""
    out: dict[str, torch.Tensor] = {}
    assembling = False
    with torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext():
        for t in manifest.tensors:
            if t.whole and not own:
                out[t.name] = _piece(buffers, t, 0)
                continue
            assembling = True
            full = into[t.name] if into is not None else torch.empty(t.shape, dtype=DTYPES[t.dtype], device=device)
            for i in range(len(t.pieces)):
                _place(full, t, i).copy_(_piece(buffers, t, i))
            out[t.name] = full
        if assembling and device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()
    return out
