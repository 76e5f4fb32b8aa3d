"""Small helpers shared by the prompt queue and the rollout buffer (consumer groups, raw entries).

Both streams follow the same rules: one consumer group reads them; an entry is acked *and
deleted* once its consumer is done with it (so ``XLEN`` is the unacked backlog, and nothing is
ever trimmed); entries a dead consumer left pending are reclaimed with ``XAUTOCLAIM`` once idle
longer than a bound.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

# Longest pause between two scans of a pending list for abandoned entries.
MAX_RESCAN_S = 5.0

RawEntry = tuple[str, dict[bytes, bytes] | None]
"""``(entry id, fields)``; fields is None for an entry deleted while it was pending."""


def check_client(redis: Any, owner: str) -> aioredis.Redis:
    """The buffer needs a ``redis.asyncio`` client returning bytes (payloads are binary)."""
    if not isinstance(redis, aioredis.Redis):
        raise ValueError(f"{owner} needs a redis.asyncio.Redis client, got {type(redis).__name__}")
    if redis.connection_pool.connection_kwargs.get("decode_responses"):
        raise ValueError(f"{owner} needs a client with decode_responses=False (payloads are binary)")
    return redis


def sid(entry_id: bytes | str) -> str:
    return entry_id.decode() if isinstance(entry_id, bytes) else entry_id


def field_str(fields: dict[bytes, bytes] | None, name: bytes) -> str | None:
    if not fields or name not in fields:
        return None
    value = fields[name]
    try:
        return value.decode()
    except UnicodeDecodeError:
        return repr(value)


async def ensure_group(redis: aioredis.Redis, stream: str, group: str) -> None:
    """Create ``group`` on ``stream`` (and the stream) reading from the start; a no-op if it exists."""
    try:
        await redis.xgroup_create(stream, group, id="0", mkstream=True)
    except ResponseError as exc:
        if "BUSYGROUP" not in str(exc):
            raise


def parse_entries(raw: Sequence[Any]) -> list[RawEntry]:
    return [(sid(eid), fields) for eid, fields in raw]


async def read_group(
    redis: aioredis.Redis, stream: str, group: str, consumer: str, start: str, count: int, block_ms: int
) -> list[RawEntry]:
    """``XREADGROUP`` from ``start`` (``">"``: new entries; ``"0"``: this consumer's own pending ones)."""
    resp: Any = await redis.xreadgroup(
        group, consumer, {stream: start}, count=count, block=block_ms if block_ms > 0 else None
    )
    if not resp:
        return []
    return parse_entries(resp[0][1])


@dataclass(slots=True)
class Reclaimer:
    """Walks a group's pending entries with ``XAUTOCLAIM``, a cursor per instance so each call advances."""

    stream: str
    """Stream whose pending entries are reclaimed."""
    group: str
    """Consumer group."""
    cursor: str = "0-0"
    """Where the next ``XAUTOCLAIM`` scan starts; wraps to ``0-0`` at the end of the pending list."""
    next_scan_at: float = 0.0
    """Monotonic time before which a new scan from ``0-0`` is skipped (see :meth:`claim`)."""

    async def claim(
        self, redis: aioredis.Redis, consumer: str, min_idle_ms: int, count: int, force: bool = False
    ) -> list[RawEntry]:
        """Entries idle longer than ``min_idle_ms`` on any consumer, now owned by ``consumer``.

        Once a scan has wrapped around the pending list, the next one starts no sooner than
        ``min_idle_ms / 4`` (at most :data:`MAX_RESCAN_S`) later: nothing can become reclaimable
        faster than that matters, and a hot read loop saves a round trip per read. ``force`` scans
        anyway (callers do when there is nothing new to read: an idle reader looks for released work).
        Entries deleted while pending come back with fields None (Redis 6.2) or are dropped from
        the pending list by the server (Redis >= 7); either way they carry no data.
        """
        now = time.monotonic()
        if self.cursor == "0-0" and now < self.next_scan_at and not force:
            return []
        resp: Any = await redis.xautoclaim(
            self.stream, self.group, consumer, min_idle_ms, start_id=self.cursor, count=count
        )
        self.cursor = sid(resp[0])
        if self.cursor == "0-0":
            self.next_scan_at = now + min(min_idle_ms / 4000, MAX_RESCAN_S)
        return parse_entries(resp[1])


async def delivery_counts(
    redis: aioredis.Redis, stream: str, group: str, consumer: str, ids: Sequence[str]
) -> dict[str, int]:
    """How many times each of ``ids`` (pending on ``consumer``) has been delivered."""
    if not ids:
        return {}
    rows: Any = await redis.xpending_range(stream, group, min=min(ids, key=_id_key), max=max(ids, key=_id_key),
                                      count=len(ids) * 4 + 16, consumername=consumer)  # fmt: skip
    wanted = set(ids)
    return {sid(r["message_id"]): int(r["times_delivered"]) for r in rows if sid(r["message_id"]) in wanted}


def _id_key(entry_id: str) -> tuple[int, int]:
    ms, _, seq = entry_id.partition("-")
    return int(ms), int(seq or 0)
