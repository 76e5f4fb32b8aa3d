"""Several learner ranks, each with its own GPU slots (here on the CPU, gloo): rank 0 gets one valid manifest whose
buckets are every rank's, with every rank's checksums, and the pieces assemble into the full tensors."""

from __future__ import annotations

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from async_rl.weights.checksums import CHECKSUMS
from async_rl.weights.gpu.ranks import DistributedGpuSlots
from async_rl.weights.gpu.slots import GpuSlots
from async_rl.weights.manifest import DTYPES, GPU_CHECKSUM, GPU_TRANSPORT, Manifest
from async_rl.weights.snapshot import Piece


def _full(version: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(version)
    return {"embed.weight": torch.randn(40, 8, generator=g), "qkv.weight": torch.randn(6, 8, generator=g),
            "norm.weight": torch.randn(8, generator=g)}  # fmt: skip


def _pieces(rank: int, version: int) -> list[Piece]:
    w = _full(version)
    rows = slice(0, 2) if rank == 0 else slice(2, 6)  # uneven slices of one tensor
    own = [Piece("qkv.weight", w["qkv.weight"][rows], (6, 8), 0, rows.start)]
    return own + ([Piece("embed.weight", w["embed.weight"])] if rank == 0 else [Piece("norm.weight", w["norm.weight"])])


def _rank(rank: int, port: int, out: str) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        slots = DistributedGpuSlots(GpuSlots("cpu", num_slots=2, bucket_bytes=256, rank=rank))
        for version in (1, 2):
            slot = version % 2
            fill = slots.fill(slot, version, _pieces(rank, version))
            sums = fill.wait()
            every: list = [None, None]
            dist.all_gather_object(every, [bytes(b.numpy()) for b in slots.local._buffers[slot] or []])
            if rank != 0:
                continue
            tensors, buckets = slots.manifest_parts(sums)
            m = Manifest(version=version, tensors=tensors, buckets=buckets, transport=GPU_TRANSPORT,
                         checksum=GPU_CHECKSUM, full_version=version)  # fmt: skip
            m.validate()
            data = [b for rank_bufs in every for b in rank_bufs]
            assert [b.checksum for b in buckets] == [CHECKSUMS["wsum64"](memoryview(d)) for d in data]
            assert len(buckets) == sum(slots.counts) and slots.counts[0] > 1 and slots.counts[1] >= 1
            for t in m.tensors:
                full = torch.empty(t.shape, dtype=DTYPES[t.dtype])
                for p in t.pieces:
                    raw = torch.frombuffer(bytearray(data[p.bucket][p.offset : p.offset + p.nbytes]), dtype=full.dtype)
                    target = full if p.length < 0 else full.narrow(p.dim, p.start, p.length)
                    target.copy_(raw.view(target.shape))
                assert torch.equal(full, _full(version)[t.name]), t.name
            assert sorted((p.rank, p.start) for p in next(t for t in m.tensors if t.name == "qkv.weight").pieces) == [
                (0, 0), (1, 2)]
        if rank == 0:
            with open(out, "w") as f:
                f.write("ok")
    finally:
        dist.destroy_process_group()


def test_two_ranks_publish_one_version_without_a_gather(tmp_path) -> None:  # type: ignore[no-untyped-def]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = tmp_path / "ok"
    mp.spawn(_rank, args=(port, str(out)), nprocs=2)
    assert out.read_text() == "ok"


def test_rank_0_mirrors_only_ranks_it_can_map() -> None:
    here, gpus = "host-a", {"gpu-0": 0, "gpu-1": 1}
    places = [("host-a", "gpu-0"), ("host-a", "gpu-1"), ("host-b", "gpu-9"), ("host-a", "gpu-7"), ("host-a", None)]
    counts = [3, 2, 2, 1, 1]
    assert DistributedGpuSlots.unmappable(places, counts, here, gpus.get) == [2, 3, 4]  # another host, unseen, no GPU
    assert DistributedGpuSlots.unmappable(places[:2], counts[:2], here, gpus.get) == []
    # Replicas publish nothing: where they run does not matter (data parallel across hosts).
    assert DistributedGpuSlots.unmappable(places, [3, 2, 0, 0, 0], here, gpus.get) == []
