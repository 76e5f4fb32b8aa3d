"""The end of a run, announced and recorded, so that every process of the run ends with it.

A learner that reaches ``max_steps`` or ``target_reward`` has finished the run. It sends a
:class:`~async_rl.servers.control.RunEnded` on the run's control subject (generators react at once) and
keeps the same message under :attr:`~async_rl.run.names.Names.run_ended` in Redis (NATS messages are
hints: a generator that was reconnecting, or that starts after the end, reads the record). A learner
that starts or resumes the run deletes the record first, so only the newest learner's end counts.
A learner stopped by a signal has not finished the run (a successor may resume it) and records nothing.
The record is written under the learner's fence (:mod:`async_rl.run.lease`): a learner another one took the run from
ends nothing.
"""

from __future__ import annotations

import logging

import redis.asyncio as aioredis

from async_rl.run.lease import Fence, fenced
from async_rl.run.names import Names
from async_rl.servers.control import ControlPlane, MessageError, RunEnded, decode, encode

log = logging.getLogger(__name__)


# KEYS: the record; ARGV: the encoded end (a SET that a fence can guard).
_SET_LUA = "redis.call('SET', KEYS[1], ARGV[1]) return 1"


async def announce_run_end(redis: aioredis.Redis, control: ControlPlane | None, names: Names, msg: RunEnded, *,
                           fence: Fence | None = None) -> None:  # fmt: skip
    """Record the end in Redis (the copy of record; refused unless ``fence``'s token is the run's current one), then
    tell the generators on NATS and flush."""
    await redis.eval(*fenced(fence, _SET_LUA, [names.run_ended], [encode(msg)]))
    if control is not None:
        await control.publish(names.control_subject, msg)
        await control.flush()


async def read_run_end(redis: aioredis.Redis, names: Names) -> RunEnded | None:
    """The recorded end of the run, or None while it runs (an unreadable record is logged and ignored)."""
    raw = await redis.get(names.run_ended)
    if not isinstance(raw, bytes):  # None while the run goes on (the clients here never decode responses)
        return None
    try:
        msg = decode(raw)
    except MessageError as exc:
        log.warning("ignoring an unreadable end-of-run record at %s: %s", names.run_ended, exc)
        return None
    return msg if isinstance(msg, RunEnded) else None


async def clear_run_end(redis: aioredis.Redis, names: Names) -> None:
    """A learner (re)starts the run: an earlier learner's end no longer applies."""
    await redis.delete(names.run_ended)
