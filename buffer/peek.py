"""Looking at the rollout stream without touching it: its newest groups, and new ones as they come (``async-rl samples``).

* **Read-only.** ``XREVRANGE`` for the newest entries, a blocking ``XREAD`` outside any consumer group for the next
  ones, ``STRLEN`` then ``GET`` of a large record's payload key, followed only when it is one of this run's
  (:meth:`~async_rl.run.names.Names.is_rollout_payload`): nothing is acked, claimed, deleted or counted, and the
  learner's group sees nothing of it.
* **What is there.** The stream holds the groups not yet trained: the learner deletes the entries it commits
  (:mod:`buffer.rollouts`), so a group may go between the read of its entry and that of its payload. Such an entry,
  and one that does not decode, comes back with the reason instead of its group; nothing here raises over an entry.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from async_rl.run.names import Names
from async_rl.wire import WireError, decode_group
from async_rl.wire.types import GroupRecord
from buffer.rollout_writer import PAYLOAD_KEY_FIELD, RECORD_FIELD
from buffer.rollouts import RolloutReaderConfig
from buffer.streams import check_client, field_str, sid

MAX_RECORD_BYTES = RolloutReaderConfig().max_entry_bytes
"""A record larger than the learner's default bound is not read here either."""


@dataclass(slots=True)
class Peeked:
    """One entry of the rollout stream as seen."""

    entry_id: str
    group: GroupRecord | None
    """The decoded group (None: see ``error``)."""
    error: str = ""
    """Why there is no group: gone (trained meanwhile), too large, not decodable."""


class StreamPeek:
    """Read-only views of one run's rollout stream (see the module docstring)."""

    redis: aioredis.Redis
    names: Names

    def __init__(self, redis: aioredis.Redis, names: Names) -> None:
        self.redis = check_client(redis, "StreamPeek")
        self.names = names

    async def exists(self) -> bool:
        """Whether the run has a rollout stream (a generator wrote to it once; it stays when emptied)."""
        return bool(await self.redis.exists(self.names.rollouts_stream))

    async def newest(self, count: int) -> list[Peeked]:
        """The newest ``count`` entries, oldest first."""
        rows: Any = await self.redis.xrevrange(self.names.rollouts_stream, count=count)
        return [await self._peek(sid(eid), fields) for eid, fields in reversed(rows)]

    async def last_id(self) -> str:
        """The id of the newest entry ever added (``0-0`` before the first): where to follow from."""
        try:
            info: Any = await self.redis.xinfo_stream(self.names.rollouts_stream)
        except ResponseError:  # no stream yet
            return "0-0"
        return sid(info["last-generated-id"])

    async def after(self, entry_id: str, block_ms: int, count: int = 64) -> list[Peeked]:
        """Entries added after ``entry_id``, waiting up to ``block_ms`` for the first (none: an empty list)."""
        resp: Any = await self.redis.xread({self.names.rollouts_stream: entry_id}, count=count, block=block_ms)
        return [await self._peek(sid(eid), fields) for _, rows in resp or [] for eid, fields in rows]

    async def _peek(self, entry_id: str, fields: dict[bytes, bytes]) -> Peeked:
        data = fields.get(RECORD_FIELD)
        if data is None:
            key = field_str(fields, PAYLOAD_KEY_FIELD)
            if key is None or not self.names.is_rollout_payload(key):
                return Peeked(entry_id, None, f"no record, and no payload key of this run ({key!r:.80})")
            try:
                size = int(await self.redis.strlen(key))
                if size > MAX_RECORD_BYTES:
                    return Peeked(entry_id, None, f"record of {size} bytes under {key}: over {MAX_RECORD_BYTES}")
                value: Any = await self.redis.get(key)
            except ResponseError as exc:  # WRONGTYPE: something other than a record under the key
                return Peeked(entry_id, None, f"record key {key}: {exc}")
            if value is None:
                return Peeked(entry_id, None, "trained and deleted while it was read")
            data = value
        try:
            return Peeked(entry_id, decode_group(data))
        except WireError as exc:
            return Peeked(entry_id, None, f"does not decode: {exc}")
