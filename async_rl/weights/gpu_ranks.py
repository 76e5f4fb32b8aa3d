"""Every learner rank keeps its own pieces of a version in its own GPU slots: no gather, rank 0 writes the manifest.

:class:`DistributedGpuSlots` wraps one rank's :class:`~async_rl.weights.gpu_slots.GpuSlots` for a
``torch.distributed`` job. Every rank calls :meth:`DistributedGpuSlots.fill` with the same slot and version and
its own pieces (its tensor-parallel slices, pipeline stage, expert-parallel experts: the Megatron backend's
``rank_export``), at the same step boundary:

* the first time, the ranks exchange what never changes (their manifest parts, bucket sizes; per slot, their
  buckets' CUDA IPC handles) with ``all_gather_object``: once per slot for the whole run;
* every version, the buckets' checksums travel with one ``all_gather_into_tensor`` queued on the slots' side
  stream, after the copies and the checksums: nobody waits on the host, and rank 0's event says when every
  rank's checksums are in its pinned memory.

Rank 0 then has everything a manifest needs (:meth:`manifest_parts`, :meth:`handles`): bucket ``i`` of rank
``r`` is global bucket ``sum(counts[:r]) + i``, and a reader on the host maps each rank's buffers itself.
"""

from __future__ import annotations

import itertools

import torch

from async_rl.weights.cuda_ipc import IpcHandle
from async_rl.weights.gpu_slots import GpuFill, GpuSlots
from async_rl.weights.manifest import BucketEntry, ManifestTensor, PieceEntry, merge_rank_tensors
from async_rl.weights.snapshot import Piece


class DistributedGpuSlots:
    """One rank's GPU slots in a distributed learner; rank 0 also holds every rank's manifest parts."""

    local: GpuSlots
    rank: int
    world: int
    group: object
    counts: list[int]
    """Buckets of each rank (after the first fill)."""
    _parts: list[list[ManifestTensor]]
    _sizes: list[list[int]]
    _handles: dict[int, list[IpcHandle]]

    def __init__(self, local: GpuSlots, group: object = None) -> None:
        self.local = local
        self.group = group
        self.rank = torch.distributed.get_rank(group)  # type: ignore[arg-type]
        self.world = torch.distributed.get_world_size(group)  # type: ignore[arg-type]
        self.counts = []
        self._parts = []
        self._sizes = []
        self._handles = {}

    @property
    def num_slots(self) -> int:
        return self.local.num_slots

    @property
    def device_bytes(self) -> int:
        return self.local.device_bytes

    @property
    def whole(self) -> GpuSlots | None:
        """Rank 0's slots hold only its own pieces: the host publisher cannot be fed from them."""
        return None

    def _exchange(self, obj: object) -> list:
        out: list = [None] * self.world
        torch.distributed.all_gather_object(out, obj, group=self.group)  # type: ignore[arg-type]
        return out

    def fill(self, slot: int, version: int, pieces: list[Piece]) -> GpuFill:
        """Every rank, together: copy this rank's ``pieces`` into ``slot`` (module docstring)."""
        self.local.plan(pieces)
        if not self.counts:
            sizes = self.local.bucket_sizes
            tensors, _ = self.local.manifest_parts([0] * len(sizes))
            everyone = self._exchange((tensors, sizes))
            self._parts = [t for t, _ in everyone]
            self._sizes = [s for _, s in everyone]
            self.counts = [len(s) for s in self._sizes]
        if not self.local.allocated(slot):
            self.local.allocate(slot)
            self._handles[slot] = list(itertools.chain.from_iterable(self._exchange(self.local.handles(slot))))
        most = max(self.counts)

        def gather(sums: torch.Tensor) -> torch.Tensor:  # on the side stream, after the checksums
            mine = torch.zeros(most, dtype=torch.int64, device=sums.device)
            mine[: sums.numel()] = sums
            every = torch.empty(most * self.world, dtype=torch.int64, device=sums.device)
            torch.distributed.all_gather_into_tensor(every, mine, group=self.group)  # type: ignore[arg-type]
            return torch.cat([every[r * most : r * most + n] for r, n in enumerate(self.counts)])

        return self.local.fill(slot, version, pieces, gather=gather)

    def manifest_parts(self, sums: list[int]) -> tuple[list[ManifestTensor], list[BucketEntry]]:
        """Rank 0: the whole version's tensors (every rank's pieces) and buckets, from every rank's checksums."""
        tensors_by_rank: list[list[ManifestTensor]] = []
        buckets: list[BucketEntry] = []
        first = 0
        for r, (parts, sizes) in enumerate(zip(self._parts, self._sizes, strict=True)):
            shift = first
            tensors_by_rank.append([
                ManifestTensor(t.name, t.dtype, t.shape, [
                    PieceEntry(p.bucket + shift, p.offset, p.nbytes, p.checksum, p.dim, p.start, p.length, p.encoding, r)
                    for p in t.pieces])
                for t in parts
            ])  # fmt: skip
            buckets += GpuSlots.bucket_entries(sizes, sums[first : first + len(sizes)], first)
            first += len(sizes)
        return merge_rank_tensors(tensors_by_rank), buckets

    def handles(self, slot: int) -> list[IpcHandle]:
        """Rank 0: every rank's bucket handles of ``slot``, in global bucket order."""
        return self._handles[slot]

    def tensors(self, slot: int) -> list[Piece]:
        return self.local.tensors(slot)
