"""Fixtures of the integration tests that start real learner and generator processes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from async_rl.names import Names
from async_rl.servers import ServerSet
from tests.integration.procs import Procs


@pytest.fixture
def procs(servers: ServerSet, names: Names, tmp_path: Path) -> Iterator[Procs]:
    """Processes of one test run under ``tmp_path/run``; whatever still runs is killed at the end."""
    p = Procs(servers, names, tmp_path / "run")
    yield p
    p.close()
