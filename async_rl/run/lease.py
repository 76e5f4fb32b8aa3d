"""One learner per run: the run's lease in Redis, and the fencing token every learner write carries.

* **The lease.** ``Names.learner_lease`` is a hash (token, host, pid, since, run_dir) with a time-to-live of
  ``lease.ttl_s``. :meth:`RunLease.take` creates it in one script, only where none exists, and increments the run's
  counter (``Names.learner_fence``, field ``n``) for the new holder's token. The holder renews it every ``ttl_s / 3``
  (:meth:`RunLease.keep`: a task of the learner's TaskGroup; :meth:`RunLease.kept_alive`: a thread while the backend
  is built) and deletes it when it leaves (:meth:`RunLease.release`). A learner killed without a word leaves it to
  expire: the next one takes it at most ``ttl_s`` later; on the same host (same boot and pid namespace) at once, when
  the holder's process is gone (its pid no longer runs the process that took the lease).
* **The token** is ``<n>:<nonce>`` (the counter, and a random nonce, so a token never repeats even where the run's
  Redis state was lost and the counter started over); the holder's token is the fence's ``current`` field. Every learner
  write that matters runs in a Lua script (or a ``MULTI`` of them) that first compares ``current`` with the token it
  carries (:func:`fenced`): a write of a learner whose token is no longer current is refused by Redis in the same
  atomic step as the write, so a paused or partitioned old learner can do no harm (:class:`FencedOut`).
* **Renewal checks the fence, not the lease.** A holder whose lease expired while nobody took the run (a long pause)
  renews it and goes on (none of its writes was refused); one whose token was replaced learns it is out
  (:class:`LeaseLost`).
* **A second learner** finds the lease and refuses in one line naming the holder (:class:`LeaseHeld`), before it
  restores or writes anything; with ``lease.wait`` it stands by until the lease ends, then takes it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import redis
from redis.exceptions import RedisError, WatchError

from async_rl.run.names import Names

log = logging.getLogger(__name__)

FENCED_MARK = "FENCED:"
"""What a refused write's error says first (redis-py prefixes errors inside a ``MULTI`` with the command's place)."""
RELEASE_TIMEOUT_S = 1.0
"""A leaving learner gives Redis this long to take its lease back (else it expires by itself): a learner leaving
because Redis is gone must not wait longer to say so."""
STANDBY_POLL_PARTS = 4
"""A standing-by learner looks at the lease every ``ttl_s / 4`` at most, and just after it would expire: it takes over
at most that long after a holder released it, and within a few ms of an expiry."""

# Prepended to a script: KEYS[1] is the fence, ARGV[1] the token the write carries; both are removed before the
# script's own body reads KEYS and ARGV, so the body is the unfenced script unchanged.
_FENCE_PROLOGUE = """
local fence_key, fence_token = table.remove(KEYS, 1), table.remove(ARGV, 1)
local fence_now = redis.call('HGET', fence_key, 'current')
if fence_now ~= fence_token then
  return redis.error_reply('FENCED: learner token ' .. fence_token .. ' is not the run\\'s current token ' ..
                           tostring(fence_now) .. ': the write is refused')
end
"""
# KEYS: lease, fence; ARGV: ttl ms, nonce, the token of a holder known to be gone ('': none), then the holder's fields
# (name, value, ...). Takes the lease where there is none, or where it is still the gone holder's.
# Reply: {token, {}, 0, now} taken; {'', the holder's fields, its PTTL in ms, now} held.
_TAKE_LUA = """
local t = redis.call('TIME')
local now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
local cur = redis.call('HGET', KEYS[1], 'token')
if cur and cur ~= ARGV[3] then
  return {'', redis.call('HGETALL', KEYS[1]), redis.call('PTTL', KEYS[1]), now}
end
local token = redis.call('HINCRBY', KEYS[2], 'n', 1) .. ':' .. ARGV[2]
redis.call('HSET', KEYS[2], 'current', token)
redis.call('DEL', KEYS[1])
redis.call('HSET', KEYS[1], 'token', token, 'since', now, unpack(ARGV, 4))
redis.call('PEXPIRE', KEYS[1], ARGV[1])
return {token, {}, 0, now}
"""
# KEYS: lease, fence; ARGV: token, ttl ms, since, then the holder's fields. Reply: {1} renewed; {0, the lease's fields}
# lost. A lease that expired while nobody took the run is this learner's still (the fence says so): made again.
_RENEW_LUA = """
if redis.call('HGET', KEYS[2], 'current') ~= ARGV[1] then
  return {0, redis.call('HGETALL', KEYS[1])}
