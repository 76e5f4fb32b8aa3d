"""Versions for other hosts encoded from the GPU slots (async_rl/weights/gpu/encoder.py), through the real host
publisher, Redis and reader, on the CPU (the slots on the CPU; the GPU publisher's own glue runs in
tests/gpu/test_gpu_weights.py, several ranks' in scripts/megatron/check_gpu_export.py): every version a reader applies
equals the slot's bit for bit, deltas go out as the changed elements, full versions when asked, a reader joining late
builds the newest, and several ranks' slots mirrored on rank 0 go out as one version."""

from __future__ import annotations

import pytest
import redis.asyncio as aioredis
import torch

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.weights import WeightPublisher, WeightReader
from async_rl.weights.background import BackgroundPublisher
from async_rl.weights.config import PublisherConfig
from async_rl.weights.gpu.checksum import padded
from async_rl.weights.gpu.cuda_ipc import IpcUnavailable
from async_rl.weights.gpu.publisher import GpuPublisher
from async_rl.weights.gpu.ranks import RankMirror
from async_rl.weights.gpu.slots import GpuSlots
from async_rl.weights.redis_transport import RedisTransport
from async_rl.weights.snapshot import Piece


def _model(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(512, 64, generator=g),
        "layer.w": torch.randn(64, 64, generator=g),
        "norm": torch.ones(64),
        "count": torch.tensor([3], dtype=torch.int64),
    }


def _train(model: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    """One step that moves about 2 % of the bf16 bit patterns of the float weights, like an RL step at a small lr."""
    g = torch.Generator().manual_seed(seed)
    out = dict(model)
    for k in ("embed", "layer.w"):
        mask = torch.rand(model[k].shape, generator=g) < 0.02
        out[k] = torch.where(mask, model[k] * 1.03, model[k])
    out["count"] = model["count"] + 1
    return out


def _bf16(model: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.items()}


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )  # fmt: skip


async def test_host_versions_from_the_gpu_slots_apply_bit_for_bit(redis_client: aioredis.Redis, servers: ServerSet,
                                                                  names: Names) -> None:  # fmt: skip
    cfg = PublisherConfig(bucket_bytes=16 << 10, full_every=3, gpu_dtype="bfloat16")
    host = BackgroundPublisher(WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names, cfg))
    slots = GpuSlots("cpu", num_slots=2, bucket_bytes=1 << 16, dtype=torch.bfloat16)
    encoder = GpuPublisher(redis_client, names, cfg, slots, host=host).encoder  # what the GPU publisher encodes with
    assert encoder is not None
    reader = WeightReader(redis_client, RedisTransport(servers.redis_url, names), names)
    model = _model()
    held = None
    kinds = []
    try:
        for version in range(6):
            if version:
                model = _train(model, version)
            if version == 4:
                await redis_client.zadd(names.weights_want_full, {"gen-0": 1})  # a generator asks for a full one
            slot = version % 2
            slots.fill(slot, version, list(model.items())).wait()

            def encode(full: bool, base: int, link: float | None, slot: int = slot, version: int = version):  # type: ignore[no-untyped-def]
                return encoder.encode(slots, slot, version, full=full, base_version=base, link_bytes_per_s=link)

            await host.flush(version, encode=encode)
            assert host.published_version == version
            got = await reader.fetch(version, held)
            m = got.manifest
            kinds.append(m.kind)
            assert m.checksum == "wsum64" and _same(got.tensors, _bf16(model)), f"v{version}"
            if m.kind == "delta":
                enc = {t.name: t.pieces[0].encoding for t in m.tensors}
                assert enc == {"embed": "sparse", "layer.w": "sparse", "norm": "same", "count": "raw"}, enc
                # 6 bytes a changed bf16 element against 2 a whole one: 2 % changed is about 6 % of the bytes
                assert m.total_bytes <= padded(int(0.1 * m.full_bytes)), (m.total_bytes, m.full_bytes)
            held = got
        assert kinds == ["full", "delta", "delta", "full", "full", "delta"], kinds
        # A reader that joins now builds v5 from the newest full version and the delta after it.
        late = await WeightReader(redis_client, RedisTransport(servers.redis_url, names), names).fetch(5)
        assert _same(late.tensors, _bf16(model))
        assert [r.version for r in host.take_records()] == list(range(6))
        assert host.link_bytes_per_s is not None  # Redis puts cross the link: measured from them
    finally:
        await host.aclose()


