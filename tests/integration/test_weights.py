"""Publisher and reader against real servers: round trips, atomic visibility, corruption, pruning, leases."""

from __future__ import annotations

import asyncio
import signal
import textwrap
from pathlib import Path

import pytest
import redis.asyncio as aioredis
import torch

from async_rl.run.names import Names
from async_rl.servers.control import ControlPlane, WeightsAnnounced
from async_rl.servers.embedded import ServerSet
from async_rl.weights import (
    DTYPES,
    CorruptVersion,
    PublisherConfig,
    VersionUnavailable,
    WeightPublisher,
    WeightReader,
)
from async_rl.weights.redis_transport import RedisTransport
from async_rl.weights.shm_transport import SharedMemoryTransport
from async_rl.weights.transport import BucketTransport
from tests.integration.killing import kill_mid_version


def _model(seed: int, scale: int = 1) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for i, (name, dt) in enumerate(DTYPES.items()):
        shape = (4 * scale, 33 + i)
        if dt == torch.bool:
            out[f"layer.{name}"] = torch.randint(0, 2, shape, generator=g).bool()
        elif dt.is_floating_point:
            out[f"layer.{name}"] = (torch.randn(shape, generator=g) * 3).to(dt)
        else:
            out[f"layer.{name}"] = torch.randint(-100, 100, shape, generator=g).to(dt)
    out["big.bf16"] = torch.randn(64, 512 * scale, generator=g).to(torch.bfloat16)  # 64 KiB: larger than a bucket
    return out


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(
        a[k].dtype == b[k].dtype and torch.equal(a[k].reshape(-1).view(torch.uint8), b[k].reshape(-1).view(torch.uint8))
        for k in a
    )


@pytest.fixture(params=["redis", "shm"])
async def transport(request: pytest.FixtureRequest, servers: ServerSet, names: Names):  # type: ignore[no-untyped-def]
    t: BucketTransport
    if request.param == "redis":
        t = RedisTransport(servers.redis_url, names)
    else:
        t = SharedMemoryTransport(names)
    yield t
    for v in range(16):
        await t.delete(v, 64)
    await t.close()


async def test_round_trip_every_dtype(redis_client: aioredis.Redis, names: Names, transport: BucketTransport) -> None:
    pub = WeightPublisher(redis_client, transport, names, PublisherConfig(bucket_bytes=2 << 10))
    model = _model(0)
    m = await pub.publish(model, 0)
    assert m.num_buckets >= 3 and m.transport == transport.name and m.checksum == "xxh3_64"
    assert m.total_bytes >= sum(t.numel() * t.element_size() for t in model.values())
    big = next(t.pieces[0] for t in m.tensors if t.name == "big.bf16")
    assert big.offset == 0 and m.buckets[big.bucket].nbytes == big.nbytes  # alone in its bucket
    reader = WeightReader(redis_client, transport, names)
    assert await reader.latest_version() == 0
    got = await reader.fetch()
    assert got.version == 0 and _same(got.tensors, model)
    assert list(got.tensors) == list(model)  # publication order kept
    assert got.tensors["big.bf16"].dtype == torch.bfloat16
    # the lease is released after the read
    assert await redis_client.zcard(names.weights_readers(0)) == 0


async def test_version_must_increase(redis_client: aioredis.Redis, names: Names, servers: ServerSet) -> None:
    pub = WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names)
    await pub.publish({"w": torch.ones(3)}, 5)
    with pytest.raises(ValueError, match="version 5 is not newer than the latest published version 5"):
        await pub.publish({"w": torch.ones(3)}, 5)
    with pytest.raises(ValueError, match="nothing to publish"):
        await pub.publish({}, 6)


