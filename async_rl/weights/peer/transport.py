"""``peer://``: weight buckets pulled from peers that hold them, each peer relaying what it holds.

- **Sources.** The publisher's :meth:`PeerTransport.put` copies each bucket into a memfd and serves it
  (at most ``fanout`` children over TCP). A generator's transport pulls a version in a background thread
  (one *pull* per version, started by the reader's first ``get``), holds every bucket it verified and serves
  it in turn, while it is still receiving the rest (``fanout`` children of its own; 0: pull only).
- **Verification.** Each bucket is hashed as it arrives and compared with the manifest's checksum
  (``weights:<v>:manifest``, read here without the HMAC check: the reader checks the signed manifest
  again); a bucket that does not match is never held or served and is fetched again from another source.
- **Failure.** A source that refuses the connection, breaks it or stalls is left for another one, and the
  pull resumes at the bucket it was on; a source whose port refuses is removed from the tree at once.
  After ``MAX_FAILURES`` failed sources, or ``timeout_s`` without any source, the pull fails with the
  addresses it tried, and the reader's ``get`` raises :class:`TransportError`.
- **One host.** A source with the same host id (boot id + network namespace) hands over the memfd
  itself through an abstract Unix socket; the child maps it (no copy) and hashes it.

The reader, publisher and generator see only :class:`~async_rl.weights.transport.BucketTransport`; relays pass on
whatever buckets a version's manifest lists.
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
from typing import ClassVar

import redis

from async_rl.process.lifecycle import redact_url
from async_rl.run.names import Names
from async_rl.weights.checksums import CHECKSUMS
from async_rl.weights.peer.config import parse_peer_url
from async_rl.weights.peer.pull import PeerPuller, _Pull
from async_rl.weights.peer.server import (
    BucketServer,
)
from async_rl.weights.peer.store import Bucket, BucketStore, new_bucket_memory
from async_rl.weights.peer.topology import RelayEntry, Topology, host_id
from async_rl.weights.transport import (
    BucketTransport,
    TransportConfig,
    TransportError,
    register_transport,
)

log = logging.getLogger(__name__)

# Progress (buckets held) reaches Redis at most this often, written by the heartbeat thread, never by the pull
# itself: a Redis round trip per bucket (two shaped links away) stalled the receiving thread and cost CPU.
PROGRESS_INTERVAL_S = 0.25


def _advertise_host(bind_host: str, redis_url: str) -> str:
    """The address peers reach us at: the bind address, else the local address of the route to Redis."""
    if bind_host not in ("0.0.0.0", "", "::"):
        return bind_host
    from urllib.parse import urlparse

    target = urlparse(redis_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))  # UDP: no packet is sent, the kernel just picks the route
        return str(s.getsockname()[0])


class PeerTransport(PeerPuller, BucketTransport):
    """Buckets served by whoever holds them: the publisher, then every generator that received them."""

    name: ClassVar[str] = "peer"
    durable: ClassVar[bool] = False  # the publisher's buckets live in its process (and in the peers that pulled them)
    puts_cross_link: ClassVar[bool] = False  # a put is a copy into this process's store; children stream it later
    server: BucketServer
    tcp_address: str
    _beat: threading.Thread

    def __init__(self, url: str, redis_url: str, names: Names, *, timeout_s: float = 60.0) -> None:
        cfg = parse_peer_url(url)
        self.names = names
        self.peer_id = f"{socket.gethostname()}-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.timeout_s = timeout_s
        self.connect_timeout_s = cfg.connect_timeout_s
        self.bytes_received = self.num_reattaches = self.num_corrupt = 0
        self.reattach_s = []
        self._pulls = {}
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._progress = threading.Event()
        self.store = BucketStore(cfg.keep)
        # same_host=tcp: a host id no other peer shares, so every source is reached over TCP.
        self.host = host_id() if cfg.same_host == "fd" else f"{host_id()}:{uuid.uuid4().hex}"
        self._redis = redis.Redis.from_url(redis_url, socket_connect_timeout=cfg.connect_timeout_s)
        try:
            advertise = cfg.advertise or _advertise_host(cfg.bind_host, redis_url)
            self.server = BucketServer(
                self.store, names.prefix, bind_host=cfg.bind_host, port=cfg.port, fanout=cfg.fanout,
                stall_timeout_s=timeout_s, unix_name=f"async-rl-peer-{names.prefix}-{self.peer_id}",
            )  # fmt: skip
        except OSError as exc:
            self._redis.close()
            raise TransportError(f"peer transport: cannot serve on {redact_url(url)!r}: {exc}") from exc
        self.tcp_address = f"{advertise}:{self.server.tcp_address[1]}"
        self.topology = Topology(self._redis, names.weights_relays, self.peer_id, cfg.ttl_s)
        self._beat = threading.Thread(target=self._heartbeat, args=(cfg.ttl_s / 3,), name="peer-heartbeat", daemon=True)
        self._beat.start()
        log.info("peer transport %s serving on %s (fan-out %d)", self.peer_id, self.tcp_address, cfg.fanout)

    @property
    def bytes_sent(self) -> int:
        return self.server.bytes_sent

    def link_bytes_per_s(self) -> float | None:
        return self.server.send_rate

    def _entry(self, *, done: int, have: int, depth: int = 0, lo: int = -1, hi: int = -1) -> RelayEntry:
        return RelayEntry(tcp=self.tcp_address, unix=self.server.unix_name, host=self.host,
                          fanout=self.server.fanout, depth=depth, have=have, done=done, lo=lo, hi=hi)  # fmt: skip

    def _heartbeat(self, every_s: float) -> None:
        """Renew every entry each ``every_s``; between beats, write the entries whose progress changed, at most
        every :data:`PROGRESS_INTERVAL_S` (one write covers all the buckets held meanwhile)."""
        beat_at = time.monotonic() + every_s
        while True:
            self._progress.wait(max(0.0, beat_at - time.monotonic()))
            if self._stop.is_set():
                return
            self._progress.clear()
            try:
                if time.monotonic() >= beat_at:
                    self.topology.heartbeat()
                    beat_at = time.monotonic() + every_s
                else:
                    self.topology.flush()
            except redis.RedisError as exc:  # retried at the next beat; entries expire if Redis stays away
                log.warning("peer heartbeat to Redis failed: %r", exc)
            if self._stop.wait(PROGRESS_INTERVAL_S):
                return

    # ---- source side (the publisher) ---------------------------------------------------------

    async def put(self, version: int, index: int, data: memoryview) -> None:
        def copy_in() -> None:
            fd, view = new_bucket_memory(data.nbytes, f"v{version}b{index}")
            view[:] = data  # the publisher reuses its buffer: hold our own copy
            checksum = 0  # a source's buckets are its own; children verify against the manifest
            first = not self.store.has_version(version)
            self.store.add(version, index, Bucket(fd, view, data.nbytes, checksum))
            # Readers come only after the manifest, i.e. after every put: a bucket this rank lacks is another's.
            self.store.mark_complete(version)
            entry = self.topology.entries.get(version)
            if first or entry is None:  # held until the publisher's prune deletes it (a delta's base may stay long)
                self.topology.put(version, self._entry(done=1, have=1, lo=index, hi=index + 1))
            else:  # a rank writes consecutive buckets (WeightPublisher.write_rank's first_bucket on)
                self.topology.update(version, have=entry.have + 1, lo=min(entry.lo, index), hi=max(entry.hi, index + 1))

        await asyncio.to_thread(copy_in)

    async def delete(self, version: int, num_buckets: int) -> None:
        def drop() -> None:
            self.store.drop(version)
            self.topology.entries.pop(version, None)
            self._redis.delete(self.names.weights_relays(version))

        await asyncio.to_thread(drop)
    # ---- child side (generators) -------------------------------------------------------------

    async def get(self, version: int, index: int, nbytes: int | None = None) -> memoryview:
        return (await self._bucket(version, index)).view

    async def get_checked(
        self, version: int, index: int, checksum: str, nbytes: int | None = None
    ) -> tuple[memoryview, int]:
        bucket = await self._bucket(version, index)
        pull = self._pulls.get(version)
        if pull is not None and pull.algorithm == checksum:
            return bucket.view, bucket.checksum  # hashed while it arrived and equal to the manifest's
        return bucket.view, await asyncio.to_thread(CHECKSUMS[checksum], bucket.view)

    async def _bucket(self, version: int, index: int) -> Bucket:
        held = self.store.get(version, index)
        if held is not None:  # held buckets are complete and verified (or this process published them)
            return held
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        with self._lock:
            pull = self._pulls.get(version)
            if pull is None or (pull.error is not None and pull.done):
                pull = self._pulls[version] = _Pull(version)
                pull.thread = threading.Thread(
                    target=self._run_pull, args=(pull, loop), name=f"peer-pull-v{version}", daemon=True
                )
                pull.thread.start()
            held = self.store.get(version, index)
            if held is not None:
                return held
            if pull.error is not None:
                raise pull.error
            pull.waiters.setdefault(index, []).append(fut)
        return await fut

    async def close(self) -> None:
        self._stop.set()
        self._progress.set()

        def shut() -> None:
            for version in list(self.topology.entries):
                with contextlib.suppress(redis.RedisError):
                    self.topology.leave(version)
            self.server.close()
            for pull in list(self._pulls.values()):
                if pull.thread is not None:
                    pull.thread.join(timeout=5)
            self._beat.join(timeout=5)
            self.store.close()
            self._redis.close()

        for pull in list(self._pulls.values()):
            if pull.sock is not None:
                with contextlib.suppress(OSError):
                    pull.sock.shutdown(socket.SHUT_RDWR)
        await asyncio.to_thread(shut)


def _from_config(url: str, cfg: TransportConfig, redis_url: str, names: Names) -> PeerTransport:
    return PeerTransport(url, redis_url, names, timeout_s=cfg.timeout_s)


register_transport("peer", _from_config)
