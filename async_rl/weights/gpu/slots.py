"""A rank's weight versions kept in its own GPU memory: a few slots of buckets, filled on a side stream.

:class:`GpuSlots` plans the rank's pieces into buckets once (Hugging Face names, in the dtype the generators
run, each piece at a 64-byte aligned offset, every bucket padded with zeros to a multiple of 4 KiB for
:mod:`.gpu_checksum`), allocates ``num_slots`` sets of those buckets on first use, and exports each bucket
once over CUDA IPC (:mod:`.cuda_ipc`). :meth:`GpuSlots.fill` copies the pieces into a slot:

* on a side stream that first waits for the work already queued on the current stream (the optimizer's last
  writes), so the training thread never waits on the host; of high priority (``cuda_ipc.COPY_PRIORITY``), so the
  next step's kernels, queued meanwhile, do not hold its copies and checksums back;
* the current stream then waits for the copies only (not for the checksums), so the next optimizer step can
  not change a weight before it is copied;
* the buckets' checksums are computed on the same side stream and copied to pinned host memory; the returned
  :class:`GpuFill`'s event says when they (and the copies) are done.

What a slot holds stays valid until the slot is filled again: :mod:`.gpu_publisher` decides when that is safe
(no reader lease on the version it holds). The CPU path works too (no stream, no export), for tests.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

import torch

from async_rl.weights.gpu.checksum import padded, to_unsigned, wsum64
from async_rl.weights.gpu.cuda_ipc import COPY_PRIORITY, IpcHandle, export
from async_rl.weights.manifest import DTYPE_NAMES, BucketEntry, ManifestTensor, PieceEntry, plan_sizes
from async_rl.weights.snapshot import Piece

PieceSource = Iterable[Piece | tuple[str, torch.Tensor]] | Callable[[], Iterable[Piece | tuple[str, torch.Tensor]]]
"""A rank's pieces (or (name, tensor) pairs of whole tensors), or a callable that gives them."""


class GpuExport(Protocol):
    """Where a learner's GPU-held versions live: one process's :class:`GpuSlots`, or every rank's
    (:class:`~async_rl.weights.gpu.ranks.DistributedGpuSlots` behind a backend's command)."""

    @property
    def num_slots(self) -> int: ...

    @property
    def device_bytes(self) -> int: ...

    @property
    def whole(self) -> WholeVersion | None:
        """Where this process finds a slot's whole version on its GPU (the host publisher is fed from it, encoded on
        the GPU by :mod:`.gpu_encoder`): its own slots, rank 0's mirror of every rank's
        (:class:`~async_rl.weights.gpu.ranks.RankMirror`), or None (the host transport gets the gathered weights)."""

    def drop_whole(self, reason: str) -> bool:
        """Stop offering :attr:`whole` where it costs more than the slots (rank 0's mirror, which found no GPU memory or
        could not map a rank's buffers): True when it was given up, False when there is nothing to give up."""

    def fill(self, slot: int, version: int, source: PieceSource) -> GpuFill: ...

    def manifest_parts(self, sums: list[int]) -> tuple[list[ManifestTensor], list[BucketEntry]]: ...

    def handles(self, slot: int) -> list[IpcHandle]: ...

    def tensors(self, slot: int) -> list[Piece]: ...


class WholeVersion(Protocol):
    """A whole version held in a slot on this process's GPU, as buckets of placed pieces (what :mod:`.gpu_encoder`
    reads): :class:`GpuSlots` of one rank, or rank 0's mirror of every rank's."""

    @property
    def device(self) -> torch.device: ...

    @property
    def placed(self) -> list[Placed]: ...

    @property
    def bucket_nbytes(self) -> list[int]:
        """Each bucket's size (padded), in :attr:`placed`'s bucket numbering."""

    def bucket_reader(self, slot: int) -> Callable[[int], torch.Tensor]:
        """A function giving bucket ``i`` of ``slot`` on :attr:`device` (flat uint8, padded), ready for work queued
        on the current stream after the call, and valid until the next call (buckets read one at a time, in order)."""

    def tensors(self, slot: int) -> list[Piece]:
        """The version's pieces of ``slot`` on :attr:`device` (for the host publisher's CPU path)."""


