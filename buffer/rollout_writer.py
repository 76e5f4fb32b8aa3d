"""The writing side of the rollout stream: generators append encoded group records, with back-pressure.

:meth:`RolloutWriter.append` waits while the stream's unconsumed backlog is at ``max_backlog`` or above (one warning
line when it starts waiting, one when it resumes), woken by the reader's acks through ``Names.rollout_acks_stream``
(a blocking ``XREAD``, no polling), and raises :class:`BackpressureTimeout` after ``backpressure_timeout_s``. The
learner acks what it trained only when a checkpoint covers it, so up to ``checkpoint.every x batch_groups`` groups
stay in the stream read; the learner publishes that number (:data:`LEARNER_HOLD_FIELD`) and the stream may hold it
on top of ``max_backlog`` (a bound below it would make the generator wait for acks the learner can only give after
groups it may not append). Each append reads the stream's length back in its own transaction; while that stays below
the bound minus one the next append skips the check (a round trip saved per group), so W writers at once can
overshoot the bound by W - 1. :meth:`RolloutWriter.append_many` appends several records in one transaction (one round
trip, the bound checked once: k records overshoot it by k - 1 at most). A record larger than
``inline_max_bytes`` travels under its own key, the entry pointing to it. The entry's fields are named here; the
reading side is :mod:`buffer.rollouts`.
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import NoPermissionError

from async_rl.run.names import Names
from async_rl.wire import encode_group_into
from async_rl.wire.types import GroupRecord
from buffer.streams import check_client, sid

log = logging.getLogger(__name__)

RECORD_FIELD = b"rec"
"""Stream entry field: the encoded record (inline)."""
PAYLOAD_KEY_FIELD = b"ref"
"""Stream entry field: the key holding the encoded record (a large one)."""
GENERATOR_FIELD = b"gen"
GROUP_ID_FIELD = b"gid"
ACKS_MAXLEN = 1000
"""Acks are wake-up signals only; a short tail is enough for every waiting writer to see a new one."""
# Encode buffers a writer keeps warm: one per append in flight at once is plenty.
_MAX_BUFFERS = 2
# A waiting writer re-checks the backlog at least this often (and logs progress), acks or not.
_WAIT_SLICE_S = 5.0


class BackpressureTimeout(TimeoutError):
    """The rollout backlog stayed above ``max_backlog`` for ``backpressure_timeout_s``."""


LEARNER_HOLD_FIELD = "unacked_groups_max"
"""Field of ``Names.learner_state``: the most groups the learner keeps read but unacked (``checkpoint.every``
x ``batch_groups``: entries are acked when the checkpoint covering them is written, and count in the backlog)."""


@dataclass(kw_only=True, slots=True)
class RolloutWriterConfig:
    """Generator side of the rollout stream."""

    max_backlog: int = 512
    """Append waits while this many groups are in the stream unconsumed, on top of those the learner holds read
    between checkpoints (the learner's admission control normally keeps far fewer in flight; this is the safety
    net)."""
    backpressure_timeout_s: float = 600.0
    """How long append waits for the backlog to drop before raising BackpressureTimeout."""
    inline_max_bytes: int = 256 * 1024
    """Records up to this size travel inside the stream entry; larger ones under their own key (SET), the
    entry pointing to it: XADD copies a value into the stream (6.7 ms of server time for 7 MB here,
    against 20 us for SET, which keeps the received buffer)."""

    def __post_init__(self) -> None:
        if self.max_backlog < 1:
            raise ValueError("buffer.rollouts.max_backlog must be >= 1")
        if self.backpressure_timeout_s <= 0:
            raise ValueError("buffer.rollouts.backpressure_timeout_s must be > 0")
        if self.inline_max_bytes < 0:
            raise ValueError("buffer.rollouts.inline_max_bytes must be >= 0")


class RolloutWriter:
    """Appends group records to the rollout stream of one run, with back-pressure."""

    redis: aioredis.Redis
    names: Names
    cfg: RolloutWriterConfig

    _buffers: list[bytearray]
    _backlog: int | None
    _bound: int
    _warned_acl: bool

    def __init__(self, redis: aioredis.Redis, names: Names, cfg: RolloutWriterConfig | None = None) -> None:
        self.redis = check_client(redis, "RolloutWriter")
        self.names = names
        self.cfg = cfg or RolloutWriterConfig()
        self._buffers = []  # warm encode buffers, reused between appends (see wire.encode_group_into)
        self._backlog = None  # stream length seen by this writer's last append (None: not known yet)
        self._bound = self.cfg.max_backlog  # the stream length appends wait at (max_backlog + the learner's hold)
        self._warned_acl = False

    async def backlog(self) -> int:
        """Groups in the stream: not yet read, or read and not yet acked (the learner's hold)."""
        return int(await self.redis.xlen(self.names.rollouts_stream))

    async def bound(self) -> int:
        """The stream length appends wait at: ``max_backlog`` on top of what the learner holds (module docstring)."""
        try:
            held = await self.redis.hget(self.names.learner_state, LEARNER_HOLD_FIELD)
        except NoPermissionError:  # an ACL file from before this read: the bound stays max_backlog alone
            if not self._warned_acl:
                log.warning("this generator's Redis user may not read %s: the rollout backlog bound ignores the "
                            "groups the learner holds until its checkpoint (write the ACL file again with "
                            "`async-rl acl`)", self.names.learner_state)  # fmt: skip
                self._warned_acl = True
            held = None
        self._bound = self.cfg.max_backlog + (int(held) if held is not None else 0)
        return self._bound

    async def append(self, rec: GroupRecord) -> str:
        """Encode (validating: raises WireError), wait for room, append; returns the entry id."""
        return (await self.append_many([rec]))[0]

    async def append_many(self, recs: Sequence[GroupRecord]) -> list[str]:
        """Several records in one transaction, one round trip (a batch's groups that end in the same step): all
        encoded first (a WireError appends none), room waited for once; returns their entry ids in order."""
        bufs: list[bytearray] = []
        try:
            items = []
            for rec in recs:
                buf = self._buffers.pop() if self._buffers else bytearray()
                try:
                    view = encode_group_into(rec, buf)
                except BufferError:  # a transport still holds a view of it: take a fresh one
                    buf = bytearray()
                    view = encode_group_into(rec, buf)
                bufs.append(buf)
                items.append((view, rec.generator_id, rec.group_id))
            return await self._append_encoded(items)
        finally:
            self._buffers.extend(bufs[: max(0, _MAX_BUFFERS - len(self._buffers))])

    async def append_encoded(self, data: bytes | memoryview, *, generator_id: str, group_id: str) -> str:
        """Append an already encoded record (benchmarks, relays)."""
        return (await self._append_encoded([(data, generator_id, group_id)]))[0]

    async def _append_encoded(self, items: Sequence[tuple[bytes | memoryview, str, str]]) -> list[str]:
        """``(record, generator id, group id)`` each, in one transaction; the bound is checked as for one append
        (module docstring), so k records at once can overshoot it by k - 1, like k writers."""
        if not items:
            return []
        if self._backlog is None or self._backlog + len(items) >= self._bound:
            await self.wait_for_room()
        async with self.redis.pipeline(transaction=True) as pipe:
            entries: list[dict[Any, Any]] = []
            for data, generator_id, group_id in items:  # large records' keys first (one transaction: order is moot)
                fields: dict[Any, Any] = {GENERATOR_FIELD: generator_id, GROUP_ID_FIELD: group_id}
                if len(data) <= self.cfg.inline_max_bytes:
                    fields[RECORD_FIELD] = data
                else:
                    key = self.names.rollout_payload(uuid.uuid4().hex)
                    pipe.set(key, data)
                    fields[PAYLOAD_KEY_FIELD] = key
                entries.append(fields)
            for fields in entries:
                pipe.xadd(self.names.rollouts_stream, fields)
            pipe.hincrby(self.names.rollout_counters, "appended", len(items))
            pipe.xlen(self.names.rollouts_stream)
            res = await pipe.execute()
        self._backlog = int(res[-1])
        return [sid(r) for r in res[-2 - len(items) : -2]]  # the XADDs' replies, before HINCRBY's and XLEN's

    async def wait_for_room(self) -> None:
        """Return once the stream is below :meth:`bound`; raise BackpressureTimeout after the timeout."""
        if await self.backlog() < await self.bound():
            return
        acks = self.names.rollout_acks_stream
        # Take the acks cursor *before* looking at the backlog again: an ack landing in between still wakes us.
        last: Any = await self.redis.xrevrange(acks, count=1)
        cursor = sid(last[0][0]) if last else "0-0"
        backlog = await self.backlog()
        if backlog < self._bound:  # the learner's hold was read just above
            return
        started = time.monotonic()
        deadline = started + self.cfg.backpressure_timeout_s
        log.warning(
            "rollout backlog %d >= max_backlog %d + %d groups the learner holds until its next checkpoint: waiting "
            "up to %.0f s for the learner to consume",
            backlog,
            self.cfg.max_backlog,
            self._bound - self.cfg.max_backlog,
            self.cfg.backpressure_timeout_s,
        )
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise BackpressureTimeout(
                    f"rollout backlog stayed >= max_backlog {self.cfg.max_backlog} for "
                    f"{self.cfg.backpressure_timeout_s:.0f} s (is the learner running?)"
                )
            block_ms = max(1, int(min(remaining, _WAIT_SLICE_S) * 1000))
            resp: Any = await self.redis.xread({acks: cursor}, count=ACKS_MAXLEN, block=block_ms)
            if resp:
                cursor = sid(resp[0][1][-1][0])
            backlog = await self.backlog()
            if backlog < await self.bound():
                log.warning("rollout backlog %d: resuming after %.1f s", backlog, time.monotonic() - started)
                return
