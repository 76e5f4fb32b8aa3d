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
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import ClassVar

import msgpack
import redis

from async_rl.process.lifecycle import redact_url
from async_rl.run.names import Names
from async_rl.weights.checksums import CHECKSUMS, checksum_stream
from async_rl.weights.peer.config import parse_peer_url
from async_rl.weights.peer.server import (
    BUSY,
    MISSING,
    MODE_FD,
    MODE_TCP,
    OK,
    REPLY,
    BucketServer,
    ProtocolError,
    encode_request,
    recv_exact,
    tune,
)
from async_rl.weights.peer.store import Bucket, BucketStore, close_bucket, map_received_fd, new_bucket_memory
from async_rl.weights.peer.topology import RelayEntry, Source, Topology, host_id
from async_rl.weights.transport import (
    BucketCorrupt,
    BucketMissing,
    BucketTransport,
    TransportConfig,
    TransportError,
    register_transport,
)

log = logging.getLogger(__name__)

# Sources that may fail one pull (broken, stalled, corrupt, busy) before it gives up on the version.
MAX_FAILURES = 32
# Chunk handed to recv_into and the hasher: large enough to amortise calls, small enough to stay in cache.
RECV_CHUNK_BYTES = 1 << 20
# The receiving thread wakes once this many bytes wait in the socket (SO_RCVLOWAT), not at every segment: on a
# rate-limited link a recv returned 8 KB on average (10,000 wakeups, each a Python loop turn, per 80 MB).
RECV_LOWAT_BYTES = 512 << 10
# Progress (buckets held) reaches Redis at most this often, written by the heartbeat thread, never by the pull
# itself: a Redis round trip per bucket (two shaped links away) stalled the receiving thread and cost CPU.
PROGRESS_INTERVAL_S = 0.25
MAP_THREADS = max(1, min(4, os.cpu_count() or 1))
"""One host: buckets mapped and hashed side by side (the GIL is released while hashing; the page faults of
unpopulated mappings run in parallel, see :func:`~async_rl.weights.peer.store.map_received_fd`)."""
_map_threads: ThreadPoolExecutor | None = None


def _map_pool() -> ThreadPoolExecutor:
    global _map_threads
    if _map_threads is None:
        _map_threads = ThreadPoolExecutor(MAP_THREADS, thread_name_prefix="peer-map")
    return _map_threads


@dataclass(slots=True)
class _Pull:
    """One version being pulled: its manifest's bucket sizes and checksums, waiters, and how it ended."""

    version: int
    sizes: list[int] = field(default_factory=list)
    checksums: list[int] = field(default_factory=list)
    algorithm: str = ""
    error: BaseException | None = None
    done: bool = False
    waiters: dict[int, list[asyncio.Future]] = field(default_factory=dict)
    thread: threading.Thread | None = None
    sock: socket.socket | None = None
    """The connection to the current source (shut down by :meth:`PeerTransport.close`)."""
    failed_at: float = 0.0
    """When the last source failed (monotonic; 0: none pending): the next bucket held ends the re-attach."""


def _manifest_buckets(raw: bytes) -> tuple[str, list[int], list[int]]:
    """(checksum algorithm, bucket sizes, bucket checksums) of an encoded manifest, signed or not."""
    d = msgpack.unpackb(raw)
    if isinstance(d, dict) and "signed" in d:
        d = msgpack.unpackb(d["signed"])
    buckets = d["buckets"]
    return str(d["checksum"]), [int(b[1]) for b in buckets], [int(b[2]) for b in buckets]


def _advertise_host(bind_host: str, redis_url: str) -> str:
    """The address peers reach us at: the bind address, else the local address of the route to Redis."""
    if bind_host not in ("0.0.0.0", "", "::"):
        return bind_host
    from urllib.parse import urlparse

    target = urlparse(redis_url).hostname or "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((target, 9))  # UDP: no packet is sent, the kernel just picks the route
        return str(s.getsockname()[0])