end
if redis.call('HGET', KEYS[1], 'token') ~= ARGV[1] then
  redis.call('DEL', KEYS[1])
  redis.call('HSET', KEYS[1], 'token', ARGV[1], 'since', ARGV[3], unpack(ARGV, 4))
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return {1}
"""
# KEYS: lease, fence; ARGV: token. Ends this holder's lease and token (nothing it writes later is taken).
_RELEASE_LUA = """
if redis.call('HGET', KEYS[1], 'token') == ARGV[1] then redis.call('DEL', KEYS[1]) end
if redis.call('HGET', KEYS[2], 'current') == ARGV[1] then redis.call('HDEL', KEYS[2], 'current') return 1 end
return 0
"""
# KEYS: hash; ARGV: field, value, ... (a fenced HSET).
_HSET_LUA = "redis.call('HSET', KEYS[1], unpack(ARGV)) return 1"


@dataclass(kw_only=True, slots=True)
class LeaseConfig:
    """The run's lease: one learner per run (docs/learner.md, "One learner per run")."""

    ttl_s: float = 10.0
    """How long the run's lease outlives its holder's last renewal (renewed every ttl_s/3): a learner killed without a
    word is replaced at most this long after. Shorter: faster takeover, but a learner stalled longer than this (a
    frozen host) loses the run to a standing-by learner."""
    wait: bool = False
    """When the run already has a learner: false refuses in one line naming it (exit 1); true stands by until its
    lease ends (it stops, or dies and the lease expires), then takes the run over and resumes from the last
    checkpoint (a rolling update, a hot spare)."""

    def __post_init__(self) -> None:
        if not self.ttl_s >= 1.0:
            raise ValueError(f"learner.lease.ttl_s must be >= 1, got {self.ttl_s}")


@dataclass(frozen=True, slots=True)
class Holder:
    """Who holds a run's lease."""

    token: str
    host: str
    pid: int
    since: float
    """Unix time (the Redis server's clock) it took the lease."""
    run_dir: str
    age_s: float
    """Seconds it has held it (the Redis server's clock)."""
    ttl_s: float = 0.0
    """Seconds left before the lease expires unless renewed."""
    node: str = ""
    """The holder's machine boot and pid namespace ('' unknown): where they are ours, its pid can be looked at."""
    pid_start: str = ""
    """The holder process's start time (clock ticks after boot): a pid reused by another process is not it."""

    def gone_here(self) -> bool:
        """Whether the holder ran on this machine and pid namespace and its process is gone (killed, crashed)."""
        return bool(self.node) and self.node == node_id() and process_start(self.pid) != self.pid_start

    @property
    def number(self) -> str:
        """The token's counter (what a line shows)."""
        return self.token.partition(":")[0]

    def describe(self) -> str:
        since = time.strftime("%H:%M:%S UTC", time.gmtime(self.since)) if self.since else "?"
        return (f"pid {self.pid} on host {self.host}, since {since} ({self.age_s:.0f}s ago), run_dir {self.run_dir}, "
                f"token {self.number}")  # fmt: skip

    @classmethod
    def parse(cls, raw: Any, now: float, pttl_ms: int = 0) -> Holder | None:
        """From a lease's ``HGETALL`` (a flat list or a dict; None when empty)."""
        if not raw:
            return None
        items = raw.items() if isinstance(raw, dict) else zip(raw[::2], raw[1::2], strict=True)
        f = {_text(k): _text(v) for k, v in items}
        since = float(f.get("since") or 0)
        return cls(token=f.get("token", "?"), host=f.get("host", "?"), pid=int(f.get("pid") or 0), since=since,
                   run_dir=f.get("run_dir", "?"), age_s=max(0.0, now - since) if since else 0.0,
                   ttl_s=max(0, int(pttl_ms)) / 1000, node=f.get("node", ""), pid_start=f.get("pid_start", ""))  # fmt: skip


class LeaseHeld(RuntimeError):
    """The run has a learner already (the message is the line to print)."""

    holder: Holder

    def __init__(self, prefix: str, holder: Holder) -> None:
        super().__init__(f"run {prefix!r} already has a learner: {holder.describe()}; this one stopped before loading "
                         f"or writing anything. Stop that learner first (stopped, it frees the run at once; if it is "
                         f"gone, its lease ends in {holder.ttl_s:.0f}s), or set lease.wait=true to stand by and take "
                         "over when it ends")  # fmt: skip
        self.holder = holder