@dataclass(slots=True)
class Placed:
    """Where one piece goes: its bucket and offset, and its place in the full tensor."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    """The piece's own shape."""
    full_shape: tuple[int, ...]
    dim: int
    start: int
    length: int
    """-1: the whole tensor."""
    bucket: int
    offset: int
    nbytes: int

    def view(self, buffers: list[torch.Tensor]) -> torch.Tensor:
        """The piece in ``buffers`` (a slot's buckets), in its dtype and shape."""
        return buffers[self.bucket][self.offset : self.offset + self.nbytes].view(self.dtype).view(self.shape)

    def piece(self, buffers: list[torch.Tensor]) -> Piece:
        """The piece in ``buffers`` as a :class:`Piece` (a view)."""
        return Piece(self.name, self.view(buffers), None if self.length < 0 else self.full_shape, self.dim, self.start)

    def entry(self, bucket: int, offset: int, nbytes: int, checksum: int = 0, encoding: str = "raw",
              rank: int = 0) -> ManifestTensor:  # fmt: skip
        """Its tensor in a manifest: this one piece, its payload of ``nbytes`` at ``offset`` in ``bucket`` (a ``raw``
        piece where it lies in the slot: checksum 0, the bucket's covers it)."""
        sliced = self.length >= 0
        return ManifestTensor(self.name, DTYPE_NAMES[self.dtype], self.full_shape, [
            PieceEntry(bucket, offset, nbytes, checksum, self.dim if sliced else 0, self.start if sliced else 0,
                       self.length, encoding, rank)])  # fmt: skip


@dataclass(slots=True)
class GpuFill:
    """One version copied into a slot; its checksums are ready once ``event`` has completed."""

    version: int
    slot: int
    taken_at: float
    """Unix time the copy was queued."""
    block_s: float
    """Seconds the caller spent queueing it (what the training loop waited)."""
    event: torch.cuda.Event | None
    """Recorded after the checksums on the side stream (None on the CPU: done already)."""
    sums: torch.Tensor
    """int64 ``[num_buckets]`` in (pinned) host memory: valid after ``event``."""

    def wait(self) -> list[int]:
        """Block until the copy and the checksums are done; the checksums, unsigned."""
        if self.event is not None:
            self.event.synchronize()
        return [to_unsigned(int(x)) for x in self.sums.tolist()]


