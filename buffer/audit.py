"""The audit: every issued prompt ends with one recorded fate, and the counters move with it.

* **Open prompts.** :meth:`Audit.issue_script` appends prompts and records each one in
  ``Names.audit_open`` (prompt id -> ``entry id|issued version|issued at``) and ``issued`` in
  ``Names.audit_counters``, in one script: a prompt is never in the stream without being open.
* **Fates, once.** :meth:`Audit.finish_into` queues a script in the caller's ``MULTI`` that, for each
  prompt id, ``HDEL`` s it from the open hash and only if it was there appends ``(pid, fate, detail)``
  to ``Names.audit_fates`` and adds one to that fate's counter. The caller's transaction also holds
  the stream acks that make the fate true (a committed step's ``XACK``, a stale drop, a dead letter),
  so a process killed at any point leaves either both or neither, and a fate recorded twice (a
  re-commit after a restart) counts once. Fates: ``trained`` (detail ``step k``), ``dropped_stale``
  (``lag n``), ``dead_lettered`` (the reason).
* **Exact totals.** ``issued = trained + dropped_stale + dead_lettered + in flight`` where in flight
  is ``HLEN`` of the open hash; admission control bounds that number.
* **Fenced.** An audit built with the learner's :class:`~async_rl.run.lease.Fence` runs both scripts fenced: a
  learner whose token is no longer the run's current one issues nothing and finishes nothing (Redis refuses the
  script before it writes).
* **Retention.** The fates stream keeps the newest ``max_fates`` fates (``XADD MAXLEN ~``); counters
  keep every total for the life of the run. :func:`audit_run` checks the totals, compares them with
  the fates still kept, and locates every open prompt in the prompt or rollout stream: one found in
  neither is reported as unaccounted.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis

from async_rl.run.lease import Fence, fenced
from async_rl.run.names import Names
from async_rl.wire import WireError, decode_prompt
from buffer.streams import check_client, sid

FATES = ("trained", "dropped_stale", "dead_lettered")
"""Final fates of an issued prompt (also the counter fields of ``Names.audit_counters``)."""
EVAL_FATES = ("evaluated", "dead_lettered")
"""Final fates of an evaluation prompt (:mod:`buffer.evals`: its own open set and counters, under
``Names.evaluation``): scored and its result appended, or dead-lettered."""
# ~150 bytes a fate in Redis: 200k fates is ~30 MB, about 6,000 steps of 32 prompts, while the counters keep totals.
DEFAULT_MAX_FATES = 200_000

# KEYS: prompts stream, audit open, audit counters; ARGV: version, issued at, then (prompt id, spec) pairs.
# A prompt id already open is not issued again (its slot in the reply is '').
_ISSUE_LUA = """
local ids = {}
local n = 0
for i = 3, #ARGV, 2 do
  local pid = ARGV[i]
  if redis.call('HEXISTS', KEYS[2], pid) == 1 then
    ids[#ids + 1] = ''
  else
    local id = redis.call('XADD', KEYS[1], '*', 'spec', ARGV[i + 1], 'ver', ARGV[1], 'at', ARGV[2], 'pid', pid)
    redis.call('HSET', KEYS[2], pid, id .. '|' .. ARGV[1] .. '|' .. ARGV[2])
    ids[#ids + 1] = id
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[3], 'issued', n) end
return ids
"""
# KEYS: audit open, audit fates, audit counters; ARGV: fate, max fates, at, then (prompt id, detail) pairs.
_FINISH_LUA = """
local n = 0
for i = 4, #ARGV, 2 do
  if redis.call('HDEL', KEYS[1], ARGV[i]) == 1 then
    redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[2], '*', 'pid', ARGV[i], 'fate', ARGV[1],
               'detail', ARGV[i + 1], 'at', ARGV[3])
    n = n + 1
  end