def _rank_pieces(model: dict[str, torch.Tensor], rank: int) -> list[Piece]:
    """Rank ``rank``'s pieces of two: uneven row slices of ``layer.w``, the other tensors on one rank each."""
    w = model["layer.w"]
    rows = slice(0, 24) if rank == 0 else slice(24, 64)
    own = [Piece("layer.w", w[rows], tuple(w.shape), 0, rows.start)]
    return own + ([Piece("embed", model["embed"])] if rank == 0 else
                  [Piece("norm", model["norm"]), Piece("count", model["count"])])  # fmt: skip


async def test_every_rank_s_slot_mirrored_on_rank_0_goes_out_bit_for_bit(redis_client: aioredis.Redis,
                                                                         servers: ServerSet, names: Names) -> None:  # fmt: skip
    """Two ranks' slots (uneven row slices of one tensor, the other tensors on one rank each) as one version on rank
    0 (RankMirror: on a GPU the other rank's buckets are mapped over CUDA IPC; here they are that rank's own CPU
    buffers), encoded for the host transport: a reader applies the full tensors, deltas included; the CPU path gets
    the tensors joined."""
    cfg = PublisherConfig(bucket_bytes=16 << 10, gpu_dtype="bfloat16")
    host = BackgroundPublisher(WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names, cfg))
    encoder = GpuPublisher(redis_client, names, cfg, GpuSlots("cpu"), host=host).encoder
    assert encoder is not None
    # Small buckets: each rank's pieces take two, so reading them one at a time is seen.
    ranks = [GpuSlots("cpu", num_slots=2, bucket_bytes=1 << 12, dtype=torch.bfloat16, rank=r) for r in range(2)]
    reader = WeightReader(redis_client, RedisTransport(servers.redis_url, names), names)
    model, held, mirror = _model(), None, None
    try:
        for version in range(3):
            if version:
                model = _train(model, version)
            slot = version % 2
            for r, rank_slots in enumerate(ranks):
                rank_slots.fill(slot, version, _rank_pieces(model, r)).wait()
            if mirror is None:
                assert [len(s.bucket_sizes) for s in ranks] == [2, 2]
                mirror = RankMirror(ranks[0], [s.placed for s in ranks], [s.bucket_sizes for s in ranks],
                                    lambda slot: ranks[1].buffers(slot))  # fmt: skip
                assert len(mirror.placed) == 5 and {x.bucket for x in mirror.placed} == {0, 1, 2, 3}
            # What the host publisher's CPU path takes (publisher.gpu_encode=false): one whole piece a tensor.
            joined = RankMirror(ranks[0], [s.placed for s in ranks], [s.bucket_sizes for s in ranks],
                                lambda slot: ranks[1].buffers(slot)).tensors(slot)  # fmt: skip
            assert all(p.whole for p in joined) and _same({p.name: p.tensor for p in joined}, _bf16(model))

            def encode(full: bool, base: int, link: float | None, slot: int = slot, version: int = version,
                       mirror: RankMirror = mirror):  # type: ignore[no-untyped-def]  # fmt: skip
                return encoder.encode(mirror, slot, version, full=full, base_version=base, link_bytes_per_s=link)

            await host.flush(version, encode=encode)
            got = await reader.fetch(version, held)
            assert _same(got.tensors, _bf16(model)), f"v{version}"
            layer = next(t for t in got.manifest.tensors if t.name == "layer.w")
            assert [(p.start, p.length) for p in layer.pieces] == [(0, 24), (24, 40)]
            assert got.manifest.kind == ("full" if version == 0 else "delta")
            held = got
        # The encoder read rank 1's buckets one at a time through one buffer, not a copy of them all.
        assert mirror is not None and mirror.device_bytes == max(padded(n) for n in ranks[1].bucket_sizes)
    finally:
        await host.aclose()


