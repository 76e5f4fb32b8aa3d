"""A snapshot of the buffer's state for ``async-rl status`` and metrics: counters, depths, consumers."""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from async_rl.run.names import Names
from buffer.audit import Audit
from buffer.dead_letters import DeadLetters
from buffer.streams import check_client


def _text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


async def _counters(redis: aioredis.Redis, key: str) -> dict[str, int]:
    raw = await redis.hgetall(key)
    return {_text(k): int(v) for k, v in raw.items()}


async def _group(redis: aioredis.Redis, stream: str, group: str) -> dict[str, Any]:
    """Depth of ``stream`` and the state of ``group`` on it (zeros when neither exists yet)."""
    out: dict[str, Any] = {"length": int(await redis.xlen(stream)), "pending": 0, "lag": None, "consumers": []}
    try:
        groups = await redis.xinfo_groups(stream)
    except ResponseError:  # no such stream yet
        return out
    for g in groups:
        if _text(g.get("name")) != group:
            continue
        out["pending"] = int(g.get("pending", 0))
        lag = g.get("lag")
        out["lag"] = None if lag is None else int(lag)
        consumers = await redis.xinfo_consumers(stream, group)
        out["consumers"] = [
            {"name": _text(c.get("name")), "pending": int(c.get("pending", 0)), "idle_ms": int(c.get("idle", 0))}
            for c in consumers
        ]
    return out


async def buffer_stats(redis: aioredis.Redis, names: Names, num_dead_letters: int = 5) -> dict[str, Any]:
    """Counters and stream state of one run, as plain JSON-able data.

    ``audit`` holds the fates of issued prompts (issued, trained, dropped_stale, dead_lettered,
    in_flight: the open prompts admission control bounds); ``rollouts.backlog`` is the number of
    groups appended and not yet acked (the stream's length).
    """
    check_client(redis, "buffer_stats")
    pc = await _counters(redis, names.prompt_counters)
    rc = await _counters(redis, names.rollout_counters)
    audit = await Audit(redis, names).counters()
    prompts = await _group(redis, names.prompts_stream, names.prompts_group)
    rollouts = await _group(redis, names.rollouts_stream, names.rollouts_group)
    dl = DeadLetters(redis, names)
    letters = await dl.read(count=num_dead_letters) if num_dead_letters > 0 else []
    return {
        "prompts": {
            "issued": audit["issued"],
            "in_flight": audit["in_flight"],
            "dead_letters": pc.get("dead_letters", 0),
            "stream": prompts,
        },
        "rollouts": {
            **{k: rc.get(k, 0) for k in ("appended", "consumed", "dropped_stale", "duplicates", "dead_letters")},
            **{k: v for k, v in rc.items() if k not in ("appended", "consumed", "dropped_stale", "duplicates")},
            "backlog": rollouts["length"],
            "stream": rollouts,
        },
        "audit": audit,
        "dead_letters": {
            "length": await dl.count(),
            "latest": [
                {
                    "reason": d.reason,
                    "error": d.error,
                    "source_stream": d.source_stream,
                    "source_id": d.source_id,
                    "generator": d.generator,
                    "group_id": d.group_id,
                    "at": d.at,
                    "payload_bytes": d.payload_bytes,
                }
                for d in letters
            ],
        },
    }
