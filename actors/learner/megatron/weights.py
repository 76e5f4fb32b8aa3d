"""How a Megatron learner's weights leave it: the gathered Hugging Face export, and every rank's own GPU slots.

* **Gathered** (:meth:`MegatronWeights.export_global`, :meth:`~MegatronWeights.export_weights`): every rank's slices
  all-gathered over tensor parallelism, gathered to rank 0's host, converted to Hugging Face names
  (:func:`~actors.learner.megatron.convert.mcore_to_hf`): the host transport's path, checkpoints' export.
* **Per rank, on the GPU** (:meth:`MegatronWeights.gpu_export`, :class:`MegatronGpuExport`): rank 0's
  :class:`~async_rl.weights.gpu.publisher.GpuPublisher` asks for a version with one backend command (``gpu_fill``):
  every rank copies its own Hugging Face-named pieces (:func:`~actors.learner.megatron.rank_export.rank_pieces`: its
  tensor-parallel slices, pipeline stage and expert-parallel experts; of replicas only one rank) into its own slot,
  on its side stream, and the ranks' checksums meet on rank 0 in one collective queued behind them
  (:mod:`async_rl.weights.gpu.ranks`). A same-host generator maps every rank's buffers and assembles the tensors
  on its own GPU. No gather. Rank 0 feeds the host transport from every rank's slot, copied GPU to GPU to its own
  (:class:`~async_rl.weights.gpu.ranks.RankMirror`; ranks on other hosts: the gathered export). One rank does the
  same (its slots then hold the whole version), with the grouped experts' stacked weights as one view each
  (:func:`~actors.learner.megatron.rank_export.stacked_expert_pieces`).
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import torch

from actors.learner.backend import TrainingBackend
from actors.learner.megatron.config import MegatronConfig
from actors.learner.megatron.convert import ModelArch, RankNaming, global_name, mcore_to_hf, tp_kind, unshard
from actors.learner.megatron.rank_export import rank_pieces, stacked_expert_pieces
from actors.learner.megatron.spec import STACKED_EXPERTS
from async_rl.weights.config import PublisherConfig
from async_rl.weights.gpu.cuda_ipc import IpcHandle
from async_rl.weights.gpu.publisher import local_slots
from async_rl.weights.gpu.ranks import DistributedGpuSlots
from async_rl.weights.gpu.slots import GpuExport, GpuFill, GpuSlots, PieceSource, WholeVersion
from async_rl.weights.manifest import BucketEntry, ManifestTensor
from async_rl.weights.snapshot import Piece

log = logging.getLogger(__name__)


def expand_stacked(named: Iterator[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """Parameters with each stacked expert weight split into per-expert ``local_experts.{e}`` names."""
    for name, p in named:
        m = STACKED_EXPERTS.match(name)
        if m is None:
            yield name, p
            continue
        fc = "linear_fc1" if m.group(2) == "1" else "linear_fc2"
        for e in range(p.shape[0]):
            yield f"{m.group(1)}local_experts.{e}.{fc}.weight", p[e]


class MegatronWeights(TrainingBackend):
    """The weights side of :class:`~actors.learner.megatron.backend.MegatronBackend` (module docstring)."""

    cfg: MegatronConfig
    arch: ModelArch
    naming: RankNaming
    gpt: Any
    """megatron-core's GPTModel (untyped here)."""
    tp_rank: int
    cp_rank: int
    dp_rank: int
    etp_rank: int
    etp_size: int
    _gpu_slots: DistributedGpuSlots | GpuSlots | None
    """This rank's GPU slots of its own pieces (the GPU weight path; one rank: plain slots)."""
    _gpu_cfg: PublisherConfig | None

    def _command(self, name: str, payload: dict) -> dict:
        raise NotImplementedError

    @torch.no_grad()
    def export_global(self, *, on_device: bool = False) -> dict[str, torch.Tensor] | None:
        """Global megatron state dict (CPU, model dtype) on the main rank, None elsewhere. Rebuilt on every call.
        ``on_device`` (one rank only): the tensors stay on the GPU (views of the parameters where no gather is due)."""
        from megatron.core import parallel_state as ps

        world = torch.distributed.get_world_size()
        if on_device and world != 1:
            raise ValueError("export_global(on_device=True) is for one rank: several gather to rank 0's host")
        pieces: dict[str, torch.Tensor] = {}
        for name, p in expand_stacked(self.gpt.named_parameters()):
            g = global_name(name, self.naming, self.arch.moe_layers)
            if g is None:
                continue
            if g == "output_layer.weight" and self.arch.tie_embeddings:
                continue
            expert = ".mlp.experts." in g
            group = ps.get_expert_tensor_parallel_group() if expert else ps.get_tensor_model_parallel_group()
            size = self.etp_size if expert else self.cfg.tensor_parallel
            t = p.detach()
            if size > 1 and tp_kind(g) != "replicated":
                parts = [torch.empty_like(t) for _ in range(size)]
                torch.distributed.all_gather(parts, t.contiguous(), group=group)
                t = unshard(g, parts)
            pieces[g] = t if on_device else t.cpu()
        keep = self.tp_rank == 0 and self.cp_rank == 0 and self.etp_rank == 0
        send = pieces if keep else None
        if world == 1:
            return pieces
        box: list | None = [None] * world if self.is_main_rank else None
        torch.distributed.gather_object(send, box, dst=0)
        if not self.is_main_rank:
            return None
        merged: dict[str, torch.Tensor] = {}
        for part in box or []:
            for k, v in (part or {}).items():
                merged.setdefault(k, v)
        return merged

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """HF-named weights (main rank; others yield nothing). Conversion rebuilt on every call."""
        return self._export_weights(**self._command("export_weights", {}))

    def _export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        glob = self.export_global()
        if glob is None:
            return iter(())
        hf = mcore_to_hf(glob, self.arch, fused_experts=self.cfg.fused_experts_export)
        return iter(sorted(hf.items()))

    def gpu_export(self, cfg: PublisherConfig) -> GpuExport | None:
        """Every rank's own GPU slots of its own pieces (:class:`MegatronGpuExport`), filled by one command; with one
        rank, its slots hold the whole version."""
        if torch.distributed.get_world_size() == 1:
            # One rank too copies its own pieces (views of the parameters) into its slots, rather than the converted
            # weights (mcore_to_hf's launches ran inside the snapshot: 34 ms of the 1.65B MoE's step).
            local = super().gpu_export(cfg)
            if not isinstance(local, GpuSlots):
                return local
            self._gpu_cfg, self._gpu_slots = cfg, local
            return MegatronGpuExport(self, local)
        if self.arch.num_experts and self.cfg.fused_experts_export and self.etp_size > 1:
            # rank_export cannot cut transformers' fused expert tensors by expert tensor parallelism.
            log.warning("weights: no GPU path with expert_tensor_parallel=%d and fused expert names; set "
                        "learner.megatron.expert_tensor_parallel=1 or learner.megatron.fused_experts_export=false "
                        "(per-expert names) for it. Versions are gathered to rank 0 instead", self.etp_size)  # fmt: skip
            return None
        self._gpu_cfg = cfg
        self._gpu_slots = rank_slots(cfg)
        return MegatronGpuExport(self, self._gpu_slots)

    def gpu_fill(self, slot: int, version: int) -> GpuFill:
        """Every rank copies its own pieces into GPU slot ``slot`` as ``version``; rank 0's fill (with every rank's
        checksums on their way to its host memory)."""
        return self._gpu_fill(**self._command("gpu_fill", {"slot": slot, "version": version, "cfg": self._gpu_cfg}))

    def _gpu_fill(self, slot: int, version: int, cfg: PublisherConfig) -> GpuFill:
        from megatron.core import parallel_state as ps

        if self._gpu_slots is None:  # a follower's first fill
            self._gpu_slots = rank_slots(cfg)
        named = {name: p.detach() for name, p in self.gpt.named_parameters()}
        experts = ps.get_expert_data_parallel_rank() == 0
        stacked = {}
        if self.cfg.fused_experts_export and self.etp_size == 1:  # grouped experts' stacked weights: one view each
            stacked = {n: named.pop(n) for n in [n for n in named if STACKED_EXPERTS.match(n)]}
        pieces = rank_pieces(dict(expand_stacked(iter(named.items()))), self.naming, self.arch, tp_rank=self.tp_rank,
                             tp_size=self.cfg.tensor_parallel, etp_rank=self.etp_rank, etp_size=self.etp_size,
                             dense=self.dp_rank == 0 and self.cp_rank == 0, experts=experts,
                             fused_experts=self.cfg.fused_experts_export)  # fmt: skip
        if experts:
            pieces += stacked_expert_pieces(stacked, self.naming, self.arch)
        return self._gpu_slots.fill(slot, version, pieces)

    @property
    def publish_device(self) -> str:
        """One rank: its GPU (the HF weights are converted there). Several: the gathered export is on the host."""
        return f"cuda:{torch.cuda.current_device()}" if torch.distributed.get_world_size() == 1 else "cpu"

    def snapshot_source(self) -> Iterator[tuple[str, torch.Tensor]]:
        """One rank: the HF-named weights converted on the GPU (no host copy, no sync here), for the learner's pinned
        snapshot (a side stream copies them while the next step trains). Several ranks: the gathered export."""
        if torch.distributed.get_world_size() != 1:
            return self.export_weights()
        glob = self.export_global(on_device=True)
        assert glob is not None
        hf = mcore_to_hf(glob, self.arch, fused_experts=self.cfg.fused_experts_export)
        return iter(sorted(hf.items()))


