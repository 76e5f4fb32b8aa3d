"""Background publishing, delta versions and per-rank pieces against a real Redis (issue 17)."""

from __future__ import annotations

import dataclasses
import signal
import textwrap

import pytest
import redis.asyncio as aioredis
import torch

from actors.generator.config import TorchEngineConfig, WeightSyncConfig
from actors.generator.torch_engine import TorchEngine
from actors.generator.weight_sync import WeightSync
from async_rl.model.presets import ModelConfig, build_model
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.weights import CorruptVersion, VersionUnavailable, WeightPublisher, WeightReader
from async_rl.weights.background import BackgroundPublisher
from async_rl.weights.config import PublisherConfig
from async_rl.weights.manifest import Manifest
from async_rl.weights.redis_transport import RedisTransport
from async_rl.weights.snapshot import Piece
from tests.integration.killing import kill_mid_version


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and a[k].shape == b[k].shape
        and torch.equal(a[k].contiguous().reshape(-1).view(torch.uint8), b[k].contiguous().reshape(-1).view(torch.uint8))
        for k in a
    )  # fmt: skip


def _model() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "still.fp32": torch.randn(64, 33, generator=g),  # never changes: 'same'
        "small.fp32": torch.randn(128, 64, generator=g),  # small steps: xor-zstd
        "small.bf16": torch.randn(256, 40, generator=g).to(torch.bfloat16),
        "all.fp32": torch.randn(96, 17, generator=g),  # changes completely: raw
        "ints": torch.randint(-9, 9, (50,), generator=g, dtype=torch.int64),
        "scalar": torch.tensor(1.5),
        "empty": torch.zeros(0, 3),
    }


def _step(model: dict[str, torch.Tensor], seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out = dict(model)
    out["small.fp32"] = model["small.fp32"] + 1e-4 * torch.randn(128, 64, generator=g) * (torch.rand(128, 64, generator=g) < 0.1)
    out["small.bf16"] = (model["small.bf16"].float() * (1 + 0.02 * (torch.rand(256, 40, generator=g) < 0.05))).to(torch.bfloat16)
    # Every bit pattern new (random bits, NaNs included): XOR + zstd is no smaller, so the piece stays raw.
    out["all.fp32"] = torch.randint(-(2**31), 2**31 - 1, (96, 17), generator=g, dtype=torch.int64).to(torch.int32).view(torch.float32)
    out["ints"] = model["ints"] + 1
    out["scalar"] = model["scalar"] * 2
    return out  # fmt: skip


def _bg(redis_client: aioredis.Redis, servers: ServerSet, names: Names, **cfg: object) -> BackgroundPublisher:
    pc = PublisherConfig(bucket_bytes=16 << 10, **cfg)  # type: ignore[arg-type]
    return BackgroundPublisher(WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names, pc))


def _reader(redis_client: aioredis.Redis, servers: ServerSet, names: Names) -> WeightReader:
    return WeightReader(redis_client, RedisTransport(servers.redis_url, names), names)


