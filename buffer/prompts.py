"""The prompt queue: the learner issues prompts by admission control; generators read them through a group.

Admission control bounds staleness at the source: at learner version ``v`` at most ``(S+1)·B``
prompt groups are issued and not yet finished (S = max staleness, B = groups per step). What is in
flight is the audit's open set (:mod:`buffer.audit`): a prompt leaves it in the same transaction
that makes its fate true (the commit of the step that trained it, a stale drop, a dead letter), so
the count is exact across any number of restarts. The learner passes the groups it has read and
not yet finished as ``held``: they are out of the streams and no longer need admission room.

Delivery is at-least-once. A generator acks a prompt after its group record is appended to the
rollout stream. A generator that dies leaves its prompts pending; :meth:`PromptQueue.read`
reclaims entries idle longer than ``reclaim_idle_ms`` (``XAUTOCLAIM``) before it reads new ones.
A generator that stops cleanly calls :meth:`PromptQueue.release`: its entries are re-owned by the
pseudo-consumer :data:`RELEASED_CONSUMER` with an idle time of a year, so the next read of any
generator reclaims them at once (same ids, delivery counts unchanged). A generator that holds a
prompt longer than ``reclaim_idle_ms`` while alive calls :meth:`PromptQueue.touch` to keep it.
An entry delivered more than ``max_deliveries`` times (a prompt that kills its generators) goes
to the dead letters.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import redis.asyncio as aioredis

from async_rl.run.lease import Fence
from async_rl.run.names import Names
from async_rl.wire import PromptSpec, WireError, decode_prompt, encode_prompt
from buffer.audit import Audit
from buffer.dead_letters import DeadLetters, DeadLettersConfig, error_line
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

RELEASED_CONSUMER = "released"
"""Pseudo-consumer owning released prompts until a generator reclaims them."""
# A year: any reclaim_idle_ms a user sets is shorter, so released entries are reclaimable at once.
RELEASED_IDLE_MS = 365 * 24 * 3600 * 1000

_SPEC = b"spec"
_VERSION = b"ver"
_ISSUED_AT = b"at"
_PROMPT_ID = b"pid"


@dataclass(kw_only=True, slots=True)
class PromptQueueConfig:
    """Prompt queue settings (shared by the learner, which issues, and generators, which read)."""

    reclaim_idle_ms: int = 300_000
    """A prompt pending this long on a generator is presumed abandoned and given to another one."""
    max_deliveries: int = 5
    """A prompt delivered more often than this is moved to the dead letters instead of retried."""
    dead_letters: DeadLettersConfig = field(default_factory=DeadLettersConfig)
    """Where malformed or poison prompts go."""

    def __post_init__(self) -> None:
        if self.reclaim_idle_ms < 1:
            raise ValueError("buffer.prompts.reclaim_idle_ms must be >= 1")
        if self.max_deliveries < 1:
            raise ValueError("buffer.prompts.max_deliveries must be >= 1")


@dataclass(slots=True)
class PromptEntry:
    """One prompt as a generator reads it."""

    entry_id: str
    """Stream entry id (what :meth:`PromptQueue.ack` takes)."""
    spec: PromptSpec
    """The prompt."""
    issued_version: int
    """Learner version when the prompt was issued."""
    issued_at: float
    """Unix time when the prompt was issued."""
    reclaimed: bool = False
    """Whether this delivery is a retry of an entry another consumer left pending."""


class PromptQueue:
    """Both sides of the prompt stream of one run."""

    redis: aioredis.Redis
    names: Names
    cfg: PromptQueueConfig
    dead_letters: DeadLetters
    audit: Audit
    _reclaimer: Reclaimer
    _group_ready: bool
    _in_flight: dict[str, str]

    def __init__(self, redis: aioredis.Redis, names: Names, cfg: PromptQueueConfig | None = None,
                 audit: Audit | None = None, *, fence: Fence | None = None) -> None:  # fmt: skip
        """``audit``: the audit of this queue's prompts (default: the run's training audit; :mod:`buffer.evals`
        passes the evaluation queue's). ``fence``: the learner's; its issues are refused by Redis unless its token is
        the run's current one (:mod:`async_rl.run.lease`)."""
        self.redis = check_client(redis, "PromptQueue")
        self.names = names
        self.cfg = cfg or PromptQueueConfig()
        self.dead_letters = DeadLetters(self.redis, names, self.cfg.dead_letters, fence=fence)
        self.audit = audit or Audit(self.redis, names, fence=fence)
        self._reclaimer = Reclaimer(names.prompts_stream, names.prompts_group)
        self._group_ready = False
        self._in_flight = {}  # entry id -> consumer holding it

    async def _ensure_group(self) -> None:
        if not self._group_ready:
            await ensure_group(self.redis, self.names.prompts_stream, self.names.prompts_group)
            self._group_ready = True

    # ---- learner side ------------------------------------------------------------------
    async def in_flight(self) -> int:
        """Prompts issued and not yet finished (trained, dropped stale or dead-lettered): the audit's open set."""
        return await self.audit.in_flight()

    async def capacity(self, max_staleness: int, batch_groups: int, held: int = 0) -> int:
        """How many more prompts may be issued now: ``(S+1)·B`` minus those in flight and not ``held`` (never < 0).

        ``held``: groups the caller has read off the rollout stream and not yet finished (a batch being
        trained, steps waiting for their checkpoint). A restarted learner holds nothing until it re-reads
        them, so no count can drift.
        """
        if max_staleness < 0:
            raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
        if batch_groups < 1:
            raise ValueError(f"batch_groups must be >= 1, got {batch_groups}")
        if held < 0:
            raise ValueError(f"held must be >= 0, got {held}")
        return max(0, (max_staleness + 1) * batch_groups - (await self.in_flight() - held))

    async def issue(self, specs: Sequence[PromptSpec], version: int) -> list[str]:
        """Append prompts issued at learner ``version``; returns their entry ids.

        Does not check :meth:`capacity` (the learner asks first). Entries, the audit's open set and
        its ``issued`` counter are written by one script; a prompt id already in flight is refused.
        """
        if version < 0:
            raise ValueError(f"version must be >= 0, got {version}")
        items = [(s.prompt_id, encode_prompt(s)) for s in specs]
        if not items:
            return []
        if len({pid for pid, _ in items}) != len(items):
            raise ValueError("issue: prompt ids must be distinct")
        await self._ensure_group()
        res: Any = await self.redis.eval(*self.audit.issue_args(version, items))
        ids = [sid(r) for r in res]
        refused = [pid for (pid, _), eid in zip(items, ids, strict=True) if not eid]
        if refused:
            raise ValueError(f"issue: prompt id(s) {refused[:5]} are already in flight")
        return ids

    # ---- generator side ----------------------------------------------------------------
    async def read(self, consumer: str, count: int, block_ms: int = 0) -> list[PromptEntry]:
        """Up to ``count`` prompts for ``consumer``: abandoned ones first, then new ones.

        Blocks up to ``block_ms`` (0: not at all) when there is nothing to read.
        """
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count}")
        if not consumer or consumer == RELEASED_CONSUMER:
            raise ValueError(f"consumer name {consumer!r} is empty or reserved")
        await self._ensure_group()
        stream, group = self.names.prompts_stream, self.names.prompts_group
        out = await self._reclaim(consumer, count, force=False)
        if not out:
            out = await self._decode(
                await read_group(self.redis, stream, group, consumer, ">", count, 0), consumer, False
            )
        if not out:  # nothing new: look for released or abandoned prompts now, then wait for new ones
            out = await self._reclaim(consumer, count, force=True)
        if not out and block_ms > 0:
            raw = await read_group(self.redis, stream, group, consumer, ">", count, block_ms)
            out = await self._decode(raw, consumer, reclaimed=False)
        return out

    async def _reclaim(self, consumer: str, count: int, force: bool) -> list[PromptEntry]:
        # One pass over the pending list at most: the cursor wraps to 0-0 when it reaches the end.
        out: list[PromptEntry] = []
        start = self._reclaimer.cursor
        while len(out) < count:
            raw = await self._reclaimer.claim(
                self.redis, consumer, self.cfg.reclaim_idle_ms, count - len(out), force=force and not out
            )
            # Prompts this process still works on look idle too: they are not abandoned.
            raw = [(e, f) for e, f in raw if self._in_flight.get(e) != consumer]
            if raw:
                counts = await delivery_counts(
                    self.redis, self.names.prompts_stream, self.names.prompts_group, consumer, [e for e, _ in raw]
                )
                poison = [(e, f) for e, f in raw if counts.get(e, 0) > self.cfg.max_deliveries]
                for eid, fields in poison:
                    await self._quarantine(eid, fields, f"delivered {counts[eid]} times (max_deliveries)")
                raw = [(e, f) for e, f in raw if counts.get(e, 0) <= self.cfg.max_deliveries]
                if raw:
                    log.info("prompt queue: %s reclaimed %d abandoned prompt(s)", consumer, len(raw))
                out += await self._decode(raw, consumer, reclaimed=True)
            if self._reclaimer.cursor in ("0-0", start):
                break
        return out

    async def _decode(self, raw: list[RawEntry], consumer: str, reclaimed: bool) -> list[PromptEntry]:
        out = []
        for eid, fields in raw:
            if fields is None:  # deleted while pending: nothing to do but forget it
                await self.redis.xack(self.names.prompts_stream, self.names.prompts_group, eid)
                continue
            try:
                if _SPEC not in fields:
                    raise WireError("prompt entry has no 'spec' field")
                spec = decode_prompt(fields[_SPEC])
                version = int(fields.get(_VERSION, b"0"))
                issued_at = float(fields.get(_ISSUED_AT, b"0"))
            except (WireError, ValueError) as exc:
                await self._quarantine(eid, fields, str(exc), error_line(exc))
                continue
            out.append(PromptEntry(eid, spec, version, issued_at, reclaimed))
            self._in_flight[eid] = consumer
        return out

    async def _quarantine(self, eid: str, fields: dict[bytes, bytes] | None, reason: str, error: str = "") -> None:
        log.warning("prompt queue: entry %s moved to dead letters: %s", eid, reason)
        await self.dead_letters.quarantine(
            source_stream=self.names.prompts_stream,
            group=self.names.prompts_group,
            source_id=eid,
            fields=fields,
            payload_field=_SPEC,
            reason=reason,
            counters_key=self.names.prompt_counters,
            error=error,
            prompt_id=field_str(fields, _PROMPT_ID),
        )

    async def ack(self, entries: Sequence[PromptEntry | str]) -> int:
        """Done with these prompts (their groups are in the rollout stream): ack and delete them."""
        ids = [e if isinstance(e, str) else e.entry_id for e in entries]
        if not ids:
            return 0
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.xack(self.names.prompts_stream, self.names.prompts_group, *ids)
            pipe.xdel(self.names.prompts_stream, *ids)
            acked, _ = await pipe.execute()
        for i in ids:
            self._in_flight.pop(i, None)
        return int(acked)

    async def dead_letter(self, entry: PromptEntry, reason: str, error: str = "", generator: str = "") -> str:
        """A prompt its generator could not turn into a group (the task's reward or environment raised on it): to the
        dead letters with ``reason`` and ``error`` (the traceback's last line), acked and deleted, its fate
        ``dead_lettered``, in one transaction; not retried (the same prompt fails again on any generator). Returns
        the dead letter's id."""
        spec = entry.spec
        fields = {_SPEC: encode_prompt(spec), _PROMPT_ID: spec.prompt_id.encode(), b"gen": generator.encode(),
                  b"gid": spec.prompt_id.encode()}  # fmt: skip
        letter = await self.dead_letters.quarantine(
            source_stream=self.names.prompts_stream, group=self.names.prompts_group, source_id=entry.entry_id,
            fields=fields, payload_field=_SPEC, reason=reason, counters_key=self.names.prompt_counters, error=error,
            prompt_id=spec.prompt_id,
        )  # fmt: skip
        self._in_flight.pop(entry.entry_id, None)
        return letter

    def forget(self, entries: Sequence[PromptEntry | str]) -> None:
        """Entries acked by a caller's own transaction (:meth:`buffer.evals.EvalQueue.finish`): no longer held."""
        for e in entries:
            self._in_flight.pop(e if isinstance(e, str) else e.entry_id, None)

    async def release(self, entries: Sequence[PromptEntry | str]) -> int:
        """Give prompts back unprocessed (shutdown path): any generator's next read reclaims them at once."""
        ids = [e if isinstance(e, str) else e.entry_id for e in entries]
        if not ids:
            return 0
        claimed: Any = await self.redis.xclaim(
            self.names.prompts_stream,
            self.names.prompts_group,
            RELEASED_CONSUMER,
            0,
            list[Any](ids),
            idle=RELEASED_IDLE_MS,
            justid=True,
        )
        for i in ids:
            self._in_flight.pop(i, None)
        return len(claimed)

    async def touch(self, consumer: str, entries: Sequence[PromptEntry | str]) -> int:
        """Reset the idle time of prompts ``consumer`` still works on, so nobody reclaims them."""
        ids = [e if isinstance(e, str) else e.entry_id for e in entries]
        if not ids:
            return 0
        claimed: Any = await self.redis.xclaim(
            self.names.prompts_stream, self.names.prompts_group, consumer, 0, list[Any](ids), justid=True
        )
        return len(claimed)