def rank_slots(cfg: PublisherConfig) -> DistributedGpuSlots:
    """This rank's GPU slots, on its current device."""
    import torch

    device = f"cuda:{torch.cuda.current_device()}"
    return DistributedGpuSlots(local_slots(device, cfg, rank=torch.distributed.get_rank()))


class MegatronGpuExport:
    """Rank 0's face of every rank's GPU slots (module docstring), or of one rank's own."""

    backend: MegatronWeights
    slots: DistributedGpuSlots | GpuSlots

    def __init__(self, backend: MegatronWeights, slots: DistributedGpuSlots | GpuSlots) -> None:
        self.backend, self.slots = backend, slots

    @property
    def num_slots(self) -> int:
        return self.slots.num_slots

    @property
    def device_bytes(self) -> int:
        return self.slots.device_bytes

    @property
    def whole(self) -> WholeVersion | None:
        return self.slots.whole  # one rank: its slots; several: rank 0's mirror of every rank's (or None)

    def drop_whole(self, reason: str) -> bool:
        return self.slots.drop_whole(reason)

    def fill(self, slot: int, version: int, source: PieceSource) -> GpuFill:
        """Every rank copies its own pieces (``source``, the gathered export, is not used)."""
        return self.backend.gpu_fill(slot, version)

    def manifest_parts(self, sums: list[int]) -> tuple[list[ManifestTensor], list[BucketEntry]]:
        return self.slots.manifest_parts(sums)

    def handles(self, slot: int) -> list[IpcHandle]:
        return self.slots.handles(slot)

    def tensors(self, slot: int) -> list[Piece]:
        return self.slots.tensors(slot)