async def test_deltas_round_trip_bit_exact_and_small(redis_client: aioredis.Redis, servers: ServerSet,
                                                     names: Names) -> None:  # fmt: skip
    bg = _bg(redis_client, servers, names, full_every=4)
    reader = _reader(redis_client, servers, names)
    model = _model()
    versions = {0: model}
    await bg.flush(0, lambda: model.items())
    held = await reader.fetch(0)
    assert held.manifest.kind == "full" and _same(held.tensors, model)
    for v in range(1, 6):
        model = _step(model, v)
        versions[v] = model
        await bg.flush(v, lambda m=model: m.items())  # type: ignore[misc]
        m = (await reader._manifest(v))
        got = await reader.fetch(v, have=held)
        assert _same(got.tensors, model), v
        if v == 4:  # full_every=4: versions 0 and 4 are full
            assert m.kind == "full" and m.full_version == 4
        else:
            assert m.kind == "delta" and m.base == v - 1 and got.chain == (v,)
            enc = {t.name: t.pieces[0].encoding for t in m.tensors}
            assert enc["still.fp32"] == "same" and enc["small.fp32"] == "xor-zstd" and enc["all.fp32"] == "raw"
            assert enc["empty"] == "raw"  # nothing to encode
            assert got.tensors["still.fp32"] is held.tensors["still.fp32"]  # unchanged: shared, not copied
            assert m.total_bytes < 0.6 * m.full_bytes
        held = got
    records = bg.take_records()
    assert [r.version for r in records] == list(range(6)) and bg.versions_skipped == 0
    assert all(r.kind == ("full" if r.version in (0, 4) else "delta") for r in records)
    # A late joiner (nothing held) builds v5 from the newest full version (4) plus the delta after it.
    late = await _reader(redis_client, servers, names).fetch()
    assert late.version == 5 and late.chain == (4, 5) and _same(late.tensors, versions[5])
    await bg.aclose()


async def test_coalescing_publishes_the_newest_and_skips_the_one_between(
    redis_client: aioredis.Redis, servers: ServerSet, names: Names
) -> None:
    bg = _bg(redis_client, servers, names)
    model = _model()
    assert await bg.offer(0, lambda: model.items())
    m1 = _step(model, 1)
    assert not await bg.offer(1, lambda: m1.items())  # v0 is still going out: v1 is skipped, nothing copied
    assert bg.versions_skipped == 1 and bg.snapshotter.host_bytes <= 2 * sum(t.nbytes for t in model.values())
    await bg.wait_idle()
    m2 = _step(m1, 2)
    assert await bg.offer(2, lambda: m2.items())
    await bg.wait_idle()
    assert [r.version for r in bg.take_records()] == [0, 2]
    reader = _reader(redis_client, servers, names)
    assert await reader.latest_version() == 2
    with pytest.raises(VersionUnavailable):
        await reader.fetch(1)
    m = await reader._manifest(2)
    assert m.kind == "delta" and m.base == 0  # the delta goes from the last version out, not the skipped one
    assert _same((await reader.fetch(2, have=await reader.fetch(0))).tensors, m2)
    # The snapshot is a copy: training on after offer() does not change what goes out.
    m3 = {k: v.clone() for k, v in _step(m2, 3).items()}
    assert await bg.offer(3, lambda: m3.items())
    for t in m3.values():
        t.zero_()
    await bg.wait_idle()
    assert not _same((await reader.fetch(3)).tensors, m3)
    await bg.aclose()


async def test_a_corrupt_delta_is_refused_and_the_generator_refetches_a_full_version(
    redis_client: aioredis.Redis, servers: ServerSet, names: Names
) -> None:
    weights = {k: v.clone() for k, v in build_model("tiny-moe", seed=3).state_dict().items()}
    bg = _bg(redis_client, servers, names, full_every=100)
    await bg.flush(0, lambda: weights.items())
    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name="tiny-moe", seed=99), max_batch_prompts=4))
    sync = WeightSync(engine, _reader(redis_client, servers, names), names, WeightSyncConfig(poll_interval_s=0.05))
    try:
        assert await sync.start()
        async with sync.following():
            # v1: a delta whose base the generator holds wrongly (one flipped bit in its copy of v0): the delta
            # decodes, the checksum of the full tensor does not match, it is rebuilt from the full v0: exact.
            name = "model.layers.0.mlp.experts.gate_up_proj" if "model.layers.0.mlp.experts.gate_up_proj" in weights \
                else next(iter(weights))  # fmt: skip
            assert sync._held is not None
            sync._held.tensors[name] = sync._held.tensors[name].clone()
            sync._held.tensors[name].view(-1).view(torch.uint8)[5] ^= 1
            v1 = {k: v * 1.001 if v.is_floating_point() else v for k, v in weights.items()}
            await bg.flush(1, lambda: v1.items())
            assert (await sync.reader._manifest(1)).kind == "delta"
            assert await sync.wait_staged(1, 30)
            assert await engine.wait_applied(1, 30)
            assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in v1.items())
            # v2: a delta whose stored bytes are corrupt: refused (bucket checksum), a full version is asked for.
            v2 = {k: v * 1.001 if v.is_floating_point() else v for k, v in v1.items()}
            bg.publisher.transport = _Corrupting(bg.publisher.transport, version=2)  # type: ignore[assignment]
            await bg.flush(2, lambda: v2.items())
            assert not await sync.wait_staged(2, 30)
            assert 2 in sync.refused and sync.num_refused == 1 and sync.num_full_requests == 1
            assert await redis_client.zcard(names.weights_want_full) == 1
            # The publisher's next version is full; the generator takes it and is exact again.
            bg.publisher.transport = bg.publisher.transport.inner  # type: ignore[attr-defined]
            v3 = {k: v * 1.001 if v.is_floating_point() else v for k, v in v2.items()}
            await bg.flush(3, lambda: v3.items())
            assert (await sync.reader._manifest(3)).kind == "full"
            assert await redis_client.zcard(names.weights_want_full) == 0
            assert await sync.wait_staged(3, 30) and await engine.wait_applied(3, 30)
            assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in v3.items())
    finally:
        await engine.close()
        await bg.aclose()