async def test_corrupt_bucket_is_refused(redis_client: aioredis.Redis, names: Names, servers: ServerSet) -> None:
    transport = RedisTransport(servers.redis_url, names)
    pub = WeightPublisher(redis_client, transport, names, PublisherConfig(bucket_bytes=16 << 10))
    reader = WeightReader(redis_client, transport, names)
    await pub.publish(_model(0), 0)
    m1 = await pub.publish(_model(1), 1)
    key = names.weights_bucket(1, m1.num_buckets - 1)
    raw = bytearray(await redis_client.get(key))
    raw[len(raw) // 2] ^= 0x40  # one flipped bit
    await redis_client.set(key, bytes(raw))
    with pytest.raises(CorruptVersion, match=r"bucket \d+: xxh3_64"):
        await reader.fetch(1)
    await redis_client.set(key, bytes(raw[:-8]))  # truncated
    with pytest.raises(CorruptVersion, match=r"holds \d+ bytes, expected \d+"):
        await reader.fetch(1)
    await redis_client.set(names.weights_manifest(1), b"\x93garbage")
    with pytest.raises(CorruptVersion, match="malformed"):
        await reader.fetch(1)
    assert _same((await reader.fetch(0)).tensors, _model(0))  # the previous version is intact
    assert await redis_client.zcard(names.weights_readers(1)) == 0  # failed reads release their lease


_KILLED_PUBLISHER = textwrap.dedent(
    """
    import asyncio, sys, torch, redis.asyncio as aioredis
    from async_rl.run.names import Names
    from async_rl.weights.redis_transport import RedisTransport
    from async_rl.weights import WeightPublisher
    from async_rl.weights.config import PublisherConfig

    async def main():
        url, prefix = sys.argv[1], sys.argv[2]
        names = Names(prefix)
        r = aioredis.Redis.from_url(url)
        pub = WeightPublisher(r, RedisTransport(url, names), names, PublisherConfig(bucket_bytes=1 << 20))
        await pub.publish({"w": torch.zeros(1000)}, 0)
        model = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(200)}  # 200 MiB in 1 MiB buckets
        print("v0", flush=True)
        await pub.publish(model, 1)
        print("v1 complete", flush=True)

    asyncio.run(main())
    """
)


async def test_killed_publisher_leaves_an_invisible_version_that_is_cleaned(
    redis_client: aioredis.Redis, names: Names, servers: ServerSet
) -> None:
    code = await kill_mid_version(_KILLED_PUBLISHER, servers, names, redis_client, (b"v0",))
    assert code == -signal.SIGKILL
    transport = RedisTransport(servers.redis_url, names)
    reader = WeightReader(redis_client, transport, names)
    assert await reader.latest_version() == 0
    assert [int(v) for v in await redis_client.zrange(names.weights_versions, 0, -1)] == [0]
    with pytest.raises(VersionUnavailable, match="version 1 is not available"):
        await reader.fetch(1)
    assert await redis_client.hget(names.weights_staging, "1") == b"200"
    # A restarted publisher deletes the half-written buckets before publishing.
    pub = WeightPublisher(redis_client, transport, names)
    assert await pub.clean_staging() == [1]
    assert await redis_client.exists(names.weights_bucket(1, 0), names.weights_bucket(1, 3)) == 0
    assert await redis_client.hlen(names.weights_staging) == 0
    await pub.publish({"w": torch.ones(1000)}, 1)
    assert torch.equal((await reader.fetch()).tensors["w"], torch.ones(1000))


async def test_keep_last_n_and_leases_protect_readers(
    redis_client: aioredis.Redis, names: Names, transport: BucketTransport
) -> None:
    pub = WeightPublisher(redis_client, transport, names, PublisherConfig(bucket_bytes=16 << 10, keep_versions=2))
    reader = WeightReader(redis_client, transport, names)
    slow = WeightReader(redis_client, transport, names, reader_id="slow-reader")
    await pub.publish(_model(0), 0)
    m1 = await pub.publish(_model(1), 1)
    assert await slow._lease(1)  # a slow reader is in the middle of version 1
    for v in range(2, 5):
        await pub.publish(_model(v), v)
    assert [int(v) for v in await redis_client.zrange(names.weights_versions, 0, -1)] == [3, 4]
    assert await redis_client.get(names.weights_latest) == b"4"
    # v0 and v2: deleted everywhere; v1: hidden, but its data stays while the lease lives.
    for gone in (0, 2):
        assert await redis_client.exists(names.weights_manifest(gone)) == 0
        with pytest.raises(VersionUnavailable):
            await reader.fetch(gone)
        if isinstance(transport, RedisTransport):
            assert await redis_client.exists(names.weights_bucket(gone, 0)) == 0
    assert _same((await slow.fetch(1)).tensors, _model(1))  # still readable (fetch renews, then releases)
    assert await redis_client.hget(names.weights_retiring, "1") == str(m1.num_buckets).encode()
    await pub.prune()  # no lease any more: now it goes
    assert await redis_client.hlen(names.weights_retiring) == 0
    with pytest.raises(VersionUnavailable):
        await reader.fetch(1)
    assert _same((await reader.fetch(3)).tensors, _model(3))
    assert _same((await reader.fetch(4)).tensors, _model(4))


async def test_expired_lease_does_not_block_pruning(
    redis_client: aioredis.Redis, names: Names, servers: ServerSet
) -> None:
    from async_rl.weights.config import ReaderConfig

    transport = RedisTransport(servers.redis_url, names)
    pub = WeightPublisher(redis_client, transport, names, PublisherConfig(keep_versions=1))
    crashed = WeightReader(redis_client, transport, names, ReaderConfig(lease_ttl_s=0.2), reader_id="crashed")
    await pub.publish({"w": torch.zeros(10)}, 0)
    assert await crashed._lease(0)  # then the reader dies without releasing
    await pub.publish({"w": torch.ones(10)}, 1)
    assert await redis_client.exists(names.weights_manifest(0)) == 1
    await asyncio.sleep(0.3)
    assert await pub.prune() == [0]
    assert await redis_client.exists(names.weights_manifest(0), names.weights_bucket(0, 0)) == 0


async def test_publish_announces_on_nats(redis_client: aioredis.Redis, names: Names, servers: ServerSet) -> None:
    got: asyncio.Queue[WeightsAnnounced] = asyncio.Queue()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        await got.put(msg)

    async with ControlPlane(servers.nats_url) as sub_side, ControlPlane(servers.nats_url) as pub_side:
        await sub_side.subscribe(names.weights_subject, on_msg)
        await sub_side.flush()
        pub = WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names, control=pub_side)
        m = await pub.publish(_model(3), 3)
        msg = await asyncio.wait_for(got.get(), 5)
    assert isinstance(msg, WeightsAnnounced)
    assert (msg.version, msg.manifest_key, msg.total_bytes) == (3, names.weights_manifest(3), m.total_bytes)
    assert msg.num_buckets == m.num_buckets and msg.transport == "redis"


