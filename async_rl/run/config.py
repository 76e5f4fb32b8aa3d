"""Where a process finds its run: the key prefix and the Redis / NATS URLs."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from async_rl.run.names import Names


@dataclass(kw_only=True, slots=True)
class RunConfig:
    """Shared by every process of one run."""

    prefix: str = "async-rl"
    """Key prefix of the run in Redis and subject prefix in NATS (processes of one run share it)."""
    redis_url: str | None = None
    """Redis URL (e.g. redis://host:6379/0). None: $ASYNC_RL_REDIS_URL, else an embedded server (single-host runs)."""
    nats_url: str | None = None
    """NATS URL (e.g. nats://host:4222). None: $ASYNC_RL_NATS_URL, else an embedded server (single-host runs)."""
    run_dir: Path = Path("runs/default")
    """Local directory for checkpoints, metrics.jsonl, the resolved config and wandb files."""

    def __post_init__(self) -> None:
        Names(prefix=self.prefix)  # validates the prefix
        if self.redis_url is None:
            self.redis_url = os.environ.get("ASYNC_RL_REDIS_URL") or None
        if self.nats_url is None:
            self.nats_url = os.environ.get("ASYNC_RL_NATS_URL") or None
        for field_name, url, schemes in (("redis_url", self.redis_url, ("redis", "rediss", "unix")),
                                         ("nats_url", self.nats_url, ("nats", "tls", "ws", "wss"))):  # fmt: skip
            if url is not None and url.split("://", 1)[0] not in schemes:
                raise ValueError(f"run.{field_name} must start with one of {[s + '://' for s in schemes]}, got {url!r}")

    @property
    def names(self) -> Names:
        return Names(prefix=self.prefix)