end
if n > 0 then redis.call('HINCRBY', KEYS[3], ARGV[1], n) end
return n
"""


@dataclass(kw_only=True, slots=True)
class AuditConfig:
    """Retention of the audit."""

    max_fates: int = DEFAULT_MAX_FATES
    """Fates kept in the fates stream, newest first (about 150 bytes each in Redis); totals are kept forever."""

    def __post_init__(self) -> None:
        if self.max_fates < 1:
            raise ValueError("buffer.audit.max_fates must be >= 1")


class Audit:
    """Writes and reads the audit of one run (see the module docstring)."""

    redis: aioredis.Redis
    names: Names
    cfg: AuditConfig
    fates_allowed: tuple[str, ...]
    """The fates this audit records: :data:`FATES` for training prompts, :data:`EVAL_FATES` for evaluation's."""
    fence: Fence | None
    """The learner's fence: issues and fates are refused by Redis unless its token is the run's current one."""

    def __init__(self, redis: aioredis.Redis, names: Names, cfg: AuditConfig | None = None,
                 fates: tuple[str, ...] = FATES, *, fence: Fence | None = None) -> None:  # fmt: skip
        self.redis = check_client(redis, "Audit")
        self.names = names
        self.cfg = cfg or AuditConfig()
        self.fates_allowed = fates
        self.fence = fence

    def issue_args(self, version: int, items: Sequence[tuple[str, bytes]]) -> tuple[Any, ...]:
        """The arguments of ``EVAL`` that issue ``(prompt id, encoded spec)`` pairs at ``version`` (fenced)."""
        n = self.names
        args: list[Any] = [version, repr(time.time())]
        for pid, spec in items:
            args += [pid, spec]
        return fenced(self.fence, _ISSUE_LUA, [n.prompts_stream, n.audit_open, n.audit_counters], args)

    def finish_into(self, pipe: Any, fate: str, items: Iterable[tuple[str, str]]) -> bool:
        """Queue, in ``pipe`` (a transaction), the fate of each ``(prompt id, detail)``; False when there are none."""
        if fate not in self.fates_allowed:
            raise ValueError(f"fate must be one of {self.fates_allowed}, got {fate!r}")
        flat: list[str] = []
        for pid, detail in items:
            flat += [pid, detail]
        if not flat:
            return False
        n = self.names
        pipe.eval(*fenced(self.fence, _FINISH_LUA, [n.audit_open, n.audit_fates, n.audit_counters],
                          [fate, self.cfg.max_fates, repr(time.time()), *flat]))  # fmt: skip
        return True

    async def finish(self, fate: str, items: Iterable[tuple[str, str]]) -> int:
        """Record fates on their own (no stream ack goes with them); returns how many prompts were still open."""
        async with self.redis.pipeline(transaction=True) as pipe:
            if not self.finish_into(pipe, fate, items):
                return 0
            res = await pipe.execute()
        return int(res[0])

    async def open_among(self, prompt_ids: Sequence[str]) -> set[str]:
        """Which of ``prompt_ids`` are issued and not yet finished."""
        if not prompt_ids:
            return set()
        found: Any = await self.redis.hmget(self.names.audit_open, list(prompt_ids))
        return {pid for pid, v in zip(prompt_ids, found, strict=True) if v is not None}

    async def in_flight(self) -> int:
        """Prompts issued and not yet finished (what admission control bounds)."""
        return int(await self.redis.hlen(self.names.audit_open))

    async def counters(self) -> dict[str, int]:
        """``issued``, each fate's total and ``in_flight``."""
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self.names.audit_counters)
            pipe.hlen(self.names.audit_open)
            raw, open_n = await pipe.execute()
        c = {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
        out = {"issued": c.get("issued", 0), **{f: c.get(f, 0) for f in self.fates_allowed}}
        out["in_flight"] = int(open_n)
        return out

    async def fates(self, count: int | None = None) -> list[dict[str, Any]]:
        """Fates kept, oldest first (the newest ``count`` when given)."""
        rows: Any = await (self.redis.xrevrange(self.names.audit_fates, count=count) if count
                           else self.redis.xrange(self.names.audit_fates))  # fmt: skip
        out = [{"pid": _text(f.get(b"pid")), "fate": _text(f.get(b"fate")), "detail": _text(f.get(b"detail")),
                "at": float(f.get(b"at", b"0"))} for _, f in rows]  # fmt: skip
        return out[::-1] if count else out


def _text(v: Any) -> str:
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v or "")


async def audit_run(redis: aioredis.Redis, names: Names, *, max_unaccounted: int = 50) -> dict[str, Any]:
    """Check a run: totals add up, the kept fates match the counters, every open prompt is somewhere.

    Open prompts are looked for in the prompt stream (queued or held by a generator) and then in
    the rollout stream (its group waits for the learner, or is held by it); the open hash is read
    again at the end and only prompts still open then are reported, so work finishing while the
    audit runs is not mistaken for loss. ``ok`` is True when nothing is unaccounted and the numbers
    agree exactly.
    """
    audit = Audit(redis, names)
    counters = await audit.counters()
    before: dict[bytes, bytes] = await redis.hgetall(names.audit_open)  # type: ignore[assignment]
    in_prompts: set[str] = set()
    async for _eid, fields in _scan_stream(redis, names.prompts_stream):
        pid = fields.get(b"pid")
        if pid is None and b"spec" in fields:
            try:
                pid = decode_prompt(fields[b"spec"]).prompt_id.encode()
            except WireError:
                continue
        if pid is not None:
            in_prompts.add(_text(pid))
    in_rollouts: set[str] = set()
    async for _, fields in _scan_stream(redis, names.rollouts_stream):
        if b"gid" in fields:
            in_rollouts.add(_text(fields[b"gid"]))
    after = set(_text(k) for k in await redis.hkeys(names.audit_open))
    unaccounted = sorted(p for p in (_text(k) for k in before) if p in after and p not in in_prompts
                         and p not in in_rollouts)  # fmt: skip
    kept = await audit.fates()
    by_fate = {f: 0 for f in FATES}
    pids_seen: dict[str, int] = {}
    for row in kept:
        by_fate[row["fate"]] = by_fate.get(row["fate"], 0) + 1
        pids_seen[row["pid"]] = pids_seen.get(row["pid"], 0) + 1
    twice = sorted(p for p, n in pids_seen.items() if n > 1)
    finished = sum(counters[f] for f in FATES)
    trimmed = len(kept) < finished
    balanced = counters["issued"] == finished + counters["in_flight"]
    fates_match = trimmed or all(by_fate[f] == counters[f] for f in FATES)
    return {
        "counters": counters,
        "balanced": balanced,
        "fates_kept": len(kept),
        "fates_kept_by_kind": by_fate,
        "fates_trimmed": trimmed,
        "fates_match_counters": fates_match,
        "finished_twice": twice[:max_unaccounted],
        "open_in_prompt_stream": len(in_prompts & after),
        "open_in_rollout_stream": len((in_rollouts - in_prompts) & after),
        "unaccounted": unaccounted[:max_unaccounted],
        "num_unaccounted": len(unaccounted),
        "ok": balanced and fates_match and not unaccounted and not twice,
    }


async def _scan_stream(redis: aioredis.Redis, stream: str, batch: int = 500) -> Any:
    start = "-"
    while True:
        rows: Any = await redis.xrange(stream, min=start, count=batch)
        for eid, fields in rows:
            yield sid(eid), fields
        if len(rows) < batch:
            return
        ms, _, seq = sid(rows[-1][0]).partition("-")
        start = f"{ms}-{int(seq) + 1}"