class PeerTransport(BucketTransport):
    """Buckets served by whoever holds them: the publisher, then every generator that received them."""

    name: ClassVar[str] = "peer"
    durable: ClassVar[bool] = False  # the publisher's buckets live in its process (and in the peers that pulled them)
    puts_cross_link: ClassVar[bool] = False  # a put is a copy into this process's store; children stream it later
    names: Names
    peer_id: str
    timeout_s: float
    connect_timeout_s: float
    store: BucketStore
    server: BucketServer
    topology: Topology
    host: str
    tcp_address: str
    bytes_received: int
    num_reattaches: int
    """Attachments beyond the first of each pull (after a source failed, stalled or sent a corrupt bucket)."""
    num_corrupt: int
    """Buckets refused because their checksum did not match the manifest."""
    reattach_s: list[float]
    """Per re-attach: seconds from a source failing to the next bucket held from another."""
    _redis: redis.Redis
    _pulls: dict[int, _Pull]
    _lock: threading.Lock
    _stop: threading.Event
    _progress: threading.Event
    """Set when an entry changed locally (buckets held): the heartbeat thread writes it within PROGRESS_INTERVAL_S."""
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

    def _wake(self, pull: _Pull, loop: asyncio.AbstractEventLoop, index: int | None) -> None:
        """Resolve the waiters of bucket ``index`` (None: all of them, with the pull's error)."""
        with self._lock:
            if index is None:
                waiting = [(i, f) for i, fs in pull.waiters.items() for f in fs]
                pull.waiters.clear()
            else:
                waiting = [(index, f) for f in pull.waiters.pop(index, [])]
        for i, fut in waiting:
            bucket = self.store.get(pull.version, i) if pull.error is None else None
            with contextlib.suppress(RuntimeError):  # the reader's loop is gone: nobody waits any more
                loop.call_soon_threadsafe(_resolve, fut, bucket, pull.error)

    def _run_pull(self, pull: _Pull, loop: asyncio.AbstractEventLoop) -> None:
        try:
            self._pull(pull, loop)
        except BaseException as exc:  # noqa: BLE001 - handed to the awaiting reader, never lost
            if not isinstance(exc, TransportError):
                exc = TransportError(f"peer pull of weights version {pull.version} failed: {exc!r}")
            pull.error = exc
            self.store.abort(pull.version)
            with contextlib.suppress(redis.RedisError):
                self.topology.leave(pull.version)
        finally:
            pull.done = True
            self._wake(pull, loop, None)

    def _pull(self, pull: _Pull, loop: asyncio.AbstractEventLoop) -> None:
        v = pull.version
        raw = self._redis.get(self.names.weights_manifest(v))
        if raw is None:
            raise BucketMissing(f"weights version {v} has no manifest ({self.names.weights_manifest(v)})")
        if not isinstance(raw, bytes):
            raise TransportError("peer transport: the manifest came back decoded (a Redis client decoding responses?)")
        pull.algorithm, sizes, checksums = _manifest_buckets(raw)
        pull.checksums = checksums
        pull.sizes = sizes
        n = len(sizes)
        self.store.open_version(v)
        index = 0
        while index < n and self.store.get(v, index) is not None:
            index += 1
        self.topology.put(v, self._entry(done=0, have=index, depth=1 << 20))
        exclude: set[str] = set()
        tried: list[str] = []
        failures = 0
        deadline = time.monotonic() + self.timeout_s
        backoff_s = 0.05
        while index < n:
            if self._stop.is_set():
                raise TransportError(f"peer transport closed while pulling weights version {v}")
            source = self.topology.pick(v, index, exclude)
            if source is None:
                if time.monotonic() > deadline:
                    raise TransportError(f"no peer could serve bucket {index} of weights version {v} within "
                                         f"{self.timeout_s}s; tried {tried or 'none (no source registered)'}")  # fmt: skip
                exclude.clear()  # unreachable sources may be back; corrupt ones are refused again by checksum
                self._stop.wait(backoff_s)
                backoff_s = min(backoff_s * 2, 1.0)
                continue
            if failures > MAX_FAILURES:
                raise TransportError(f"weights version {v}: gave up at bucket {index} after {MAX_FAILURES} "
                                     f"failed sources; tried {tried}")  # fmt: skip
            tried.append(f"{source.peer_id}@{source.tcp}")
            log.debug("weights v%d: %s pulls from %s (depth %d) from bucket %d", v, self.peer_id, source.peer_id,
                      source.depth, index)  # fmt: skip
            start = index
            try:
                index = self._stream_from(source, pull, index, loop)
                exclude.add(source.peer_id)  # it holds nothing further (a rank's range ended); done otherwise
                deadline, backoff_s = time.monotonic() + self.timeout_s, 0.05
                continue
            except BucketCorrupt as exc:
                log.warning("weights v%d: %s from %s; fetching it from another source", v, exc, source.tcp)
                exclude.add(source.peer_id)
            except ConnectionRefusedError:
                log.warning("weights v%d: source %s at %s refuses connections: removed", v, source.peer_id,
                            source.tcp)  # fmt: skip
                self.topology.remove_peer(v, source.peer_id)
                exclude.add(source.peer_id)
            except (OSError, ProtocolError) as exc:
                log.warning("weights v%d: source %s at %s failed at bucket %d: %r; re-attaching", v,
                            source.peer_id, source.tcp, self._resume_at(v, n), exc)  # fmt: skip
                exclude.add(source.peer_id)
            failures += 1
            self.num_reattaches += 1
            if pull.failed_at == 0.0:
                pull.failed_at = time.monotonic()
            index = self._resume_at(v, n)
            if index > start:
                deadline = time.monotonic() + self.timeout_s
                backoff_s = 0.05
        self.store.mark_complete(v)
        self.topology.update(v, parent="", done=1, have=n)
        for old in self.store.retire_older(v):
            self.topology.leave(old)
            with self._lock:
                self._pulls.pop(old, None)

    def _resume_at(self, version: int, n: int) -> int:
        index = 0
        while index < n and self.store.get(version, index) is not None:
            index += 1
        return index

    def _stream_from(self, source: Source, pull: _Pull, start: int, loop: asyncio.AbstractEventLoop) -> int:
        """Take buckets ``start``.. from ``source`` until the stream ends; returns the next bucket wanted.

        Over TCP each bucket is hashed as it arrives. On one host the memfds come in order and are mapped and
        hashed on :data:`MAP_THREADS` threads side by side (hashing is what a one-host pull costs); buckets are
        held in order all the same."""
        v, n = pull.version, len(pull.sizes)
        same_host = source.host == self.host
        if same_host:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.settimeout(self.connect_timeout_s)
            try:
                sock.connect("\0" + source.unix)
            except OSError:
                sock.close()
                raise
        else:
            try:
                sock = socket.create_connection(source.tcp_address, self.connect_timeout_s)
            except TimeoutError as exc:
                raise TimeoutError(f"connecting to {source.tcp} timed out after {self.connect_timeout_s}s") from exc
        pull.sock = sock
        mapping: deque[Future[Bucket]] = deque()  # one host: buckets index, index + 1, ... being mapped and hashed
        with sock:
            tune(sock)
            sock.settimeout(self.timeout_s)
            sock.sendall(encode_request(self.names.prefix, v, start, n, MODE_FD if same_host else MODE_TCP))
            index = start
            end = n
            try:
                while index < end:
                    nxt = index + len(mapping)
                    if nxt < end and len(mapping) < MAP_THREADS:
                        nbytes, fds = self._reply(sock, pull, nxt, same_host)
                        if nbytes < 0:  # the end of what this source holds (a publishing rank's range)
                            if nxt == start:
                                raise ProtocolError("source does not hold it")
                            end = nxt
                            continue
                        if same_host:
                            mapping.append(_map_pool().submit(self._map_bucket, fds, nbytes, pull, nxt))
                            continue
                        bucket = self._receive_bucket(sock, nbytes, pull, nxt)
                    else:
                        bucket = mapping.popleft().result()
                    self._hold(pull, index, bucket, loop)
                    index += 1
            finally:
                for fut in mapping:  # abandoned (a failure before them): close what was mapped
                    with contextlib.suppress(BaseException):
                        close_bucket(fut.result())
            return index

    def _reply(self, sock: socket.socket, pull: _Pull, index: int, same_host: bool) -> tuple[int, list[int]]:
        """The source's reply for bucket ``index``: its size and memfds (one host); size -1 when the source holds no
        more buckets; ProtocolError when it is busy, BucketCorrupt when the reply is not for this bucket."""
        if same_host:
            data, fds, _, _ = socket.recv_fds(sock, REPLY.size, 1)
            if len(data) < REPLY.size:
                data += recv_exact(sock, REPLY.size - len(data))
        else:
            fds = []
            data = recv_exact(sock, REPLY.size)
        status, got_index, nbytes = REPLY.unpack(data)
        if status == OK and got_index == index and nbytes == pull.sizes[index]:
            return nbytes, fds
        for fd in fds:
            os.close(fd)
        if status == MISSING:
            return -1, []
        if status == BUSY:
            raise ProtocolError("source busy")
        raise BucketCorrupt(f"bucket {index}: source sent status {status}, bucket {got_index} of "
                            f"{nbytes} bytes (manifest: {pull.sizes[index]})")  # fmt: skip

    def _hold(self, pull: _Pull, index: int, bucket: Bucket, loop: asyncio.AbstractEventLoop) -> None:
        """A verified bucket: held (served to children from now on) and handed to the readers waiting for it."""
        self.store.add(pull.version, index, bucket)
        if pull.failed_at:
            self.reattach_s.append(time.monotonic() - pull.failed_at)
            pull.failed_at = 0.0
        self.topology.note(pull.version, have=index + 1)  # written by the heartbeat thread, off this path
        self._progress.set()
        self._wake(pull, loop, index)

    def _verify(self, got: int, pull: _Pull, index: int) -> None:
        if got != pull.checksums[index]:
            self.num_corrupt += 1
            raise BucketCorrupt(f"bucket {index}: {pull.algorithm} {got:#x} != manifest {pull.checksums[index]:#x}")

    def _receive_bucket(self, sock: socket.socket, nbytes: int, pull: _Pull, index: int) -> Bucket:
        """Bucket ``index`` straight off the socket into its memfd, each chunk hashed while it is still in cache (the
        only pass over the bytes in user space); the thread wakes per :data:`RECV_LOWAT_BYTES`, not per segment."""
        fd, view = new_bucket_memory(nbytes, f"v{pull.version}b{index}")
        try:
            hasher = checksum_stream(pull.algorithm)
            got = 0
            lowat = 1
            while got < nbytes:
                want = min(RECV_LOWAT_BYTES, nbytes - got)
                if want != lowat:  # a syscall only when it changes: at a bucket's start and its last chunk
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                    lowat = want
                r = sock.recv_into(view[got : min(nbytes, got + RECV_CHUNK_BYTES)])
                if r == 0:
                    raise ConnectionResetError(f"source closed the connection mid-bucket ({got} of {nbytes} bytes)")
                hasher.update(view[got : got + r])
                got += r
            self.bytes_received += nbytes
            if lowat != 1:  # the next reply header is 16 bytes: wake for it
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)
            self._verify(hasher.intdigest(), pull, index)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return Bucket(fd, view, nbytes, hasher.intdigest())

    def _map_bucket(self, fds: list[int], nbytes: int, pull: _Pull, index: int) -> Bucket:
        if nbytes and len(fds) != 1:
            raise ProtocolError(f"bucket {index}: expected one memfd, got {len(fds)}")
        fd = fds[0] if fds else -1
        try:
            view = map_received_fd(fd, nbytes)
            got = CHECKSUMS[pull.algorithm](view)
            self._verify(got, pull, index)
        except BaseException:
            if fd >= 0:
                os.close(fd)
            raise
        return Bucket(fd, view, nbytes, got)

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


def _resolve(fut: asyncio.Future, bucket: Bucket | None, error: BaseException | None) -> None:
    if fut.done():
        return
    if bucket is not None:
        fut.set_result(bucket)
    else:
        fut.set_exception(error or TransportError("peer pull ended without the bucket"))


def _from_config(url: str, cfg: TransportConfig, redis_url: str, names: Names) -> PeerTransport:
    return PeerTransport(url, redis_url, names, timeout_s=cfg.timeout_s)


register_transport("peer", _from_config)
