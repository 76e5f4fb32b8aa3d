"""Which runs a Redis holds: the line that says a prefix names no run, and which prefixes do.

A run exists once its learner has written ``<prefix>:learner:state`` (:attr:`Names.learner_state`), which stays
after the run ends (or once prompts were issued under the prefix). A generator, ``status`` or ``audit`` pointed at a prefix with no such key asks
:func:`missing_run` for one line: the prefixes that exist in that database (a close one offered as "did you mean"),
and the other database of the same server that holds the prefix, when one does (``/1`` for ``/0``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from async_rl.process.lifecycle import redact_url
from async_rl.run.names import Names

STATE_SUFFIX = Names(prefix="x").learner_state[len("x") :]
"""``:learner:state``: the key suffix that marks a run (built by Names, as every key is)."""
MAX_LISTED = 12
"""Prefixes named in one line (a shared test Redis may hold hundreds)."""


async def run_prefixes(redis: Any) -> list[str]:
    """Prefixes of the runs in the client's database, sorted."""
    found = set()
    async for key in redis.scan_iter(match=f"*{STATE_SUFFIX}", count=1000):
        text = key.decode() if isinstance(key, bytes) else str(key)
        found.add(text[: -len(STATE_SUFFIX)])
    return sorted(found)


def _with_db(url: str, db: int) -> str:
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, f"/{db}", parts.query, parts.fragment))


async def _other_dbs(redis: Any, url: str, prefix: str) -> list[int]:
    """Other databases of the same server that hold run ``prefix``."""
    import redis.asyncio as aioredis

    if url.startswith("unix://"):
        return []
    info = await redis.info("keyspace")
    here = int(redis.connection_pool.connection_kwargs.get("db", 0) or 0)
    out = []
    for name in info:
        db = int(str(name)[2:]) if str(name).startswith("db") else -1
        if db < 0 or db == here:
            continue
        other = aioredis.Redis.from_url(_with_db(url, db))
        try:
            if await other.exists(Names(prefix=prefix).learner_state):
                out.append(db)
        finally:
            await other.aclose()
    return out


@dataclass(frozen=True, slots=True)
class MissingRun:
    """A prefix with no run at a Redis: the line to print, and the other database that holds it, if one does."""

    line: str
    other_db: int | None


async def missing_run(redis: Any, url: str, prefix: str, key: str = "run.prefix") -> MissingRun | None:
    """None when run ``prefix`` exists at ``redis``; otherwise one line naming what exists there (``key`` is how
    the user sets the prefix: ``run.prefix`` or ``--prefix``)."""
    names = Names(prefix=prefix)
    if await redis.exists(names.learner_state, names.prompts_stream):
        return None
    prefixes = await run_prefixes(redis)
    where = redact_url(url)
    if prefixes:
        listed = ", ".join(prefixes[:MAX_LISTED]) + (f" and {len(prefixes) - MAX_LISTED} more"
                                                     if len(prefixes) > MAX_LISTED else "")  # fmt: skip
        line = f"no run {prefix!r} at {where}; runs there: {listed}"
        close = difflib.get_close_matches(prefix, prefixes, n=1, cutoff=0.75)
        if close:
            line += f" (did you mean {key}={close[0]}?)"
    else:
        line = f"no run {prefix!r} at {where}, and no other run there either (has its learner started?)"
    dbs = await _other_dbs(redis, url, prefix)
    if dbs:
        line += f"; run {prefix!r} is in database {dbs[0]} of that server: {redact_url(_with_db(url, dbs[0]))}"
    return MissingRun(line, dbs[0] if dbs else None)


def missing_run_at(url: str, prefix: str, key: str = "run.prefix") -> str | None:
    """:func:`missing_run` from synchronous code (the ``status`` and ``audit`` commands), on its own client."""
    import asyncio

    import redis.asyncio as aioredis

    async def _check() -> str | None:
        client = aioredis.Redis.from_url(url)
        try:
            missing = await missing_run(client, url, prefix, key)
        finally:
            await client.aclose()
        return None if missing is None else missing.line

    return asyncio.run(_check())
