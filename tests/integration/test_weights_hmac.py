"""Signed weight manifests on a real Redis: a reader with the run secret fetches only versions whose HMAC checks,
and a generator's weight sync refuses the others and keeps its weights."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgpack
import pytest
import redis.asyncio as aioredis
import torch

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.weights import CorruptVersion, PublisherConfig, ReaderConfig, WeightPublisher, WeightReader
from async_rl.weights.manifest import Manifest
from async_rl.weights.redis_transport import RedisTransport
from async_rl.weights.signing import RUN_SECRET_ENV, run_secret


def _secret(tmp_path: Path, name: str, value: bytes) -> str:
    path = tmp_path / name
    path.write_bytes(value + b"\n")
    path.chmod(0o600)
    return str(path)


def _tensors(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(8, 16, generator=g), "b.bias": torch.randn(16, generator=g)}


def _reader(redis_client, servers: ServerSet, names: Names, secret_file: str = "") -> WeightReader:  # type: ignore[no-untyped-def]
    return WeightReader(redis_client, RedisTransport(servers.redis_url, names), names,
                        ReaderConfig(secret_file=secret_file))  # fmt: skip


async def test_only_manifests_whose_hmac_checks_are_read(redis_client: aioredis.Redis, servers: ServerSet,
                                                         names: Names, tmp_path: Path) -> None:  # fmt: skip
    good = _secret(tmp_path, "run.secret", b"a" * 32)
    other = _secret(tmp_path, "other.secret", b"b" * 32)
    pub = WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names,
                          PublisherConfig(secret_file=good))  # fmt: skip
    await pub.publish(_tensors(0), 0)
    fetched = await _reader(redis_client, servers, names, good).fetch(0)
    assert torch.equal(fetched.tensors["a.weight"], _tensors(0)["a.weight"])
    with pytest.raises(CorruptVersion, match="HMAC does not check against the run secret"):
        await _reader(redis_client, servers, names, other).fetch(0)
    # A reader without a secret cannot check, and reads it (the secret is the reader's to require).
    assert (await _reader(redis_client, servers, names).fetch(0)).version == 0
    # Tampering with the signed bytes (a shape, a checksum) breaks the HMAC.
    raw = await redis_client.get(names.weights_manifest(0))
    wrapper = msgpack.unpackb(raw)
    body = msgpack.unpackb(wrapper["signed"])
    body["buckets"][0][2] ^= 1
    wrapper["signed"] = msgpack.packb(body)
    await redis_client.set(names.weights_manifest(0), msgpack.packb(wrapper))
    with pytest.raises(CorruptVersion, match="HMAC does not check"):
        await _reader(redis_client, servers, names, good).fetch(0)
    # An unsigned manifest (a publisher without the secret) is refused by a reader that has one.
    await WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names).publish(_tensors(1), 1)
    with pytest.raises(CorruptVersion, match="carries no HMAC"):
        await _reader(redis_client, servers, names, good).fetch(1)
    assert Manifest.decode(await redis_client.get(names.weights_manifest(1))).version == 1


def test_run_secret_sources(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(RUN_SECRET_ENV, raising=False)
    monkeypatch.delenv("ASYNC_RL_RUN_SECRET_FILE", raising=False)
    assert run_secret() is None
    monkeypatch.setenv(RUN_SECRET_ENV, "x" * 20)
    assert run_secret() == b"x" * 20
    monkeypatch.setenv("ASYNC_RL_RUN_SECRET_FILE", _secret(tmp_path, "s", b"y" * 24))
    assert run_secret() == b"y" * 24  # the file wins over the variable
    assert run_secret(_secret(tmp_path, "t", b"z" * 16)) == b"z" * 16  # the config's file wins over both
    with pytest.raises(ValueError, match="needs at least 16"):
        run_secret(_secret(tmp_path, "short", b"abc"))
    with pytest.raises(ValueError, match="cannot be read"):
        run_secret(str(tmp_path / "missing"))


async def test_weight_sync_refuses_a_version_whose_hmac_fails(redis_client: aioredis.Redis, servers: ServerSet,
                                                              names: Names, tmp_path: Path) -> None:  # fmt: skip
    from actors.generator.config import TorchEngineConfig, WeightSyncConfig
    from actors.generator.torch_engine import TorchEngine
    from actors.generator.weight_sync import WeightSync
    from async_rl.model.presets import ModelConfig, build_model

    good = _secret(tmp_path, "run.secret", b"g" * 32)
    forged = _secret(tmp_path, "forged.secret", b"f" * 32)

    def weights(seed: int) -> dict[str, torch.Tensor]:
        return {k: v.clone() for k, v in build_model("tiny-moe", seed=seed).state_dict().items()}

    def publisher(secret: str) -> WeightPublisher:
        return WeightPublisher(redis_client, RedisTransport(servers.redis_url, names), names,
                               PublisherConfig(bucket_bytes=64 << 10, secret_file=secret))  # fmt: skip

    engine = TorchEngine(TorchEngineConfig(model=ModelConfig(name="tiny-moe", seed=99), max_batch_prompts=2))
    try:
        await publisher(good).publish(weights(0), 0)
        reader = _reader(redis_client, servers, names, good)
        sync = WeightSync(engine, reader, names, WeightSyncConfig(poll_interval_s=0.05, max_retries=1))
        await sync.start()
        async with sync.following():
            assert engine.version == 0
            await publisher(forged).publish(weights(1), 1)  # someone with write access but not the secret
            for _ in range(100):
                if sync.num_failures:
                    break
                await asyncio.sleep(0.05)
            assert sync.num_failures >= 1 and engine.version == 0  # refused, the old weights stay
            state = engine.model.state_dict()
            assert all(torch.equal(state[k], v) for k, v in weights(0).items())
    finally:
        await engine.close()