async def test_transport_errors_are_named(servers: ServerSet, names: Names, tmp_path: Path) -> None:
    from async_rl.servers.embedded import free_port
    from async_rl.weights.transport import BucketMissing, TransportConfig, TransportError, make_transport

    t = make_transport(TransportConfig(), servers.redis_url, names)
    with pytest.raises(BucketMissing, match="bucket 0 of weights version 9 is missing"):
        await t.get(9, 0)
    data = memoryview(bytes(range(256)) * 1000)
    await t.put(9, 0, data)
    assert bytes(await t.get(9, 0)) == bytes(data)
    await t.delete(9, 1)
    await t.close()
    dead = RedisTransport(f"redis://127.0.0.1:{free_port()}/0", names, timeout_s=1)
    with pytest.raises(TransportError, match="transfer failed"):
        await dead.get(0, 0)
    with pytest.raises(ValueError, match="transport.connections"):
        TransportConfig(connections=0)
    # Chosen by scheme, explicitly: a typo or an unknown scheme is refused, never taken for shared memory.
    with pytest.raises(ValueError, match="scheme 'nixl' is not one of"):
        TransportConfig(url="nixl://host:1")
    with pytest.raises(ValueError, match="names no directory"):
        TransportConfig(url="shm://")
    shm = make_transport(TransportConfig(url=f"shm://{tmp_path}"), servers.redis_url, names)
    assert shm.name == "shm" and str(shm.root).startswith(str(tmp_path))
    assert make_transport(TransportConfig(url="redis://127.0.0.1:1/0"), servers.redis_url, names).name == "redis"
    t = RedisTransport("unix:///tmp/no-such.sock", names, connections=1)
    for _ in range(2):  # the failed connection gives its pool slot back
        with pytest.raises(ValueError, match="only redis:// and rediss:// URLs"):
            await asyncio.wait_for(t.get(0, 0), 5)
    assert make_transport(TransportConfig(url="rediss://127.0.0.1:1/0"), servers.redis_url, names).name == "redis"


