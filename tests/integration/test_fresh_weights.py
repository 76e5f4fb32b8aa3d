"""A batch about to start waits for a newer version that is on its way (``weight_sync.fresh_wait_s``), once per
version, with a real torch engine, weight sync, publisher and Redis."""

from __future__ import annotations

import time

import redis.asyncio as aioredis
import torch

from actors.generator.config import GeneratorConfig, TorchEngineConfig, WeightSyncConfig
from actors.generator.process import Generator
from actors.generator.torch_engine import TorchEngine
from actors.generator.weight_sync import WeightSync
from async_rl.model.presets import ModelConfig, build_model
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.weights import WeightPublisher, WeightReader
from async_rl.weights.background import BackgroundPublisher
from async_rl.weights.config import PublisherConfig
from async_rl.weights.redis_transport import RedisTransport


async def test_a_batch_waits_once_for_the_version_on_its_way(redis_client: aioredis.Redis, servers: ServerSet,
                                                            names: Names) -> None:  # fmt: skip
    weights = {k: v.clone() for k, v in build_model("tiny-moe", seed=3).state_dict().items()}
    transport = RedisTransport(servers.redis_url, names)
    bg = BackgroundPublisher(WeightPublisher(redis_client, transport, names, PublisherConfig()))
    await bg.flush(0, lambda: weights.items())
    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name="tiny-moe", seed=99), max_batch_prompts=4))
    sync_cfg = WeightSyncConfig(poll_interval_s=60.0, fresh_wait_s=20.0)  # no poll: only what is announced is wanted
    sync = WeightSync(engine, WeightReader(redis_client, transport, names), names, sync_cfg)
    proc = Generator(GeneratorConfig(weight_sync=sync_cfg))
    proc._engine, proc._sync = engine, sync
    try:
        assert await sync.start()
        async with sync.following():
            await proc._fresh_weights()  # nothing newer announced: no wait
            assert engine.version == 0
            v1 = {k: v * 1.01 if v.is_floating_point() else v for k, v in weights.items()}
            await bg.flush(1, lambda: v1.items())
            sync._want(1)  # what the announcement of v1 does
            await proc._fresh_weights()  # the batch starts on v1
            assert engine.version == 1
            assert all(torch.equal(engine.model.state_dict()[k], v) for k, v in v1.items())
            # A version announced that does not come (yet): waited for once, up to fresh_wait_s, then never again.
            proc.cfg.weight_sync.fresh_wait_s = 0.3
            sync._want(5)
            t0 = time.monotonic()
            await proc._fresh_weights()
            assert 0.25 <= time.monotonic() - t0 < 5 and engine.version == 1
            t0 = time.monotonic()
            await proc._fresh_weights()
            assert time.monotonic() - t0 < 0.05
    finally:
        await engine.close()
        await bg.aclose()
