"""Fixtures of the integration tests that start real learner and generator processes."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from tests.integration.procs import Procs


@pytest.fixture
def procs(servers: ServerSet, names: Names, tmp_path: Path) -> Iterator[Procs]:
    """Processes of one test run under ``tmp_path/run``; whatever still runs is killed at the end."""
    p = Procs(servers, names, tmp_path / "run")
    yield p
    p.close()


@pytest.fixture
def other(servers: ServerSet) -> Iterator[Names]:
    """Another run's prefix (canary keys live there), cleaned up like the test's own."""
    n = Names(prefix=f"t-other-{uuid.uuid4().hex[:8]}")
    yield n
    client = redis.Redis.from_url(servers.redis_url)
    keys = list(client.scan_iter(match=n.all_key_pattern()))
    if keys:
        client.delete(*keys)
    client.close()
