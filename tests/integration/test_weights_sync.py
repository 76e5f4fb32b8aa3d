"""Generator-side WeightSync with a real TorchEngine, real Redis and NATS."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
import redis.asyncio as aioredis
import torch

from actors.generator.config import TorchEngineConfig, WeightSyncConfig
from actors.generator.engine import SamplingParams
from actors.generator.torch_engine import TorchEngine
from actors.generator.weight_sync import WeightSync
from async_rl.model.presets import ModelConfig, build_model
from async_rl.run.names import Names
from async_rl.servers.control import ControlPlane, WeightsAnnounced
from async_rl.servers.embedded import ServerSet
from async_rl.weights import WeightPublisher, WeightReader
from async_rl.weights.config import PublisherConfig
from async_rl.weights.redis_transport import RedisTransport

PRESET = "tiny-moe"


def _weights(seed: int) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in build_model(PRESET, seed=seed).state_dict().items()}


def _engine_holds(engine: TorchEngine, weights: dict[str, torch.Tensor]) -> bool:
    state = engine.model.state_dict()
    return all(torch.equal(state[k], v) for k, v in weights.items())


@pytest.fixture
async def engine():  # type: ignore[no-untyped-def]
    e = TorchEngine(TorchEngineConfig(model=ModelConfig(name=PRESET, seed=99), max_batch_prompts=4))
    yield e
    await e.close()


def _publisher(redis_client: aioredis.Redis, servers: ServerSet, names: Names, control=None) -> WeightPublisher:  # type: ignore[no-untyped-def]
    return WeightPublisher(
        redis_client, RedisTransport(servers.redis_url, names), names, PublisherConfig(bucket_bytes=64 << 10), control
    )


def _sync(engine, redis_client, servers, names, control=None, **cfg) -> WeightSync:  # type: ignore[no-untyped-def]
    reader = WeightReader(redis_client, RedisTransport(servers.redis_url, names), names)
    return WeightSync(engine, reader, names, WeightSyncConfig(**cfg), control)


async def test_started_mid_run_it_loads_the_newest_version_before_the_first_token(
    engine: TorchEngine, redis_client: aioredis.Redis, servers: ServerSet, names: Names
) -> None:
    pub = _publisher(redis_client, servers, names)
    for v in range(3):
        await pub.publish(_weights(v), v)
    sync = _sync(engine, redis_client, servers, names, poll_interval_s=60)
    await sync.start()
    async with sync.following():
        assert engine.version == 2 and sync.staged_version == 2 and sync.num_staged == 1  # v0, v1 never fetched
        assert _engine_holds(engine, _weights(2))
        out = await engine.generate([np.array([1, 5, 6, 7], dtype=np.int32)], SamplingParams(n=2, max_new_tokens=4))
        assert all((c.versions == 2).all() for c in out[0])


async def test_start_waits_for_the_first_version_and_times_out_without_one(
    engine: TorchEngine, redis_client: aioredis.Redis, servers: ServerSet, names: Names
) -> None:
    with pytest.raises(TimeoutError, match="no usable weight version of .* within 0.3s"):
        await _sync(engine, redis_client, servers, names, first_version_timeout_s=0.3, poll_interval_s=0.1).start()
    sync = _sync(engine, redis_client, servers, names, first_version_timeout_s=30, poll_interval_s=0.05)
    starting = asyncio.create_task(sync.start(), name="sync-start")
    await asyncio.sleep(0.2)
    assert not starting.done()
    await _publisher(redis_client, servers, names).publish(_weights(5), 0)
    await asyncio.wait_for(starting, 30)
    async with sync.following():
        assert engine.version == 0 and _engine_holds(engine, _weights(5))


async def test_follows_announcements_over_nats(
    engine: TorchEngine, redis_client: aioredis.Redis, servers: ServerSet, names: Names
) -> None:
    async with ControlPlane(servers.nats_url) as learner_cp, ControlPlane(servers.nats_url) as gen_cp:
        pub = _publisher(redis_client, servers, names, control=learner_cp)
        await pub.publish(_weights(0), 0)
        sync = _sync(engine, redis_client, servers, names, control=gen_cp, poll_interval_s=3600)  # no polling
        await sync.start()
        async with sync.following():
            await gen_cp.flush()
            for v in (1, 2):
                await pub.publish(_weights(v), v)
                assert await sync.wait_staged(v, 20), sync.last_error
                assert await engine.wait_applied(v, 20)
                # A full version goes to the torch engine bucket by bucket as each is verified.
                assert sync.last_fetch is not None and sync.last_fetch.streamed
            assert _engine_holds(engine, _weights(2))


async def test_polls_latest_when_announcements_are_missed(
    engine: TorchEngine, redis_client: aioredis.Redis, servers: ServerSet, names: Names
) -> None:
    pub = _publisher(redis_client, servers, names)  # announces nothing
    await pub.publish(_weights(0), 0)
    sync = _sync(engine, redis_client, servers, names, poll_interval_s=0.1)
    await sync.start()
    async with sync.following():
        await pub.publish(_weights(1), 1)
        assert await sync.wait_staged(1, 20)
        assert await engine.wait_applied(1, 20) and _engine_holds(engine, _weights(1))


async def test_corrupt_version_is_refused_and_the_old_weights_stay(
    engine: TorchEngine, redis_client: aioredis.Redis, servers: ServerSet, names: Names
) -> None:
    async with ControlPlane(servers.nats_url) as learner_cp, ControlPlane(servers.nats_url) as gen_cp:
        pub = _publisher(redis_client, servers, names)  # publishes silently: we corrupt, then announce
        await pub.publish(_weights(0), 0)
        sync = _sync(engine, redis_client, servers, names, control=gen_cp, poll_interval_s=3600)
        await sync.start()
        async with sync.following():
            await gen_cp.flush()
            m1 = await pub.publish(_weights(1), 1)
            key = names.weights_bucket(1, m1.num_buckets // 2)
            raw = bytearray(await redis_client.get(key))
            raw[17] ^= 0xFF
            await redis_client.set(key, bytes(raw))
            announce = WeightsAnnounced(version=1, manifest_key=names.weights_manifest(1), total_bytes=m1.total_bytes)
            await learner_cp.publish(names.weights_subject, announce)
            assert not await sync.wait_staged(1, 20)
            assert sync.num_refused == 1 and 1 in sync.refused and "xxh3_64" in sync.last_error
            assert engine.version == 0 and _engine_holds(engine, _weights(0))
            # The next good version is taken.
            await pub.publish(_weights(2), 2)
            await learner_cp.publish(
                names.weights_subject,
                WeightsAnnounced(version=2, manifest_key=names.weights_manifest(2), total_bytes=m1.total_bytes),
            )
            assert await sync.wait_staged(2, 20) and await engine.wait_applied(2, 20)
            assert _engine_holds(engine, _weights(2)) and sync.num_refused == 1


async def test_a_version_the_engine_rejects_is_refused(
    engine: TorchEngine, redis_client: aioredis.Redis, servers: ServerSet, names: Names
) -> None:
    pub = _publisher(redis_client, servers, names)
    await pub.publish(_weights(0), 0)
    sync = _sync(engine, redis_client, servers, names, poll_interval_s=0.05)
    await sync.start()
    async with sync.following():
        wrong = _weights(1)
        wrong.pop(next(iter(wrong)))  # incomplete set of names: the engine's check refuses it
        await pub.publish(wrong, 1)
        assert not await sync.wait_staged(1, 20)
        assert sync.num_refused == 1 and "incomplete" in sync.last_error
        assert engine.version == 0 and _engine_holds(engine, _weights(0))
