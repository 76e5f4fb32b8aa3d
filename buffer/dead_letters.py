"""The dead-letter stream: entries that could not be decoded or used, with their reason and source.

A malformed entry never crashes a reader and never vanishes: in one transaction it is copied
to ``Names.dead_letters_stream`` (reason, the last line of the error's traceback, source stream,
source entry id, generator and group id when known, the payload when small), acked and deleted
from its source, counted in the source's counters hash (field ``dead_letters``), and, when it
belongs to a prompt still in flight, that prompt's fate is ``dead_lettered`` (:mod:`buffer.audit`).
The learner's dead letters carry its fence: the transaction ``WATCH``es the run's token and runs only while it is
the learner's (:mod:`async_rl.run.lease`), so a learner fenced out of its run moves nothing.
"""

from __future__ import annotations

import time
import traceback
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from async_rl.run.lease import Fence, watched
from async_rl.run.names import Names
from buffer.audit import Audit
from buffer.streams import check_client, field_str


def error_line(exc: BaseException) -> str:
    """The last line of ``exc``'s traceback (``IndexError: index out of range in self``), as dead letters keep it."""
    return traceback.format_exception_only(exc)[-1].strip()


@dataclass(kw_only=True, slots=True)
class DeadLettersConfig:
    """Bounds of the dead-letter stream."""

    max_len: int = 10_000
    """Approximate number of dead letters kept (oldest trimmed first; the counters keep the totals)."""
    max_payload_bytes: int = 1 << 20
    """Payloads up to this size are kept with the dead letter for inspection; larger ones only by size."""

    def __post_init__(self) -> None:
        if self.max_len < 1:
            raise ValueError("buffer.dead_letters.max_len must be >= 1")
        if self.max_payload_bytes < 0:
            raise ValueError("buffer.dead_letters.max_payload_bytes must be >= 0")


@dataclass(slots=True)
class DeadLetter:
    """One dead letter as read back (for ``async-rl status`` and tests)."""

    entry_id: str
    """Id in the dead-letter stream."""
    reason: str
    """Why the entry was set aside (the decoder's message, naming the field)."""
    error: str
    """Last line of the traceback of the error that set it aside (``WireError: ...``, ``IndexError: ...``)."""
    source_stream: str
    """Stream the entry came from."""
    source_id: str
    """Its id there."""
    generator: str | None
    """Generator that wrote it, when known."""
    group_id: str | None
    """Group id, when known."""
    at: float
    """Unix time it was set aside."""
    payload: bytes | None
    """The original payload when it was small enough to keep."""
    payload_bytes: int
    """Size of the original payload."""


class DeadLetters:
    """Writes (and reads back) the dead-letter stream of one run."""

    redis: aioredis.Redis
    names: Names
    cfg: DeadLettersConfig
    audit: Audit
    fence: Fence | None
    """The learner's fence (None: a generator's dead letters, not fenced)."""

    def __init__(self, redis: aioredis.Redis, names: Names, cfg: DeadLettersConfig | None = None, *,
                 fence: Fence | None = None) -> None:  # fmt: skip
        self.redis = check_client(redis, "DeadLetters")
        self.names = names
        self.cfg = cfg or DeadLettersConfig()
        self.fence = fence
        self.audit = Audit(self.redis, names, fence=fence)

    async def quarantine(
        self,
        *,
        source_stream: str,
        group: str,
        source_id: str,
        fields: dict[bytes, bytes] | None,
        payload_field: bytes,
        reason: str,
        counters_key: str,
        payload: bytes | None = None,
        delete_keys: tuple[str, ...] = (),
        error: str = "",
        prompt_id: str | None = None,
    ) -> str:
        """Move one entry of ``source_stream`` (pending in ``group``) to the dead letters; returns its new id.

        ``payload`` overrides the entry's ``payload_field`` (a record stored under its own key);
        ``delete_keys`` are deleted in the same transaction (that key: callers pass only keys of the
        run they checked); ``error`` is the traceback's last line; ``prompt_id``, when it is still in
        flight, gets the fate ``dead_lettered`` with ``reason`` in the same transaction.
        """
        if payload is None:
            payload = (fields or {}).get(payload_field)
        size = len(payload) if payload is not None else 0
        letter: dict[Any, Any] = {
            "reason": reason,
            "error": error,
            "source_stream": source_stream,
            "source_id": source_id,
            "generator": field_str(fields, b"gen") or "",
            "group_id": field_str(fields, b"gid") or "",
            "at": repr(time.time()),
            "payload_bytes": size,
        }
        if payload is not None and size <= self.cfg.max_payload_bytes:
            letter["payload"] = payload
        async with self.redis.pipeline(transaction=True) as pipe, watched(self.fence):
            if self.fence is not None:
                await self.fence.watch(pipe)
            pipe.xadd(self.names.dead_letters_stream, letter, maxlen=self.cfg.max_len, approximate=True)
            pipe.xack(source_stream, group, source_id)
            pipe.xdel(source_stream, source_id)
            pipe.hincrby(counters_key, "dead_letters", 1)
            if delete_keys:
                pipe.delete(*delete_keys)
            if prompt_id:
                self.audit.finish_into(pipe, "dead_lettered", [(prompt_id, reason[:500])])
            res = await pipe.execute()
        return res[0].decode() if isinstance(res[0], bytes) else str(res[0])

    async def read(self, count: int = 100, newest_first: bool = True) -> list[DeadLetter]:
        """Up to ``count`` dead letters."""
        stream = self.names.dead_letters_stream
        rows: Any
        if newest_first:
            rows = await self.redis.xrevrange(stream, count=count)
        else:
            rows = await self.redis.xrange(stream, count=count)
        out = []
        for eid, f in rows:
            out.append(
                DeadLetter(
                    entry_id=eid.decode(),
                    reason=field_str(f, b"reason") or "",
                    error=field_str(f, b"error") or "",
                    source_stream=field_str(f, b"source_stream") or "",
                    source_id=field_str(f, b"source_id") or "",
                    generator=field_str(f, b"generator") or None,
                    group_id=field_str(f, b"group_id") or None,
                    at=float(f.get(b"at", b"0")),
                    payload=f.get(b"payload"),
                    payload_bytes=int(f.get(b"payload_bytes", b"0")),
                )
            )
        return out

    async def count(self) -> int:
        return int(await self.redis.xlen(self.names.dead_letters_stream))