async def test_a_bucket_larger_than_one_redis_value_travels_in_parts(
    redis_client: aioredis.Redis, names: Names, servers: ServerSet
) -> None:
    transport = RedisTransport(servers.redis_url, names, part_bytes=10_000)
    pub = WeightPublisher(redis_client, transport, names, PublisherConfig(bucket_bytes=16 << 10, keep_versions=1))
    model = _model(0)  # "big.bf16" (64 KiB) gets a bucket of its own: 7 parts of at most 10 kB
    m = await pub.publish(model, 0)
    big = next(t.pieces[0] for t in m.tensors if t.name == "big.bf16")
    assert await redis_client.exists(*(names.weights_bucket_part(0, big.bucket, p) for p in range(1, 7))) == 6
    reader = WeightReader(redis_client, transport, names)
    assert _same((await reader.fetch(0)).tensors, model)
    # A missing part makes the version unavailable; a part of the wrong size makes it corrupt.
    part = names.weights_bucket_part(0, big.bucket, 3)
    raw = await redis_client.get(part)
    await redis_client.delete(part)
    with pytest.raises(VersionUnavailable, match="missing"):
        await reader.fetch(0)
    await redis_client.set(part, raw[:-1])
    with pytest.raises(CorruptVersion, match="holds 9999 bytes, expected 10000"):
        await reader.fetch(0)
    await redis_client.set(part, raw)
    assert _same((await reader.fetch(0)).tensors, model)
    await pub.publish({"w": torch.ones(4)}, 1)  # prunes version 0, parts included
    assert await redis_client.exists(names.weights_bucket(0, big.bucket), part) == 0
    with pytest.raises(ValueError, match="exceeds the Redis transport"):
        await transport.put(2, 0, memoryview(bytes(10_000 * 64 + 1)))


async def test_a_reader_mid_version_is_not_cut_off_by_pruning(
    redis_client: aioredis.Redis, names: Names, servers: ServerSet
) -> None:
    transport = RedisTransport(servers.redis_url, names)
    pub = WeightPublisher(redis_client, transport, names, PublisherConfig(bucket_bytes=1 << 20, keep_versions=1))
    big = {f"w{i}": torch.full((1 << 18,), float(i)) for i in range(120)}  # 120 MiB in 1 MiB buckets
    await pub.publish(big, 1)
    reader = WeightReader(redis_client, transport, names)
    reading = asyncio.create_task(reader.fetch(1), name="slow-read")
    while await redis_client.zcard(names.weights_readers(1)) == 0:  # the reader holds its lease
        assert not reading.done()
        await asyncio.sleep(0.001)
    await pub.publish({"w": torch.zeros(4)}, 2)  # prunes version 1 while it is being read
    assert not reading.done(), "the read finished before the prune: make the version larger"
    assert await redis_client.zrange(names.weights_versions, 0, -1) == [b"2"]
    got = await reading
    assert all(torch.equal(got.tensors[k], v) for k, v in big.items())
    assert await pub.prune() == [1]  # the lease is gone: now version 1 is deleted
    assert await redis_client.exists(names.weights_bucket(1, 0), names.weights_manifest(1)) == 0