class _Corrupting:
    """A real transport whose writes of one version get one flipped byte after the checksum was taken."""

    def __init__(self, inner: RedisTransport, version: int) -> None:
        self.inner, self.version, self.name = inner, version, inner.name

    async def put(self, version: int, index: int, data: memoryview) -> None:
        if version == self.version and data.nbytes:
            raw = bytearray(data)
            raw[len(raw) // 2] ^= 0x10
            data = memoryview(raw)
        await self.inner.put(version, index, data)

    def __getattr__(self, name: str):  # type: ignore[no-untyped-def]
        return getattr(self.inner, name)


async def test_pieces_of_several_ranks_assemble_bit_for_bit(redis_client: aioredis.Redis, servers: ServerSet,
                                                            names: Names) -> None:  # fmt: skip
    """Three fake ranks each write their slices (TP-style along dim 0 or 1, a whole tensor on one rank) into their
    own bucket ranges; rank 0 commits; the reader assembles the same state dict, also through a delta."""
    full = {k: v.clone() for k, v in build_model("tiny-moe", seed=5).state_dict().items()}
    names_sorted = list(full)

    def rank_pieces(weights: dict[str, torch.Tensor], rank: int, num_ranks: int) -> list[Piece]:
        out = []
        for i, name in enumerate(names_sorted):
            t = weights[name]
            dim = i % 2 if t.dim() >= 2 else 0
            if t.dim() == 0 or t.shape[dim] < num_ranks:
                if i % num_ranks == rank:
                    out.append(Piece(name, t))  # a small tensor: owned whole by one rank
                continue
            size = -(-t.shape[dim] // num_ranks)
            start = rank * size
            length = min(size, t.shape[dim] - start)
            if length > 0:
                out.append(Piece(name, t.narrow(dim, start, length).clone(), tuple(t.shape), dim, start))
        return out

    pub = WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names,
                          PublisherConfig(bucket_bytes=8 << 10))  # fmt: skip
    reader = _reader(redis_client, servers, names)

    async def publish(weights: dict[str, torch.Tensor], version: int, base: dict[str, torch.Tensor] | None) -> None:
        parts, first = [], 0
        for rank in range(3):  # each rank: its own pieces, its own base pieces, its own bucket range
            pieces = rank_pieces(weights, rank, 3)
            base_pieces = None if base is None else {p.name: p.tensor for p in rank_pieces(base, rank, 3)}
            part = await pub.write_rank(version, pieces, base=base_pieces, rank=rank, first_bucket=first)
            first += len(part.buckets)
            parts.append(part)
        await pub.commit(version, parts, base=-1 if base is None else version - 1, full_version=0)

    await publish(full, 0, None)
    m0 = await reader._manifest(0)
    assert m0.num_ranks == 3 and any(len(t.pieces) == 3 for t in m0.tensors)
    got0 = await reader.fetch(0)
    assert _same(got0.tensors, full)
    assert list(got0.tensors) == [t.name for t in m0.tensors]
    nxt = {k: v + 1e-3 if v.is_floating_point() else v for k, v in full.items()}
    await publish(nxt, 1, full)
    assert (await reader._manifest(1)).kind == "delta"
    assert _same((await reader.fetch(1, have=got0)).tensors, nxt)
    # Pieces that do not tile their tensor are refused before anything becomes visible.
    bad = await pub.write_rank(2, rank_pieces(full, 0, 3), rank=0)
    with pytest.raises(ValueError, match="pieces"):
        await pub.commit(2, [bad])
    assert await reader.latest_version() == 1


async def test_megatron_ranks_publish_their_own_pieces_and_the_reader_assembles_the_gathered_export(
    redis_client: aioredis.Redis, servers: ServerSet, names: Names
) -> None:
    """TP=2 x PP=2 x DP=2 with EP=2 (8 ranks): every rank writes the pieces it owns (no gather; replicas write
    nothing); rank 0 commits; the version a generator reads equals the gathered Hugging Face export bit for bit,
    full and as a delta."""
    from tests.unit.megatron.test_megatron_convert import _qwen2
    from tests.unit.megatron.test_megatron_rank_export import world_pieces

    every, want = world_pieces(_qwen2, tp=2, pp=2, dp=2, ep=2, etp=1)
    ranks = [pieces for pieces in every if pieces]
    assert len(every) == 8 and len(ranks) == 4  # per stage: the two TP ranks of DP replica 0 (EP ranks 0 and 1)
    pub = WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names,
                          PublisherConfig(bucket_bytes=4 << 10))  # fmt: skip
    reader = _reader(redis_client, servers, names)

    async def publish(version: int, scale: float, base: float | None) -> None:
        parts, first = [], 0
        for rank, pieces in enumerate(ranks):
            mine = [dataclasses.replace(p, tensor=p.tensor * scale) for p in pieces]
            old = None if base is None else {p.name: p.tensor * base for p in pieces}
            if old is not None and len({p.name for p in pieces}) != len(pieces):
                old = None  # several pieces of one tensor on a rank: published in full
            part = await pub.write_rank(version, mine, base=old, rank=rank, first_bucket=first)
            first += len(part.buckets)
            parts.append(part)
        await pub.commit(version, parts, base=-1 if base is None else version - 1, full_version=0)

    await publish(0, 1.0, None)
    m0 = await reader._manifest(0)
    assert m0.num_ranks == len(ranks) and sorted(t.name for t in m0.tensors) == sorted(want)
    assert any(len(t.pieces) > 1 for t in m0.tensors)  # sharded tensors arrive in pieces from several ranks
    got = await reader.fetch(0)
    assert _same(got.tensors, want)
    await publish(1, 2.0, 1.0)
    assert (await reader._manifest(1)).kind == "delta"
    assert _same((await reader.fetch(1, have=got)).tensors, {k: v * 2.0 for k, v in want.items()})


