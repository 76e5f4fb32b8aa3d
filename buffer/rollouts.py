"""The rollout buffer: generators append encoded group records (:mod:`buffer.rollout_writer`); the learner reads
them through a group (here).

* **Back-pressure, never trimming.** Consumed entries are acked *and deleted*, so ``XLEN`` of the
  stream is the unconsumed backlog, the bound :class:`~buffer.rollout_writer.RolloutWriter` waits on; every ack
  wakes waiting writers through ``Names.rollout_acks_stream``.
* **Ack after commit.** The learner calls :meth:`RolloutReader.ack` only once the optimizer step
  that used the entries is committed; until then they stay pending on its consumer. A restarted
  learner with the same consumer name gets its own pending entries first; entries idle on another
  consumer longer than ``reclaim_idle_ms`` are reclaimed (``XAUTOCLAIM``).
* **Nothing vanishes.** A malformed entry goes to the dead letters (reason, source, generator) and
  reading continues; a duplicate group id (``seen``) and a stale group (:meth:`ack_dropped`) are
  acked and counted in ``Names.rollout_counters`` (``duplicates``, ``dropped_stale``).
* **Nothing on the stream stops the learner.** Before a record is handed out: its size is checked
  against ``max_entry_bytes`` (a payload key's ``STRLEN`` before its ``GET``), it is decoded with
  bounded allocations, checked against the model and the run (:mod:`buffer.entry_checks`; its
  prompt must be in flight, :mod:`buffer.audit`), and an entry delivered more than ``max_deliveries``
  times (``XPENDING``'s own count: the learner died or failed on it that often) is dead-lettered with
  the last error recorded for it (:meth:`RolloutReader.record_error`). A payload key is followed,
  and deleted, only when it is this run's (``Names.is_rollout_payload``).
* **Fates move with acks.** :meth:`RolloutReader.ack` and :meth:`RolloutReader.ack_dropped` record
  the prompts' fates (``trained``, ``dropped_stale``) in the transaction that acks their entries.
* **Fenced.** The learner's reader carries its :class:`~async_rl.run.lease.Fence`: the ack script and the fates
  script of that transaction, and its dead letters, are refused by Redis unless its token is the run's current one,
  so a learner another one took the run from commits nothing.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Container, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from async_rl.run.lease import Fence, fenced
from async_rl.run.names import Names
from async_rl.wire import WireError, decode_group
from async_rl.wire.types import GroupRecord
from buffer.audit import Audit
from buffer.dead_letters import DeadLetters, DeadLettersConfig, error_line
from buffer.entry_checks import EntryChecker, EntryError
from buffer.rollout_writer import ACKS_MAXLEN, GROUP_ID_FIELD, PAYLOAD_KEY_FIELD, RECORD_FIELD
from buffer.streams import (
    RawEntry,
    Reclaimer,
    check_client,
    delivery_counts,
    ensure_group,
    field_str,
    read_group,
    sid,
)

log = logging.getLogger(__name__)

# KEYS: stream, rollout counters, acks stream, errors hash, payload keys...; ARGV: group, counter, acks maxlen, ids...
# Counts only entries this call acked, so finishing the same entries twice (a re-commit after a restart) counts once.
_ACK_LUA = """
local acked = 0
for i = 4, #ARGV do
  acked = acked + redis.call('XACK', KEYS[1], ARGV[1], ARGV[i])
  redis.call('XDEL', KEYS[1], ARGV[i])
  redis.call('HDEL', KEYS[4], ARGV[i])
