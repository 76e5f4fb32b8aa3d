"""Who pulls a version from whom: relay entries in one Redis hash per version, parents chosen by a Lua script.

``weights:<v>:relays`` (:meth:`Names.weights_relays`) maps a peer id to a JSON entry written only on behalf of
its owner: ``tcp`` and ``unix`` addresses, ``host`` (boot id + network namespace: peers with the same one
pass memfds instead of bytes), ``parent``, ``depth``, ``have`` (buckets held), ``done``, ``fanout`` and
``exp`` (ms, Redis clock; renewed by a heartbeat every third of the TTL). No process decides the tree: each
child runs :data:`_PICK_LUA`, which, atomically,

- drops entries whose ``exp`` passed (a dead peer leaves within its TTL; one whose port refuses leaves at
  once, reported by the child that found it);
- counts each peer's live children, and keeps peers that hold or receive (have a parent) the caller's next bucket (a
  publishing rank holds only its own range ``lo``..``hi``), with a free slot (``fanout``), that are not the caller's
  own descendants (it walks ``parent`` links: no cycles), that the caller did not exclude (unreachable,
  or sent a corrupt bucket);
- prefers a peer on the caller's host; then any generator over a publisher (depth 0: its uplink feeds only
  children no generator can take, so it sends about one copy per version whatever the number of generators);
  then one that holds the whole version, then the shallowest, then the one holding most buckets; and records
  the choice as the caller's ``parent`` and ``depth``.

With ``fanout`` 1 everywhere the version runs down a chain, each link at full speed; larger fan-outs give
shallower trees whose links share each parent's uplink.
"""

from __future__ import annotations

import json
import os
import socket
import threading
from dataclasses import asdict, dataclass
from typing import Any

import redis

# KEYS: relays hash; ARGV: me, the next bucket wanted, then excluded ids. Returns {id, tcp, unix, host, depth} or nil.
_PICK_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local me = ARGV[1]
local want = tonumber(ARGV[2])
local ex = {}
for i = 3, #ARGV do ex[ARGV[i]] = true end
local raw = redis.call('HGETALL', KEYS[1])
local e = {}
for i = 1, #raw, 2 do
  local ok, d = pcall(cjson.decode, raw[i + 1])
  if ok and type(d) == 'table' and tonumber(d.exp) and tonumber(d.exp) >= now then
    e[raw[i]] = d
  else
    redis.call('HDEL', KEYS[1], raw[i])
  end
end
local mine = e[me]
if not mine then return nil end
local kids = {}
for id, d in pairs(e) do
  if id ~= me and d.parent ~= '' and e[d.parent] and d.done == 0 then
    kids[d.parent] = (kids[d.parent] or 0) + 1
  end
end
local function below_me(id)
  local cur = id
  for _ = 1, 1024 do
    if cur == me then return true end
    local d = e[cur]
    if not d or d.parent == '' then return false end
    cur = d.parent
  end
  return true
end
local best, bkey = nil, nil
for id, d in pairs(e) do
  local holds = (tonumber(d.lo) or -1) < 0 or (want >= d.lo and want < d.hi)
  local fed = d.done == 1 or d.parent ~= ''
  if id ~= me and not ex[id] and holds and fed and (d.host == mine.host or (kids[id] or 0) < d.fanout)
     and not below_me(id) then
    local key = {d.host == mine.host and 0 or 1, d.depth == 0 and 1 or 0, d.done == 1 and 0 or 1, d.depth, -d.have}
    local better = best == nil
    if not better then
      for k = 1, 5 do
        if key[k] ~= bkey[k] then better = key[k] < bkey[k] break end
      end
    end
    if better then best, bkey = id, key end
  end
end
if not best then return nil end
mine.parent = best
mine.depth = e[best].depth + 1
redis.call('HSET', KEYS[1], me, cjson.encode(mine))
return {best, e[best].tcp, e[best].unix, e[best].host, tostring(mine.depth)}
"""

# KEYS: relays hash; ARGV: id, JSON entry without exp, ttl ms, key ttl ms. Sets exp from Redis's clock.
_PUT_LUA = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local d = cjson.decode(ARGV[2])
d.exp = now + tonumber(ARGV[3])
redis.call('HSET', KEYS[1], ARGV[1], cjson.encode(d))
redis.call('PEXPIRE', KEYS[1], ARGV[4])
return 1
"""
# The relay hash of a version outlives its last heartbeat by this many TTLs, then Redis drops it.
KEY_TTLS = 30