async def test_prune_keeps_the_chain_from_the_newest_full_version(redis_client: aioredis.Redis, servers: ServerSet,
                                                                  names: Names) -> None:  # fmt: skip
    bg = _bg(redis_client, servers, names, keep_versions=2, full_every=5)
    model = _model()
    for v in range(8):
        model = _step(model, v)
        await bg.flush(v, lambda m=model: m.items())  # type: ignore[misc]
    kept = [int(v) for v in await redis_client.zrange(names.weights_versions, 0, -1)]
    assert kept == [5, 6, 7]  # v5 is full: kept although keep_versions=2, so a late joiner can build v7
    got = await _reader(redis_client, servers, names).fetch()
    assert got.chain == (5, 6, 7) and _same(got.tensors, model)
    # A request for a full version makes the next one full.
    assert await _reader(redis_client, servers, names).request_full()
    model = _step(model, 9)
    await bg.flush(8, lambda: model.items())
    assert (await _reader(redis_client, servers, names)._manifest(8)).kind == "full"
    await bg.aclose()


def test_manifest_refuses_delta_fields_that_do_not_hold_together() -> None:
    m = Manifest(version=3, tensors=[], buckets=[], transport="redis", checksum="xxh3_64", kind="delta", base=3,
                 full_version=0)  # fmt: skip
    with pytest.raises(ValueError, match="full_version <= base < version"):
        m.validate()
    with pytest.raises(ValueError, match="weights.full_every"):
        PublisherConfig(full_every=0)
    with pytest.raises(ValueError, match="weights.zstd_level"):
        PublisherConfig(zstd_level=23)


