"""Every Megatron rank keeps its own pieces of each version in its own GPU slots: the GPU weight path, no gather.

Rank 0's :class:`~async_rl.weights.gpu_publisher.GpuPublisher` asks for a version through
:class:`MegatronGpuExport`: one backend command (``gpu_fill``) makes every rank copy its own Hugging Face-named
pieces (:func:`~actors.learner.megatron.rank_export.rank_pieces`: its tensor-parallel slices, pipeline stage and
expert-parallel experts; of replicas only one rank) into its slot, on its side stream, and the ranks' checksums
meet on rank 0 in one collective queued behind them (:mod:`async_rl.weights.gpu_ranks`). A same-host generator
maps every rank's buffers and assembles the tensors on its own GPU.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from async_rl.weights.config import PublisherConfig
from async_rl.weights.cuda_ipc import IpcHandle
from async_rl.weights.gpu_publisher import local_slots
from async_rl.weights.gpu_ranks import DistributedGpuSlots
from async_rl.weights.gpu_slots import GpuFill, PieceSource
from async_rl.weights.manifest import BucketEntry, ManifestTensor
from async_rl.weights.snapshot import Piece

if TYPE_CHECKING:
    from actors.learner.megatron.backend import MegatronBackend


def rank_slots(cfg: PublisherConfig) -> DistributedGpuSlots:
    """This rank's GPU slots, on its current device."""
    import torch

    device = f"cuda:{torch.cuda.current_device()}"
    return DistributedGpuSlots(local_slots(device, cfg, rank=torch.distributed.get_rank()))


class MegatronGpuExport:
    """Rank 0's face of every rank's GPU slots (module docstring)."""

    backend: MegatronBackend
    slots: DistributedGpuSlots

    def __init__(self, backend: MegatronBackend, slots: DistributedGpuSlots) -> None:
        self.backend, self.slots = backend, slots

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    @property
    def device_bytes(self) -> int:
        return self.slots.device_bytes

    @property
    def hands_over(self) -> bool:
        return False

    def fill(self, slot: int, version: int, source: PieceSource) -> GpuFill:
        """Every rank copies its own pieces (``source``, the gathered export, is not used)."""
        return self.backend.gpu_fill(slot, version)

    def manifest_parts(self, sums: list[int]) -> tuple[list[ManifestTensor], list[BucketEntry]]:
        return self.slots.manifest_parts(sums)

    def handles(self, slot: int) -> list[IpcHandle]:
        return self.slots.handles(slot)

    def tensors(self, slot: int) -> list[Piece]:
        return self.slots.tensors(slot)