class GpuSlots:
    """``num_slots`` versions of one rank's pieces in GPU buckets (see the module docstring)."""

    device: torch.device
    num_slots: int
    bucket_bytes: int
    dtype: torch.dtype | None
    rank: int
    placed: list[Placed]
    bucket_sizes: list[int]
    """Bytes of each bucket the pieces use (the buffers are padded past it)."""
    _key: tuple | None
    _buffers: list[list[torch.Tensor] | None]
    _views: list[list[torch.Tensor]]
    _handles: list[list[IpcHandle]]
    _stream: torch.cuda.Stream | None

    def __init__(self, device: torch.device | str, *, num_slots: int = 2, bucket_bytes: int = 1 << 30,
                 dtype: torch.dtype | None = None, rank: int = 0) -> None:  # fmt: skip
        if num_slots < 1:
            raise ValueError("publisher.gpu_slots must be >= 1")
        self.device = torch.device(device)
        self.num_slots = num_slots
        self.bucket_bytes = bucket_bytes
        self.dtype = dtype
        self.rank = rank
        self.placed = []
        self.bucket_sizes = []
        self._key = None
        self._buffers = [None] * num_slots
        self._views = [[] for _ in range(num_slots)]
        self._handles = [[] for _ in range(num_slots)]
        self._stream = None

    @property
    def device_bytes(self) -> int:
        """GPU bytes held by the allocated slots."""
        return sum(b.numel() for bufs in self._buffers if bufs is not None for b in bufs)

    def plan(self, pieces: list[Piece]) -> None:
        """Place ``pieces`` in buckets (the first time; later: ValueError when they changed)."""
        key = tuple((p.name, tuple(p.tensor.shape), p.tensor.dtype, p.full_shape, p.dim, p.start) for p in pieces)
        if self._key is not None:
            if key != self._key:
                raise ValueError("weights: the pieces' names, shapes or dtypes changed during the run; the GPU slots "
                                 "were planned for the first version")  # fmt: skip
            return
        placed = []
        for p in pieces:
            p.check()
            dtype = self.dtype if self.dtype is not None and p.tensor.is_floating_point() else p.tensor.dtype
            if dtype not in DTYPE_NAMES:
                raise ValueError(f"weights: tensor {p.name!r} has unsupported dtype {dtype}")
            shape = tuple(p.tensor.shape)
            full = shape if p.whole else tuple(p.full_shape or ())
            length = -1 if p.whole else shape[p.dim]
            nbytes = p.tensor.numel() * dtype.itemsize
            placed.append(Placed(p.name, dtype, shape, full, p.dim, p.start, length, 0, 0, nbytes))
        places, sizes = plan_sizes([x.nbytes for x in placed], self.bucket_bytes)
        for x, (bucket, offset) in zip(placed, places, strict=True):
            x.bucket, x.offset = bucket, offset
        self.placed, self.bucket_sizes, self._key = placed, sizes, key

    def allocated(self, slot: int) -> bool:
        return self._buffers[slot] is not None

    def allocate(self, slot: int) -> list[torch.Tensor]:
        """The slot's buckets, allocated (and exported) the first time."""
        bufs = self._buffers[slot]
        if bufs is None:
            bufs = [torch.zeros(padded(n), dtype=torch.uint8, device=self.device) for n in self.bucket_sizes]
            self._buffers[slot] = bufs
            self._views[slot] = [x.view(bufs) for x in self.placed]
            if self.device.type == "cuda":
                self._handles[slot] = [export(b) for b in bufs]
        return bufs

    def buffers(self, slot: int) -> list[torch.Tensor]:
        """The buckets of a filled slot (flat uint8, padded with zeros)."""
        bufs = self._buffers[slot]
        if bufs is None:
            raise ValueError(f"weights: GPU slot {slot} was never filled")
        return bufs

    def handles(self, slot: int) -> list[IpcHandle]:
        """The IPC handles of a filled slot's buckets (CUDA only)."""
        return self._handles[slot]

    @property
    def whole(self) -> GpuSlots | None:
        """These slots hold whole versions (one rank's slots, all of its pieces)."""
        return self

    def drop_whole(self, reason: str) -> bool:
        """One rank's slots cost nothing more as a whole version: nothing to give up."""
        return False

    @property
    def bucket_nbytes(self) -> list[int]:
        return [padded(n) for n in self.bucket_sizes]

    def bucket_reader(self, slot: int) -> Callable[[int], torch.Tensor]:
        return self.buffers(slot).__getitem__

    def tensors(self, slot: int) -> list[Piece]:
        """The pieces as views of a filled slot (valid until the slot is filled again)."""
        return [x.piece(self.buffers(slot)) for x in self.placed]

    def manifest_parts(self, sums: list[int], first_bucket: int = 0) -> tuple[list[ManifestTensor], list[BucketEntry]]:
        """This rank's tensors (raw pieces; their checksum is the bucket's) and buckets, indices from ``first_bucket``."""
        tensors = [x.entry(first_bucket + x.bucket, x.offset, x.nbytes, rank=self.rank) for x in self.placed]
        return tensors, self.bucket_entries(self.bucket_sizes, sums, first_bucket)

    @staticmethod
    def bucket_entries(sizes: list[int], sums: list[int], first_bucket: int = 0) -> list[BucketEntry]:
        """Buckets of the given used sizes (padded as allocated) and checksums, indices from ``first_bucket``."""
        return [BucketEntry(first_bucket + i, padded(n), s) for i, (n, s) in enumerate(zip(sizes, sums, strict=True))]

    def fill(self, slot: int, version: int, source: PieceSource,
             gather: Callable[[torch.Tensor], torch.Tensor] | None = None) -> GpuFill:  # fmt: skip
        """Copy ``source`` (this rank's pieces, or a callable giving them) into ``slot`` and queue their checksums
        (module docstring).
        ``gather``: called on the side stream with this rank's checksums (int64, on the GPU); what it returns (every
        rank's, on rank 0) is what reaches the host."""
        t0 = time.perf_counter()
        taken_at = time.time()
        items = source() if callable(source) else source
        pieces = [p if isinstance(p, Piece) else Piece(p[0], p[1]) for p in items]
        names = [p.name for p in pieces]
        if len(set(names)) != len(names):
            raise ValueError("weights: a rank gave the same piece twice")
        self.plan(pieces)
        bufs = self.allocate(slot)
        views = self._views[slot]
        cuda = self.device.type == "cuda"
        if not cuda:
            with torch.no_grad():
                for v, p in zip(views, pieces, strict=True):
                    v.copy_(p.tensor.detach())
            sums = torch.stack([wsum64(b) for b in bufs]) if bufs else torch.zeros(0, dtype=torch.int64)
            return GpuFill(version, slot, taken_at, time.perf_counter() - t0, None, gather(sums) if gather else sums)
        if self._stream is None:
            self._stream = torch.cuda.Stream(device=self.device, priority=COPY_PRIORITY)
        stream = self._stream
        current = torch.cuda.current_stream(self.device)
        stream.wait_stream(current)  # after the optimizer's last writes
        copied = torch.cuda.Event()
        done = torch.cuda.Event()
        with torch.no_grad(), torch.cuda.stream(stream):
            for v, p in zip(views, pieces, strict=True):
                src = p.tensor.detach()
                v.copy_(src, non_blocking=True)
                if src.device.type == "cuda":
                    src.record_stream(stream)  # a temporary (a converted tensor) is not reused before the copy ran
            copied.record(stream)
            sums = torch.stack([wsum64(b) for b in bufs]) if bufs else torch.zeros(0, dtype=torch.int64, device=self.device)
            if gather is not None:
                sums = gather(sums)
            host = torch.empty(sums.numel(), dtype=torch.int64, pin_memory=True)
            host.copy_(sums, non_blocking=True)
            done.record(stream)
        current.wait_event(copied)  # the next optimizer step waits for the copies, never the host
        return GpuFill(version, slot, taken_at, time.perf_counter() - t0, done, host)