class FencedOut(RuntimeError):
    """A write of this learner was refused: its token is no longer the run's current one."""


class LeaseLost(FencedOut):
    """Renewing the lease found another learner's token current (the message names it)."""


def is_fenced(exc: BaseException) -> bool:
    """Whether ``exc`` (or an exception inside it: a group, a cause) is this learner being fenced out."""
    seen: set[int] = set()
    stack: list[BaseException] = [exc]
    while stack:
        cur = stack.pop()
        if id(cur) in seen:
            continue
        seen.add(id(cur))
        if isinstance(cur, FencedOut) or (isinstance(cur, RedisError) and FENCED_MARK in str(cur)):
            return True
        if isinstance(cur, BaseExceptionGroup):
            stack += cur.exceptions
        stack += [c for c in (cur.__cause__, cur.__context__) if c is not None]
    return False


@dataclass(frozen=True, slots=True)
class Fence:
    """What a learner's writes carry: the fence key of its run and its token."""

    key: str
    token: str

    async def check(self, client: Any) -> None:
        """Raise :class:`FencedOut` unless the token is current (for writes outside Redis: the checkpoint's files)."""
        now = await client.hget(self.key, "current")
        if _text(now) != self.token:
            raise self._refused(now)

    async def watch(self, pipe: Any) -> None:
        """Start a fenced ``MULTI`` on ``pipe`` (a pipeline out of transaction mode): ``WATCH`` the fence, check the
        token, then ``MULTI``; the ``EXEC`` fails (:func:`watched`) if another learner takes the run in between."""
        await pipe.watch(self.key)
        now = await pipe.hget(self.key, "current")
        if _text(now) != self.token:
            await pipe.reset()
            raise self._refused(now)
        pipe.multi()

    def _refused(self, now: Any) -> FencedOut:
        return FencedOut(f"{FENCED_MARK} learner token {self.token} is not the run's current token "
                         f"{_text(now) or 'none'}: the write is refused")  # fmt: skip


@contextlib.asynccontextmanager
async def watched(fence: Fence | None) -> Any:
    """Around the ``EXEC`` of a MULTI started by :meth:`Fence.watch`: a ``WatchError`` becomes :class:`FencedOut`."""
    try:
        yield
    except WatchError:
        if fence is None:
            raise
        raise FencedOut(f"{FENCED_MARK} the run's token changed during a write of learner token {fence.token}") from None


def fenced(fence: Fence | None, script: str, keys: list[str], args: list[Any]) -> tuple[Any, ...]:
    """The arguments of ``EVAL`` for ``script`` on ``keys`` and ``args``: with a fence, the script refuses to run
    (error ``FENCED: ...``) unless the fence's token is the run's current one, checked in the same atomic step."""
    if fence is None:
        return (script, len(keys), *keys, *args)
    return (_FENCE_PROLOGUE + script, len(keys) + 1, fence.key, *keys, fence.token, *args)


async def fenced_hset(client: Any, fence: Fence | None, key: str, mapping: dict[str, Any]) -> None:
    """``HSET key mapping``, refused where the fence's token is not current."""
    if fence is None:
        await client.hset(key, mapping=mapping)
        return
    flat = [x for kv in mapping.items() for x in kv]
    await client.eval(*fenced(fence, _HSET_LUA, [key], flat))