_KILLED_LEARNER = textwrap.dedent(
    """
    import asyncio, sys, torch, redis.asyncio as aioredis
    from async_rl.run.names import Names
    from async_rl.weights.redis_transport import RedisTransport
    from async_rl.weights import WeightPublisher
    from async_rl.weights.background import BackgroundPublisher
    from async_rl.weights.config import PublisherConfig

    async def main():
        url, prefix = sys.argv[1], sys.argv[2]
        names = Names(prefix)
        r = aioredis.Redis.from_url(url)
        pub = WeightPublisher(r, RedisTransport(url, names), names, PublisherConfig(bucket_bytes=1 << 20))
        bg = BackgroundPublisher(pub)
        model = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(150)}  # 150 MiB in 1 MiB buckets
        await bg.flush(0, lambda: model.items())
        print("v0", flush=True)
        for t in model.values():
            t.uniform_()  # nothing compresses: v1 is as large as v0
        await bg.offer(1, lambda: model.items())
        print("v1 snapshot", flush=True)
        await asyncio.sleep(3600)  # training on while v1 goes out in the background

    asyncio.run(main())
    """
)


async def test_learner_killed_mid_background_publish_leaves_no_half_version(
    redis_client: aioredis.Redis, names: Names, servers: ServerSet
) -> None:
    code = await kill_mid_version(_KILLED_LEARNER, servers, names, redis_client, (b"v0", b"v1 snapshot"))
    assert code == -signal.SIGKILL
    reader = _reader(redis_client, servers, names)
    assert await reader.latest_version() == 0, "the publish finished before the kill: make v1 larger"
    with pytest.raises(VersionUnavailable):
        await reader.fetch(1)
    got = await reader.fetch()  # generators keep the last complete version
    assert got.version == 0 and torch.equal(got.tensors["w7"], torch.full((1 << 18,), 7.0))
    pub = WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names)
    assert await pub.clean_staging() == [1]
    assert await redis_client.exists(names.weights_bucket(1, 0), names.weights_bucket(1, 3)) == 0


async def test_corrupt_payload_names_the_tensor(redis_client: aioredis.Redis, servers: ServerSet, names: Names) -> None:
    """A delta payload that checks as bytes (its bucket checksum rewritten) but does not decode to the tensor's
    checksum is refused with the tensor's name."""
    bg = _bg(redis_client, servers, names)
    model = _model()
    await bg.flush(0, lambda: model.items())
    m1 = _step(model, 1)
    await bg.flush(1, lambda: m1.items())
    reader = _reader(redis_client, servers, names)
    base = await reader.fetch(0)
    base.tensors["still.fp32"] = base.tensors["still.fp32"] + 1  # the held base is wrong: 'same' does not check
    with pytest.raises(CorruptVersion, match="tensor 'still.fp32'.*after applying the delta to v0"):
        await reader.fetch(1, have=base)
    await bg.aclose()
