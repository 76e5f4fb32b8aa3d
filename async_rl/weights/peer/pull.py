"""The child side of ``peer://``: one version pulled from the peers that hold it, bucket by bucket, verified.

:class:`PeerPuller` is the half of :class:`~async_rl.weights.peer.transport.PeerTransport` that runs in a pull's
background thread: pick a source in the relay tree, stream buckets from it (over TCP, hashed as they arrive; on one
host as memfds, mapped and hashed side by side), hold each verified bucket and wake the readers waiting for it,
and on a failure re-attach to another source at the bucket it was on (the guarantees are in the transport's
module docstring).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import msgpack
import redis

from async_rl.run.names import Names
from async_rl.weights.checksums import CHECKSUMS, checksum_stream
from async_rl.weights.peer.server import (
    BUSY,
    MISSING,
    MODE_FD,
    MODE_TCP,
    OK,
    REPLY,
    ProtocolError,
    encode_request,
    recv_exact,
    tune,
)
from async_rl.weights.peer.store import Bucket, BucketStore, close_bucket, map_received_fd, new_bucket_memory
from async_rl.weights.peer.topology import RelayEntry, Source, Topology
from async_rl.weights.transport import BucketCorrupt, BucketMissing, TransportError

log = logging.getLogger("async_rl.weights.peer.transport")  # the transport's log, as before the split

# Sources that may fail one pull (broken, stalled, corrupt, busy) before it gives up on the version.
MAX_FAILURES = 32
# Chunk handed to recv_into and the hasher: large enough to amortise calls, small enough to stay in cache.
RECV_CHUNK_BYTES = 1 << 20
# The receiving thread wakes once this many bytes wait in the socket (SO_RCVLOWAT), not at every segment: on a
# rate-limited link a recv returned 8 KB on average (10,000 wakeups, each a Python loop turn, per 80 MB).
RECV_LOWAT_BYTES = 512 << 10
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



class PeerPuller:
    """Pulling versions from peers (mixed into :class:`~async_rl.weights.peer.transport.PeerTransport`, which sets
    these attributes and serves what is held)."""

    names: Names
    peer_id: str
    timeout_s: float
    connect_timeout_s: float
    store: BucketStore
    topology: Topology
    host: str
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

    def _entry(self, *, done: int, have: int, depth: int = 0, lo: int = -1, hi: int = -1) -> RelayEntry:
        raise NotImplementedError

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


def _resolve(fut: asyncio.Future, bucket: Bucket | None, error: BaseException | None) -> None:
    if fut.done():
        return
    if bucket is not None:
        fut.set_result(bucket)
    else:
        fut.set_exception(error or TransportError("peer pull ended without the bucket"))
