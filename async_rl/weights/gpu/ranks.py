"""Every learner rank keeps its own pieces of a version in its own GPU slots: no gather, rank 0 writes the manifest.

:class:`DistributedGpuSlots` wraps one rank's :class:`~async_rl.weights.gpu.slots.GpuSlots` for a
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

**Other hosts** get the versions through the host transport, fed on rank 0 without a collective: when every rank is
on rank 0's host and its GPU is visible there, :attr:`DistributedGpuSlots.whole` is a :class:`RankMirror`, every
rank's slot as one whole version on rank 0's GPU (its own buckets as they are, the others' copied GPU to GPU over CUDA
IPC, as any same-host reader does, one bucket at a time into one reused buffer as the encoder reads them), which
:mod:`.gpu_encoder` encodes as it does one rank's slots. The ranks train on meanwhile: the slot stays held until the
copies are done. Ranks on other hosts: None, and the host transport gets
the gathered weights (:mod:`.gpu_publisher`).
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Callable

import torch

from async_rl.weights.gpu.checksum import padded
from async_rl.weights.gpu.cuda_ipc import IpcHandle, IpcMapper, device_uuid, host_key, local_device
from async_rl.weights.gpu.slots import GpuFill, GpuSlots, Placed
from async_rl.weights.manifest import BucketEntry, ManifestTensor, merge_rank_tensors
from async_rl.weights.snapshot import Piece

log = logging.getLogger(__name__)


class RankMirror:
    """Every rank's slot of a version as one whole version on rank 0's GPU (module docstring): rank 0's buckets as
    they are, each of the other ranks' copied into one reused buffer as the encoder reads it."""

    local: GpuSlots
    placed: list[Placed]
    """Every rank's pieces, bucket indices global (rank ``r``'s from ``sum(counts[:r])``)."""
    _sizes: list[list[int]]
    _remote: Callable[[int], list[torch.Tensor]]
    _sources: dict[int, list[torch.Tensor]]
    """Slot -> the other ranks' buckets of it, mapped once."""
    _staging: torch.Tensor | None
    _copies: list[torch.Tensor] | None
    """Every other rank's buckets at once (the host publisher's CPU path only)."""

    def __init__(self, local: GpuSlots, placed: list[list[Placed]], sizes: list[list[int]],
                 remote: Callable[[int], list[torch.Tensor]]) -> None:  # fmt: skip
        """``placed``/``sizes``: every rank's pieces and bucket sizes (rank 0's are ``local``'s); ``remote(slot)``: the
        other ranks' buckets of ``slot`` in rank order, as this process sees them (mapped over CUDA IPC)."""
        self.local, self._sizes, self._remote = local, sizes, remote
        self.placed = []
        first = 0
        for rank_placed, rank_sizes in zip(placed, sizes, strict=True):
            self.placed += [dataclasses.replace(x, bucket=x.bucket + first) for x in rank_placed]
            first += len(rank_sizes)
        self._sources = {}
        self._staging = self._copies = None

    @property
    def device(self) -> torch.device:
        return self.local.device

    @property
    def device_bytes(self) -> int:
        """GPU bytes held for the other ranks' buckets."""
        held = [self._staging] if self._staging is not None else []
        return sum(b.numel() for b in held + (self._copies or []))

    @property
    def bucket_nbytes(self) -> list[int]:
        return [padded(n) for rank_sizes in self._sizes for n in rank_sizes]

    def _others(self, slot: int) -> list[torch.Tensor]:
        if slot not in self._sources:
            self._sources[slot] = self._remote(slot)
        return self._sources[slot]

    def bucket_reader(self, slot: int) -> Callable[[int], torch.Tensor]:
        """Bucket ``i`` of ``slot``: rank 0's as it is, another rank's copied GPU to GPU into the one reused buffer
        (queued on the current stream; valid until the next call)."""
        own, others = self.local.buffers(slot), self._others(slot)
        largest = max((b.numel() for b in others), default=0)
        if self._staging is None or self._staging.numel() < largest:
            self._staging = None
            self._staging = torch.empty(largest, dtype=torch.uint8, device=self.device)
        staging = self._staging

        def read(i: int) -> torch.Tensor:
            if i < len(own):
                return own[i]
            src = others[i - len(own)]
            dst = staging[: src.numel()]
            dst.copy_(src, non_blocking=True)
            return dst

        return read

    def buffers(self, slot: int) -> list[torch.Tensor]:
        """Every rank's buckets of ``slot`` on this GPU at once (copies of the other ranks', queued on the current
        stream): what the CPU path snapshots."""
        if self._copies is None:
            self._copies = [torch.empty(padded(n), dtype=torch.uint8, device=self.device)
                            for rank_sizes in self._sizes[1:] for n in rank_sizes]  # fmt: skip
        for dst, src in zip(self._copies, self._others(slot), strict=True):
            dst.copy_(src, non_blocking=True)
        return list(self.local.buffers(slot)) + self._copies

    def tensors(self, slot: int) -> list[Piece]:
        """The version's tensors from every rank's pieces of ``slot`` (the host publisher's CPU path takes one piece a
        tensor): a tensor of one piece a view of this GPU's buckets, one of several the pieces joined (a copy)."""
        bufs = self.buffers(slot)
        by_name: dict[str, list[Placed]] = {}
        for x in self.placed:
            by_name.setdefault(x.name, []).append(x)
        out = []
        for name, xs in by_name.items():
            if len(xs) == 1:
                out.append(xs[0].piece(bufs))
                continue
            xs.sort(key=lambda x: x.start)
            joined = torch.cat([x.view(bufs) for x in xs], dim=xs[0].dim)
            if tuple(joined.shape) != xs[0].full_shape:
                raise ValueError(f"weights: the ranks' pieces of {name!r} make {tuple(joined.shape)}, not "
                                 f"{xs[0].full_shape}")  # fmt: skip
            out.append(Piece(name, joined))
        if self.device.type == "cuda":
            torch.cuda.current_stream(self.device).synchronize()
        return out