def host_id() -> str:
    """This host and network namespace: peers sharing it can pass memfds (same kernel, same abstract sockets)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as fh:
            boot = fh.read().strip()
    except OSError:
        boot = socket.gethostname()
    try:
        netns = os.stat("/proc/self/ns/net").st_ino
    except OSError:
        netns = 0
    return f"{boot}:{netns}"


@dataclass(slots=True)
class RelayEntry:
    """What one peer says about itself for one version (see the module docstring)."""

    tcp: str
    unix: str
    host: str
    fanout: int
    parent: str = ""
    depth: int = 0
    have: int = 0
    done: int = 0
    lo: int = -1
    """A publishing rank's buckets are [lo, hi) (each rank holds its own); -1: every bucket of the version."""
    hi: int = -1


@dataclass(frozen=True, slots=True)
class Source:
    """A parent chosen by :meth:`Topology.pick`."""

    peer_id: str
    tcp: str
    unix: str
    host: str
    depth: int

    @property
    def tcp_address(self) -> tuple[str, int]:
        host, _, port = self.tcp.rpartition(":")
        return host, int(port)


class Topology:
    """The relay entries of this peer (one per version it holds or receives) and the parent picks, in Redis."""

    client: redis.Redis
    relays_key: Any
    peer_id: str
    ttl_ms: int
    entries: dict[int, RelayEntry]
    _dirty: set[int]
    """Versions whose entry changed here since it was last written (:meth:`note`; written by :meth:`flush`)."""
    _write_lock: threading.Lock
    """One write at a time (the pull thread and the heartbeat thread both write): an entry is serialised and sent
    under it, so the last write to reach Redis carries the newest state, never an older snapshot overtaking it."""
    _pick: Any
    _put: Any

    def __init__(self, client: redis.Redis, relays_key: Any, peer_id: str, ttl_s: float) -> None:
        self.client = client
        self.relays_key = relays_key  # version -> key (Names.weights_relays)
        self.peer_id = peer_id
        self.ttl_ms = max(1, int(ttl_s * 1000))
        self.entries = {}
        self._dirty = set()
        self._write_lock = threading.Lock()
        self._pick = client.register_script(_PICK_LUA)
        self._put = client.register_script(_PUT_LUA)

    def put(self, version: int, entry: RelayEntry) -> None:
        self.entries[version] = entry
        self._write(version, entry)

    def _write(self, version: int, entry: RelayEntry) -> None:
        with self._write_lock:
            self._dirty.discard(version)
            if self.entries.get(version) is not entry:
                return  # left (or replaced) meanwhile: a late write would bring the entry back
            body = json.dumps(asdict(entry))
            self._put(keys=[self.relays_key(version)], args=[self.peer_id, body, self.ttl_ms, self.ttl_ms * KEY_TTLS])

    def update(self, version: int, **fields: Any) -> None:
        entry = self.entries.get(version)
        if entry is None:
            return
        for k, v in fields.items():
            setattr(entry, k, v)
        self._write(version, entry)

    def note(self, version: int, **fields: Any) -> None:
        """Change this peer's entry here only (progress); :meth:`flush` or the next heartbeat writes it."""
        entry = self.entries.get(version)
        if entry is None:
            return
        for k, v in fields.items():
            setattr(entry, k, v)
        self._dirty.add(version)

    def flush(self) -> None:
        """Write the entries changed by :meth:`note` since they were last written."""
        for version in list(self._dirty):
            entry = self.entries.get(version)
            if entry is None:
                self._dirty.discard(version)
            else:
                self._write(version, entry)

    def heartbeat(self) -> None:
        for version, entry in list(self.entries.items()):
            self._write(version, entry)

    def pick(self, version: int, want: int, exclude: set[str]) -> Source | None:
        """Choose (and record) this peer's parent for ``version`` from bucket ``want`` on; None when no peer holding
        that bucket can take it now."""
        got = self._pick(keys=[self.relays_key(version)], args=[self.peer_id, want, *sorted(exclude)])
        if not got:
            return None
        peer_id, tcp, unix, host, depth = (x.decode() if isinstance(x, bytes) else str(x) for x in got)
        entry = self.entries.get(version)
        if entry is not None:
            entry.parent, entry.depth = peer_id, int(depth)
        return Source(peer_id, tcp, unix, host, int(depth))

    def remove_peer(self, version: int, peer_id: str) -> None:
        """Drop another peer's entry (its port refused us: the process is gone)."""
        self.client.hdel(self.relays_key(version), peer_id)

    def leave(self, version: int) -> None:
        with self._write_lock:
            self.entries.pop(version, None)
            self.client.hdel(self.relays_key(version), self.peer_id)