class RunLease:
    """The run's lease as one learner takes, keeps and releases it (module docstring)."""

    names: Names
    cfg: LeaseConfig
    fence: Fence | None
    """Set once the lease is taken."""
    since: str
    lost: Holder | None
    """Set when a renewal found another learner's token current."""
    _url: str
    _fields: list[str]
    """The holder's fields as the lease keeps them (name, value, ...), besides its token and since."""
    _nonce: str
    _renewed_at: float
    """``time.monotonic()`` of the take or the last renewal: each renewer keeps that cadence (a hand-off from the build's
    renewer to the loop's, each waiting a whole interval first, let an 8 s lease lapse: a standby took a live run)."""

    def __init__(self, redis_url: str, names: Names, cfg: LeaseConfig, *, run_dir: Path | str) -> None:
        self.names = names
        self.cfg = cfg
        self.fence = None
        self.since = ""
        self.lost = None
        self._url = redis_url
        pid = os.getpid()
        self._fields = ["host", socket.gethostname(), "pid", str(pid), "run_dir", str(Path(run_dir).resolve()),
                        "node", node_id(), "pid_start", process_start(pid)]  # fmt: skip
        self._nonce = uuid.uuid4().hex[:12]
        self._renewed_at = 0.0

    @property
    def _ttl_ms(self) -> int:
        return int(self.cfg.ttl_s * 1000)

    @property
    def renew_every_s(self) -> float:
        return self.cfg.ttl_s / 3

    def _client(self, timeout_s: float | None = None) -> redis.Redis:
        timeout = timeout_s or max(2.0, self.cfg.ttl_s / 3)
        return redis.Redis.from_url(self._url, socket_connect_timeout=timeout, socket_timeout=timeout)

    # ---- taking it -----------------------------------------------------------------------------------------
    def try_take(self, client: redis.Redis, gone: str = "") -> Holder | None:
        """One attempt: None when this learner took the lease (:attr:`fence` set), else the holder. ``gone``: the
        token of a holder known to be dead, whose lease may be taken before it expires."""
        n = self.names
        res: Any = client.eval(_TAKE_LUA, 2, n.learner_lease, n.learner_fence, self._ttl_ms, self._nonce, gone,
                               *self._fields)  # fmt: skip
        token, fields, pttl, now = _text(res[0]), res[1], int(res[2]), float(_text(res[3]))
        if token:
            self.fence = Fence(n.learner_fence, token)
            self.since = _text(res[3])
            self._renewed_at = time.monotonic()
            return None
        holder = Holder.parse(fields, now, pttl)
        assert holder is not None, "the take script returns the holder's fields when the lease exists"
        return holder

    def take(self) -> Holder | None:
        """Take the run's lease (or raise :class:`LeaseHeld`); with ``lease.wait``, stand by until it is free.
        Returns the holder this learner waited for (None: the lease was free)."""
        waited_for: Holder | None = None
        gone = ""
        t0 = time.monotonic()
        with contextlib.closing(self._client()) as client:
            while True:
                holder = self.try_take(client, gone)
                if holder is None:
                    break
                if holder.gone_here() and holder.token != gone:  # killed on this host: no need to wait for the TTL
                    log.info("run %r was held by %s, whose process is gone: taking it over", self.names.prefix,
                             holder.describe())  # fmt: skip
                    gone = holder.token
                    continue
                if not self.cfg.wait:
                    raise LeaseHeld(self.names.prefix, holder)
                if waited_for is None or holder.token != waited_for.token:
                    log.info("run %r has a learner: %s; standing by (lease.wait=true) to take over when it ends",
                             self.names.prefix, holder.describe())  # fmt: skip
                waited_for = holder
                time.sleep(min(holder.ttl_s + 0.01, self.cfg.ttl_s / STANDBY_POLL_PARTS))
        assert self.fence is not None
        if waited_for is not None:
            log.info("took run %r over (token %s) from pid %d on host %s after standing by %.1fs", self.names.prefix,
                     self.token_number, waited_for.pid, waited_for.host, time.monotonic() - t0)  # fmt: skip
        else:
            log.info("holding run %r (token %s; lease.ttl_s=%g, renewed every %.1fs)", self.names.prefix,
                     self.token_number, self.cfg.ttl_s, self.renew_every_s)  # fmt: skip
        return waited_for

    @property
    def token_number(self) -> str:
        return self.fence.token.partition(":")[0] if self.fence else "-"

    # ---- keeping it ----------------------------------------------------------------------------------------
    def _renew_args(self) -> tuple[Any, ...]:
        assert self.fence is not None, "take the lease first"
        n = self.names
        return (_RENEW_LUA, 2, n.learner_lease, n.learner_fence, self.fence.token, self._ttl_ms, self.since,
                *self._fields)  # fmt: skip

    def _renewed(self, res: Any) -> bool:
        if int(res[0]):
            return True
        self.lost = Holder.parse(res[1], time.time()) if len(res) > 1 else None
        return False

    def lost_error(self) -> LeaseLost:
        who = self.lost.describe() if self.lost is not None else "no learner holds it now (its Redis state lost?)"
        return LeaseLost(f"another learner took run {self.names.prefix!r}: {who}; this learner (token "
                         f"{self.token_number}) stops, its writes are refused")  # fmt: skip

    async def keep(self) -> None:
        """Renew every ``ttl_s / 3`` until cancelled; raise :class:`LeaseLost` when another learner took the run, or
        Redis's error when no renewal went through for ``ttl_s`` (a learner that lost Redis exits). The renewals run
        in a thread of their own: a busy event loop (a long checkpoint, a slow step, a starved CPU) is no reason for
        the lease to lapse while the learner lives."""
        loop = asyncio.get_running_loop()
        ended = asyncio.Event()
        stop = threading.Event()
        failure: list[BaseException] = []

        def on_end(exc: BaseException | None) -> None:
            if exc is not None:
                failure.append(exc)
            if not stop.is_set():
                with contextlib.suppress(RuntimeError):  # the loop closed meanwhile: nobody waits any more
                    loop.call_soon_threadsafe(ended.set)

        thread = threading.Thread(target=self._keep_in_thread, args=(stop, on_end), name="run-lease", daemon=True)
        thread.start()
        try:
            await ended.wait()
        finally:
            stop.set()  # the thread leaves after the renewal in flight, if any (no wait: Redis may be gone)
        if failure:
            raise failure[0]
        raise self.lost_error()

    @contextlib.contextmanager
    def kept_alive(self) -> Iterator[None]:
        """Renew from a thread while the caller works without an event loop (building the backend); raise
        :class:`LeaseLost` afterwards if another learner took the run meanwhile."""
        stop = threading.Event()
        thread = threading.Thread(target=self._keep_in_thread, args=(stop,), name="run-lease", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop.set()
            thread.join()
        if self.lost is not None:
            raise self.lost_error()

    def _keep_in_thread(self, stop: threading.Event,
                        on_end: Callable[[BaseException | None], None] | None = None) -> None:  # fmt: skip
        """Renew until ``stop`` is set or the run is lost (then ``on_end(None)``). A failed renewal is retried at the
        next one; with ``on_end``, renewals failing for a whole ``ttl_s`` end it with their error."""
        failing_since: float | None = None
        next_at = self._renewed_at + self.renew_every_s  # the cadence of the renewer before this one (_renewed_at)
        with contextlib.closing(self._client()) as client:
            while not stop.wait(max(0.0, next_at - time.monotonic())):
                next_at = time.monotonic() + self.renew_every_s
                try:
                    renewed = self._renewed(client.eval(*self._renew_args()))
                except RedisError as exc:  # the learner meets the same server next; it names it then
                    log.warning("renewing run %r's lease failed: %s", self.names.prefix, exc)
                    failing_since = failing_since if failing_since is not None else time.monotonic()
                    if on_end is not None and time.monotonic() - failing_since >= self.cfg.ttl_s:
                        on_end(exc)
                        return
                    continue
                failing_since = None
                self._renewed_at = time.monotonic()
                if not renewed:
                    if on_end is not None:
                        on_end(None)
                    return

    # ---- leaving -------------------------------------------------------------------------------------------
    def release(self) -> bool:
        """End this learner's lease and token (a standing-by learner takes over at once); False when they were not
        its own any more or Redis did not answer."""
        if self.fence is None:
            return False
        n = self.names
        try:
            with contextlib.closing(self._client(RELEASE_TIMEOUT_S)) as client:
                return bool(client.eval(_RELEASE_LUA, 2, n.learner_lease, n.learner_fence, self.fence.token))
        except RedisError as exc:  # on the way out, often because Redis is gone: the lease expires by itself
            log.debug("releasing run %r's lease failed (it expires within %gs): %s", n.prefix, self.cfg.ttl_s, exc)
            return False

    def current_holder(self) -> Holder | None:
        """Who holds the run's lease now (None: nobody, or Redis did not answer)."""
        try:
            with contextlib.closing(self._client()) as client:
                raw, pttl, now = client.hgetall(self.names.learner_lease), client.pttl(self.names.learner_lease), \
                    client.time()  # fmt: skip
        except RedisError:
            return None
        return Holder.parse(raw, now[0] + now[1] / 1e6, int(pttl))  # type: ignore[index,arg-type]

    def fenced_line(self) -> str:
        """The one line of a learner fenced out of its run."""
        holder = self.current_holder()
        if holder is not None and self.fence is not None and holder.token != self.fence.token:
            self.lost = holder
        return str(self.lost_error())


def node_id() -> str:
    """This machine's boot and pid namespace ('' where /proc does not say): processes with the same node id see each
    other's pids."""
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        namespace = os.stat("/proc/self/ns/pid").st_ino
    except OSError:
        return ""
    return f"{boot}/{namespace}"


def process_start(pid: int) -> str:
    """When process ``pid`` started (clock ticks after boot, ``/proc/<pid>/stat`` field 22); '' when there is no such
    process, or only its zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return ""
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) ": field 3 (the state) on
    return "" if fields[0] in ("Z", "X") else fields[19]


def _text(v: Any) -> str:
    if v is None or v is False:
        return ""
    return v.decode(errors="replace") if isinstance(v, bytes) else str(v)