async def test_the_gpu_encodes_only_whole_versions_and_when_asked(redis_client: aioredis.Redis, servers: ServerSet,
                                                                   names: Names) -> None:  # fmt: skip
    def gpu(cfg: PublisherConfig, slots, host: bool = True) -> GpuPublisher:  # type: ignore[no-untyped-def]
        bg = BackgroundPublisher(WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names, cfg))
        return GpuPublisher(redis_client, names, cfg, slots, host=bg if host else None)

    one = GpuSlots("cpu", num_slots=2)
    assert gpu(PublisherConfig(), one).encoder is not None
    assert gpu(PublisherConfig(gpu_encode=False), one).encoder is None  # the host publisher snapshots and encodes
    assert gpu(PublisherConfig(), one, host=False).encoder is None  # publisher.gpu_host_copies=false
    enc = gpu(PublisherConfig(delta=False), one).encoder
    assert enc is not None and not enc.delta


async def test_an_encoder_without_gpu_memory_hands_over_to_the_cpu_path(redis_client: aioredis.Redis,
                                                                        servers: ServerSet, names: Names) -> None:  # fmt: skip
    from async_rl.weights.gpu.encoder import GpuEncoder

    class FullGpu(GpuEncoder):
        def encode(self, *args, **kwargs):  # type: ignore[no-untyped-def]
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 256.00 MiB")

    cfg = PublisherConfig(bucket_bytes=16 << 10)
    host = BackgroundPublisher(WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names, cfg))
    slots = GpuSlots("cpu", num_slots=2, bucket_bytes=1 << 16)
    gpu = GpuPublisher(redis_client, names, cfg, slots, host=host)
    gpu.encoder = FullGpu(cfg.bucket_bytes)
    model = _model()
    slots.fill(0, 0, list(model.items())).wait()
    await gpu._to_host(0, 0, wait=True)  # what a flush hands over from the slot of the newest version
    assert gpu.encoder is None and gpu._error is None and host.published_version == 0
    got = await WeightReader(redis_client, RedisTransport(servers.redis_url, names), names).fetch(0)
    assert got.manifest.checksum == "xxh3_64" and _same(got.tensors, model)
    await host.aclose()


@pytest.mark.parametrize("failure", [
    torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"),
    IpcUnavailable("cannot map the learner's GPU buffer: invalid device context"),
])  # fmt: skip
async def test_a_mirror_that_fails_hands_the_host_back_to_the_gathered_weights(redis_client: aioredis.Redis,
                                                                               servers: ServerSet, names: Names,
                                                                               failure: Exception) -> None:  # fmt: skip
    """Rank 0's copies of the other ranks' slots find no GPU memory, or a rank's buffers cannot be mapped: the mirror
    (and the encoder's base) is given up and the learner goes on, the host transport fed the gathered weights from
    the next step boundary (GpuPublisher.offer); nothing fails."""

    class Mirrored:  # rank 0's face of two ranks' slots, as far as the hand-over to the host publisher sees it
        num_slots = 2

        def __init__(self, mirror: RankMirror) -> None:
            self.whole: RankMirror | None = mirror

        def drop_whole(self, reason: str) -> bool:
            dropped, self.whole = self.whole is not None, None
            return dropped

    def remote(slot: int) -> list[torch.Tensor]:
        raise failure

    ranks = [GpuSlots("cpu", num_slots=2, bucket_bytes=1 << 14, dtype=torch.bfloat16, rank=r) for r in range(2)]
    model = _model()
    for r, rank_slots in enumerate(ranks):
        rank_slots.fill(0, 0, _rank_pieces(model, r)).wait()
    export = Mirrored(RankMirror(ranks[0], [s.placed for s in ranks], [s.bucket_sizes for s in ranks], remote))
    cfg = PublisherConfig(bucket_bytes=16 << 10)
    host = BackgroundPublisher(WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names, cfg))
    gpu = GpuPublisher(redis_client, names, cfg, export, host=host)  # type: ignore[arg-type]
    assert gpu.encoder is not None
    await gpu._to_host(0, 0)  # what a commit hands over when the host publisher is idle
    assert export.whole is None and gpu.encoder is None and gpu._error is None
    assert host.published_version == -1 and host.inflight_version is None and not gpu._held
    await host.aclose()