class DistributedGpuSlots:
    """One rank's GPU slots in a distributed learner; rank 0 also holds every rank's manifest parts."""

    local: GpuSlots
    rank: int
    world: int
    group: object
    counts: list[int]
    """Buckets of each rank (after the first fill)."""
    _placed: list[list[Placed]]
    _sizes: list[list[int]]
    _places: list[tuple[str, str | None]]
    """Each rank's host (:func:`host_key`) and GPU (UUID; None on the CPU)."""
    _handles: dict[int, list[IpcHandle]]
    _mirror: RankMirror | None
    _checked: bool
    """Whether rank 0 looked for every rank's GPU on its host (once)."""
    _mapper: IpcMapper | None

    def __init__(self, local: GpuSlots, group: object = None) -> None:
        self.local = local
        self.group = group
        self.rank = torch.distributed.get_rank(group)  # type: ignore[arg-type]
        self.world = torch.distributed.get_world_size(group)  # type: ignore[arg-type]
        self.counts = []
        self._placed = []
        self._sizes = []
        self._places = []
        self._handles = {}
        self._mirror = None
        self._checked = False
        self._mapper = None

    @property
    def num_slots(self) -> int:
        return self.local.num_slots

    @property
    def device_bytes(self) -> int:
        return self.local.device_bytes + (self._mirror.device_bytes if self._mirror is not None else 0)

    @property
    def whole(self) -> RankMirror | None:
        """Rank 0, after the first fill, with every rank's GPU on its host and visible to it: every rank's slot as one
        version on its GPU (:class:`RankMirror`); else None (module docstring)."""
        if self._checked or self.rank != 0 or not self.counts or self.local.device.type != "cuda":
            return self._mirror
        self._checked = True
        away = self.unmappable(self._places, self.counts, host_key(), local_device)
        if away:
            log.warning("weights: ranks %s are not on this host or their GPUs are not visible to rank 0: the host "
                        "transport gets the versions gathered to rank 0", away)  # fmt: skip
            return None
        self._mapper = IpcMapper()
        self._mirror = RankMirror(self.local, self._placed, self._sizes, self._remote)
        return self._mirror

    @staticmethod
    def unmappable(places: list[tuple[str, str | None]], counts: list[int], here: str,
                   local: Callable[[str], int | None]) -> list[int]:  # fmt: skip
        """The ranks with buckets whose GPU rank 0 cannot map: on another host (``places[r]``: host key, GPU UUID),
        or not visible to it (``local``: UUID -> device index or None). Ranks without buckets (replicas) need none."""
        return [r for r, ((host, gpu), n) in enumerate(zip(places, counts, strict=True))
                if n and (host != here or gpu is None or local(gpu) is None)]  # fmt: skip

    def drop_whole(self, reason: str) -> bool:
        """Give the mirror up (it found no GPU memory, or could not map a rank's buffers): the host transport gets the
        gathered weights from now on. False when there was none."""
        if self._mirror is None:
            return False
        log.warning("weights: rank 0 stops copying the other ranks' slots for the host transport (%s); it gets the "
                    "versions gathered to rank 0 from now on", reason)  # fmt: skip
        self._mirror = None
        if self._mapper is not None:
            self._mapper.close()
        return True

    def _remote(self, slot: int) -> list[torch.Tensor]:
        """The other ranks' buckets of ``slot`` in rank order, mapped in this process over CUDA IPC (kept mapped)."""
        assert self._mapper is not None
        handles = self._handles[slot][self.counts[0] :]
        return self._mapper.open_all(handles, [padded(n) for sizes in self._sizes[1:] for n in sizes])

    def _exchange(self, obj: object) -> list:
        out: list = [None] * self.world
        torch.distributed.all_gather_object(out, obj, group=self.group)  # type: ignore[arg-type]
        return out

    def fill(self, slot: int, version: int, pieces: list[Piece]) -> GpuFill:
        """Every rank, together: copy this rank's ``pieces`` into ``slot`` (module docstring)."""
        self.local.plan(pieces)
        if not self.counts:
            device = self.local.device
            gpu = device_uuid(device) if device.type == "cuda" else None
            everyone = self._exchange((self.local.placed, self.local.bucket_sizes, host_key(), gpu))
            self._placed = [p for p, _, _, _ in everyone]
            self._sizes = [s for _, s, _, _ in everyone]
            self._places = [(h, g) for _, _, h, g in everyone]
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
        for r, (placed, sizes) in enumerate(zip(self._placed, self._sizes, strict=True)):
            tensors_by_rank.append([x.entry(first + x.bucket, x.offset, x.nbytes, rank=r) for x in placed])
            buckets += GpuSlots.bucket_entries(sizes, sums[first : first + len(sizes)], first)
            first += len(sizes)
        return merge_rank_tensors(tensors_by_rank), buckets

    def handles(self, slot: int) -> list[IpcHandle]:
        """Rank 0: every rank's bucket handles of ``slot``, in global bucket order."""
        return self._handles[slot]

    def tensors(self, slot: int) -> list[Piece]:
        return self.local.tensors(slot)