end
for i = 5, #KEYS do redis.call('DEL', KEYS[i]) end
if acked > 0 then redis.call('HINCRBY', KEYS[2], ARGV[2], acked) end
redis.call('XADD', KEYS[3], 'MAXLEN', '~', ARGV[3], '*', 'n', #ARGV - 3)
return acked
"""


@dataclass(kw_only=True, slots=True)
class RolloutReaderConfig:
    """Learner side of the rollout stream."""

    reclaim_idle_ms: int = 600_000
    """Entries pending this long on another consumer (a learner that died) are taken over. Must
    exceed the longest time between reading an entry and committing the step that uses it."""
    max_entry_bytes: int = 256 << 20
    """Records larger than this are dead-lettered unread (a real group of 8 x 2,048 tokens with 48 x 8 routes is
    7.3 MB; raise it for longer sequences)."""
    max_deliveries: int = 3
    """An entry delivered more often than this without a committed step goes to the dead letters with its last
    error: a record the learner keeps dying or failing on cannot stop training."""
    dead_letters: DeadLettersConfig = field(default_factory=DeadLettersConfig)
    """Where malformed records go."""

    def __post_init__(self) -> None:
        if self.reclaim_idle_ms < 1:
            raise ValueError("buffer.rollouts.reclaim_idle_ms must be >= 1")
        if self.max_entry_bytes < 1:
            raise ValueError("buffer.rollouts.max_entry_bytes must be >= 1")
        if self.max_deliveries < 1:
            raise ValueError("buffer.rollouts.max_deliveries must be >= 1")


@dataclass(slots=True)
class RolloutEntry:
    """One group record as the learner reads it."""

    entry_id: str
    """Stream entry id (what :meth:`RolloutReader.ack` takes)."""
    record: GroupRecord
    """The decoded record (arrays are read-only views into the entry's bytes)."""
    payload_bytes: int = 0
    """Encoded size of the entry."""



class RolloutReader:
    """Reads, checks, acks and drops group records of the rollout stream of one run (the learner's side)."""

    redis: aioredis.Redis
    names: Names
    cfg: RolloutReaderConfig
    checker: EntryChecker | None
    check_issued: bool
    fence: Fence | None
    dead_letters: DeadLetters
    audit: Audit
    _reclaimer: Reclaimer
    _in_flight: dict[str, str]
    _payload_keys: dict[str, str]
    _sources: dict[str, tuple[dict[bytes, bytes], bytes]]
    _own_pending_done: set[str]
    _group_ready: bool

    def __init__(
        self,
        redis: aioredis.Redis,
        names: Names,
        cfg: RolloutReaderConfig | None = None,
        *,
        checker: EntryChecker | None = None,
        check_issued: bool = False,
        fence: Fence | None = None,
    ) -> None:
        """``checker``: model and run facts every record must pass; ``check_issued``: refuse records whose prompt
        id is not in flight in the audit (the learner's setting; benchmarks and tests may write records freely);
        ``fence``: the learner's (acks, fates and dead letters refused unless its token is the run's current one)."""
        self.redis = check_client(redis, "RolloutReader")
        self.names = names
        self.cfg = cfg or RolloutReaderConfig()
        self.checker = checker
        self.check_issued = check_issued
        self.fence = fence
        self.dead_letters = DeadLetters(self.redis, names, self.cfg.dead_letters, fence=fence)
        self.audit = self.dead_letters.audit
        self._reclaimer = Reclaimer(names.rollouts_stream, names.rollouts_group)
        self._in_flight = {}  # entry id -> consumer holding it
        self._payload_keys = {}  # entry id -> key of its record, for records stored beside the stream
        self._sources = {}  # entry id -> (stream fields, record bytes) of entries handed out, for dead letters
        self._own_pending_done = set()
        self._group_ready = False

    @property
    def in_flight(self) -> frozenset[str]:
        """Entry ids returned by :meth:`read` and not yet acked or dropped."""
        return frozenset(self._in_flight)

    async def _ensure_group(self) -> None:
        if not self._group_ready:
            await ensure_group(self.redis, self.names.rollouts_stream, self.names.rollouts_group)
            self._group_ready = True

    async def read(
        self, consumer: str, count: int, block_ms: int = 0, seen: Container[str] | None = None
    ) -> list[RolloutEntry]:
        """Up to ``count`` records: this consumer's own pending ones left by a previous run (or given back by
        :meth:`retry`) first, then entries abandoned by dead consumers, then new ones (blocking up to
        ``block_ms``; 0: no wait).

        Records whose group id is in ``seen`` are acked and counted as ``duplicates``; entries that fail
        a check or were delivered more than ``max_deliveries`` times go to the dead letters. Either way
        they are not returned and reading goes on.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if not consumer:
            raise ValueError("consumer name must not be empty")
        await self._ensure_group()
        stream, group = self.names.rollouts_stream, self.names.rollouts_group
        out: list[RolloutEntry] = []
        if consumer not in self._own_pending_done:
            # After a restart: entries delivered to this consumer name before and never acked.
            raw = await read_group(self.redis, stream, group, consumer, "0", count + len(self._in_flight), 0)
            raw = [(e, f) for e, f in raw if self._in_flight.get(e) != consumer]
            if not raw:
                self._own_pending_done.add(consumer)
            out += await self._accept(raw, consumer, seen, redelivered=True)
        if len(out) < count:
            raw = await self._reclaimer.claim(self.redis, consumer, self.cfg.reclaim_idle_ms, count - len(out))
            # Our own entries held across a long step look idle too: they are not abandoned.
            raw = [(e, f) for e, f in raw if self._in_flight.get(e) != consumer]
            if raw:
                log.info("rollout reader: %s reclaimed %d abandoned entries", consumer, len(raw))
            out += await self._accept(raw, consumer, seen, redelivered=True)
        if len(out) < count:
            raw = await read_group(self.redis, stream, group, consumer, ">", count - len(out), 0)
            out += await self._accept(raw, consumer, seen, redelivered=False)
        if not out:  # nothing new: look for abandoned entries now, then wait for new ones
            raw = await self._reclaimer.claim(self.redis, consumer, self.cfg.reclaim_idle_ms, count, force=True)
            raw = [(e, f) for e, f in raw if self._in_flight.get(e) != consumer]
            out += await self._accept(raw, consumer, seen, redelivered=True)
        if not out and block_ms > 0:
            raw = await read_group(self.redis, stream, group, consumer, ">", count, block_ms)
            out += await self._accept(raw, consumer, seen, redelivered=False)
        return out

    async def _accept(
        self, raw: list[RawEntry], consumer: str, seen: Container[str] | None, redelivered: bool
    ) -> list[RolloutEntry]:
        gone = [eid for eid, fields in raw if fields is None]  # deleted while pending (Redis 6.2 reports these)
        live: list[tuple[str, dict[bytes, bytes]]] = [(eid, fields) for eid, fields in raw if fields is not None]
        if redelivered and live:
            live = await self._enforce_delivery_limit(live, consumer)
        checked: list[tuple[str, dict[bytes, bytes], bytes, GroupRecord]] = []
        duplicates: list[str] = []
        for eid, fields in live:
            data: bytes | None = None
            try:
                data = await self._payload(eid, fields)
                rec = decode_group(data)
                if self.checker is not None:
                    self.checker.check(rec)
            except (WireError, EntryError) as exc:
                await self._dead_letter(eid, fields, data, str(exc), error_line(exc))
                continue
            if seen is not None and rec.group_id in seen:
                duplicates.append(eid)
                continue
            checked.append((eid, fields, data, rec))
        if self.check_issued and checked:
            open_ids = await self.audit.open_among(sorted({rec.prompt_id for _, _, _, rec in checked}))
            for eid, fields, data, rec in [c for c in checked if c[3].prompt_id not in open_ids]:
                reason = f"prompt_id {rec.prompt_id!r} is not in flight (never issued by this run, or already finished)"
                await self._dead_letter(eid, fields, data, reason, f"EntryError: {reason}")
            checked = [c for c in checked if c[3].prompt_id in open_ids]
        out = []
        for eid, fields, data, rec in checked:
            self._in_flight[eid] = consumer
            self._sources[eid] = (fields, data)
            out.append(RolloutEntry(eid, rec, len(data)))
        if duplicates:
            await self._finish(duplicates, "duplicates")
        if gone:
            await self._finish(gone, "deleted_pending")
        return out

    async def _enforce_delivery_limit(
        self, live: list[tuple[str, dict[bytes, bytes]]], consumer: str
    ) -> list[tuple[str, dict[bytes, bytes]]]:
        """Dead-letter entries delivered more than ``max_deliveries`` times, with the last error recorded for them."""
        stream, group = self.names.rollouts_stream, self.names.rollouts_group
        counts = await delivery_counts(self.redis, stream, group, consumer, [e for e, _ in live])
        limit = self.cfg.max_deliveries
        over = [(e, f) for e, f in live if counts.get(e, 0) > limit]
        if not over:
            return live
        errors: Any = await self.redis.hmget(self.names.rollout_errors, [e for e, _ in over])
        for (eid, fields), err in zip(over, errors, strict=True):
            last = err.decode(errors="replace") if err else ""
            reason = f"delivered {counts[eid]} times without a committed step (max_deliveries {limit}); " + (
                f"last error: {last}" if last else "the learner died while holding it, no error recorded")
            data = fields.get(RECORD_FIELD)
            key = field_str(fields, PAYLOAD_KEY_FIELD)
            if key is not None and self.names.is_rollout_payload(key):
                self._payload_keys[eid] = key
            await self._dead_letter(eid, fields, data, reason, last)
        return [(e, f) for e, f in live if counts.get(e, 0) <= limit]

    async def _payload(self, eid: str, fields: dict[bytes, bytes]) -> bytes:
        """The record bytes of an entry, inline or under its payload key, within ``max_entry_bytes``.

        A payload key is followed only when it is this run's (:meth:`Names.is_rollout_payload`); it is
        remembered for deletion only then. Its size is read before its value.
        """
        limit = self.cfg.max_entry_bytes
        data = fields.get(RECORD_FIELD)
        if data is not None:
            if len(data) > limit:
                raise WireError(f"record of {len(data)} bytes exceeds buffer.rollouts.max_entry_bytes ({limit})")
            return data
        key = field_str(fields, PAYLOAD_KEY_FIELD)
        if key is None:
            raise WireError("rollout entry has no 'rec' field")
        if not self.names.is_rollout_payload(key):
            pattern = self.names.key("rollouts", "payload", "<32 hex digits>")
            raise WireError(f"record key {key[:200]!r} is not a payload key of this run ({pattern}): refused, "
                            "not read")  # fmt: skip
        self._payload_keys[eid] = key
        try:
            size = int(await self.redis.strlen(key))
            if size > limit:
                raise WireError(f"record of {size} bytes under {key} exceeds buffer.rollouts.max_entry_bytes ({limit})")
            value: Any = await self.redis.get(key)
        except ResponseError as exc:  # WRONGTYPE: a producer put something other than a string there
            raise WireError(f"record key {key}: {exc}") from exc
        if value is None:
            raise WireError(f"rollout entry's record key {key} is gone")
        if len(value) > limit:  # replaced between STRLEN and GET
            raise WireError(f"record of {len(value)} bytes under {key} exceeds buffer.rollouts.max_entry_bytes ({limit})")
        return value

    async def _dead_letter(
        self, eid: str, fields: dict[bytes, bytes], data: bytes | None, reason: str, error: str,
        prompt_id: str | None = None,
    ) -> None:  # fmt: skip
        log.warning("rollout reader: entry %s moved to dead letters: %s", eid, reason)
        key = self._payload_keys.pop(eid, None)
        await self.dead_letters.quarantine(
            source_stream=self.names.rollouts_stream,
            group=self.names.rollouts_group,
            source_id=eid,
            fields=fields,
            payload_field=RECORD_FIELD,
            reason=reason,
            counters_key=self.names.rollout_counters,
            payload=data,
            delete_keys=(key,) if key is not None else (),
            error=error,
            prompt_id=prompt_id or field_str(fields, GROUP_ID_FIELD),
        )
        await self.redis.hdel(self.names.rollout_errors, eid)
        self._in_flight.pop(eid, None)
        self._sources.pop(eid, None)

    # ---- the learner's verdicts on entries it holds ------------------------------------
    async def quarantine(self, entries: Sequence[RolloutEntry], reason: str, error: str = "") -> None:
        """Move entries this reader handed out to the dead letters (e.g. a record the backend failed on)."""
        for e in entries:
            fields, data = self._sources.get(e.entry_id, ({}, None))
            await self._dead_letter(e.entry_id, fields, data, reason, error, prompt_id=e.record.prompt_id)

    async def record_error(self, entries: Iterable[str | RolloutEntry], error: str) -> None:
        """Remember ``error`` (a traceback's last line) for these entries: it goes with them if they reach the
        delivery limit (a learner that keeps failing or dying on them)."""
        ids = _ids(entries)
        if ids:
            await self.redis.hset(self.names.rollout_errors, mapping={i: error[:1000] for i in ids})

    async def retry(self, entries: Sequence[RolloutEntry], error: str) -> None:
        """Give entries back unfinished after ``error``: the next :meth:`read` delivers them again (counted
        against ``max_deliveries``), before anything new."""
        await self.record_error(entries, error)
        for e in entries:
            consumer = self._in_flight.pop(e.entry_id, None)
            self._sources.pop(e.entry_id, None)
            if consumer is not None:
                self._own_pending_done.discard(consumer)

    async def ack(
        self, entry_ids: Iterable[str | RolloutEntry], *, fates: Iterable[tuple[str, str]] | None = None
    ) -> int:
        """The step using these entries is committed: ack, delete and count them as ``consumed``; their prompts'
        fate is ``trained`` (``fates``: ``(prompt id, detail)``; default: the records' prompt ids)."""
        entries = list(entry_ids)
        return await self._finish(_ids(entries), "consumed", "trained", _fates(entries, fates))

    async def ack_dropped(
        self, entry_ids: Iterable[str | RolloutEntry], counter: str = "dropped_stale",
        *, fates: Iterable[tuple[str, str]] | None = None,
    ) -> int:  # fmt: skip
        """Entries the learner will not train on: ack, delete, count in ``counter``. Stale drops (the default
        counter) give their prompts the fate ``dropped_stale``; duplicates change no fate."""
        entries = list(entry_ids)
        if counter == "dropped_stale":
            return await self._finish(_ids(entries), counter, "dropped_stale", _fates(entries, fates))
        return await self._finish(_ids(entries), counter)

    async def count(self, counter: str, n: int) -> None:
        """Add ``n`` to a field of ``Names.rollout_counters`` (e.g. ``kept_stale`` in keep mode)."""
        if n:
            await self.redis.hincrby(self.names.rollout_counters, counter, n)

    async def _finish(
        self, ids: Sequence[str], counter: str, fate: str | None = None, fates: Sequence[tuple[str, str]] = ()
    ) -> int:
        if not ids:
            return 0
        stream = self.names.rollouts_stream
        keys = [self._payload_keys[i] for i in ids if i in self._payload_keys]
        unknown = [i for i in ids if i not in self._payload_keys]
        if unknown:  # read by another reader instance (a restart): find their record keys, if any
            async with self.redis.pipeline(transaction=False) as pipe:
                for i in unknown:
                    pipe.xrange(stream, i, i, count=1)
                found: Any = await pipe.execute()
            refs = [sid(rows[0][1][PAYLOAD_KEY_FIELD]) for rows in found if rows and PAYLOAD_KEY_FIELD in rows[0][1]]
            keys += [k for k in refs if self.names.is_rollout_payload(k)]
        n = self.names
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.eval(*fenced(self.fence, _ACK_LUA, [stream, n.rollout_counters, n.rollout_acks_stream,
                                                     n.rollout_errors, *keys],
                              [n.rollouts_group, counter, ACKS_MAXLEN, *ids]))  # fmt: skip
            if fate is not None:
                self.audit.finish_into(pipe, fate, fates)
            # The commit of a step's acks must not be cut in half by a cancellation.
            acked = (await asyncio.shield(pipe.execute()))[0]
        for i in ids:
            self._in_flight.pop(i, None)
            self._payload_keys.pop(i, None)
            self._sources.pop(i, None)
        return int(acked)


def _ids(entries: Iterable[str | RolloutEntry]) -> list[str]:
    return [e if isinstance(e, str) else e.entry_id for e in entries]


def _fates(entries: Sequence[str | RolloutEntry], fates: Iterable[tuple[str, str]] | None) -> list[tuple[str, str]]:
    if fates is not None:
        return list(fates)
    return [(e.record.prompt_id, "") for e in entries if isinstance(e, RolloutEntry)]
