"""The bucket server of one peer, and the wire protocol its children speak.

Protocol (big-endian), one request per connection, then the buckets in order:

- request: ``REQUEST`` = magic ``ARPB``, mode (0: bytes over this socket, 1: memfds over a Unix socket),
  prefix length, version, first and end bucket index; then the run prefix (UTF-8);
- per bucket: ``REPLY`` = status, bucket index, size; with ``OK`` the bucket's bytes follow (mode 0) or its
  memfd rides along the reply as ``SCM_RIGHTS`` (mode 1). ``MISSING`` (the version is not here, or not all
  of it will come, or it did not come within the stall time) and ``BUSY`` (this peer already feeds
  ``fanout`` children over TCP) end the stream: the child picks another source.

A server streams only held buckets (complete and checksum-verified, :mod:`.store`), and waits for the next
one while it is still arriving: that is what pipelines a chain, bucket by bucket. It runs in threads with
blocking sockets (``sendfile`` from the memfd: no copy through user space, the GIL released); see ``docs/weights.md``
for why not asyncio streams (0.3 vs 2.0-2.8 GB/s on loopback here).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import struct
import threading
import time

from async_rl.weights.peer.store import BucketStore

log = logging.getLogger(__name__)

MAGIC = b"ARPB"
REQUEST = struct.Struct("!4sBxHqII")
REPLY = struct.Struct("!BxxxIQ")
OK, MISSING, BUSY = 0, 1, 2
MODE_TCP, MODE_FD = 0, 1
# Kernel socket buffers: large enough to keep a 10 Gbit/s, sub-millisecond link full between sends.
SOCKET_BUFFER_BYTES = 4 << 20
RATE_MIN_BYTES = 4 * SOCKET_BUFFER_BYTES
"""A stream this long or longer measures the link (:attr:`BucketServer.send_rate`)."""
# Longest request prefix accepted (Names allows 64 characters).
MAX_PREFIX_BYTES = 256


class ProtocolError(OSError):
    """A peer sent something that is not this protocol (wrong magic, another run, a short read)."""


def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:])
        if r == 0:
            raise ConnectionResetError(f"peer closed the connection after {got} of {n} bytes")
        got += r
    return bytes(buf)


def encode_request(prefix: str, version: int, start: int, end: int, mode: int) -> bytes:
    p = prefix.encode()
    return REQUEST.pack(MAGIC, mode, len(p), version, start, end) + p


def tune(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)


class BucketServer:
    """Serves the buckets of :class:`BucketStore` over TCP (bounded fan-out) and a Unix socket (same host)."""

    store: BucketStore
    prefix: str
    fanout: int
    stall_timeout_s: float
    tcp_address: tuple[str, int]
    unix_name: str
    bytes_sent: int
    send_rate: float | None
    """Bytes/s of the newest buckets streamed over TCP (a moving average; None before the first): the link's rate as
    the publisher sees it, which decides whether a delta pays (:mod:`async_rl.weights.gpu.encoder`)."""
    num_streams: int
    """Children streamed to over TCP right now."""
    _lock: threading.Lock
    _stop: threading.Event
    _listeners: list[socket.socket]
    _conns: set[socket.socket]
    _threads: list[threading.Thread]

    def __init__(
        self, store: BucketStore, prefix: str, *, bind_host: str, port: int, fanout: int, stall_timeout_s: float,
        unix_name: str,
    ) -> None:  # fmt: skip
        self.store = store
        self.prefix = prefix
        self.fanout = fanout
        self.stall_timeout_s = stall_timeout_s
        self.bytes_sent = 0
        self.send_rate = None
        self.num_streams = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._conns = set()
        self._threads = []
        tcp = socket.create_server((bind_host, port), backlog=128)
        self.tcp_address = (bind_host, tcp.getsockname()[1])
        unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        unix.bind("\0" + unix_name)  # abstract: per network namespace, gone with the process
        unix.listen(128)
        self.unix_name = unix_name
        self._listeners = [tcp, unix]
        for ls, mode in ((tcp, MODE_TCP), (unix, MODE_FD)):
            t = threading.Thread(target=self._accept, args=(ls, mode), name=f"peer-accept-{mode}", daemon=True)
            t.start()
            self._threads.append(t)

    def _accept(self, ls: socket.socket, mode: int) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = ls.accept()
            except OSError:
                return  # closed
            tune(conn)
            with self._lock:
                self._conns.add(conn)
            threading.Thread(target=self._serve, args=(conn, mode), name="peer-serve", daemon=True).start()

    def _serve(self, conn: socket.socket, listener_mode: int) -> None:
        counted = False
        try:
            conn.settimeout(self.stall_timeout_s)
            magic, mode, plen, version, start, end = REQUEST.unpack(recv_exact(conn, REQUEST.size))
            if magic != MAGIC or mode != listener_mode or plen > MAX_PREFIX_BYTES:
                raise ProtocolError(f"bad request (magic {magic!r}, mode {mode})")
            prefix = recv_exact(conn, plen).decode(errors="replace")
            if prefix != self.prefix:
                raise ProtocolError(f"request for run {prefix!r}, this peer serves {self.prefix!r}")
            if mode == MODE_TCP:
                with self._lock:
                    if self.num_streams >= self.fanout:
                        conn.sendall(REPLY.pack(BUSY, start, 0))
                        return
                    self.num_streams += 1
                    counted = True
            streamed, stream_start = 0, time.perf_counter()
            for index in range(start, end):
                got = self.store.wait(version, index, self.stall_timeout_s, self._stop, dup_fd=True)
                if got is None:
                    conn.sendall(REPLY.pack(MISSING, index, 0))
                    return
                bucket, fd = got
                try:
                    header = REPLY.pack(OK, index, bucket.nbytes)
                    if mode == MODE_FD:
                        if fd >= 0:
                            socket.send_fds(conn, [header], [fd])
                        else:
                            conn.sendall(header)
                        continue
                    # MSG_MORE: the header leaves in the bucket's first segment, not in a packet of its own.
                    conn.sendall(header, socket.MSG_MORE if bucket.nbytes else 0)
                    if fd >= 0:  # sendfile: the kernel sends the memfd's pages, no copy through user space
                        with open(fd, "rb", closefd=False) as fh:
                            conn.sendfile(fh, 0, bucket.nbytes)
                    else:
                        conn.sendall(bucket.view)
                    streamed += bucket.nbytes
                finally:
                    if fd >= 0:
                        os.close(fd)
                with self._lock:
                    self.bytes_sent += bucket.nbytes
            if streamed >= RATE_MIN_BYTES:  # (the last bytes may still sit in the send buffer: a few MB in many)
                rate = streamed / max(time.perf_counter() - stream_start, 1e-6)
                self.send_rate = rate if self.send_rate is None else (rate + self.send_rate) / 2
        except OSError as exc:  # the child went away or spoke nonsense: its problem, not ours
            log.debug("peer stream ended: %r", exc)
        finally:
            with self._lock:
                if counted:
                    self.num_streams -= 1
                self._conns.discard(conn)
            conn.close()

    def close(self) -> None:
        self._stop.set()
        for ls in self._listeners:
            with contextlib.suppress(OSError):
                ls.shutdown(socket.SHUT_RDWR)
            ls.close()
        with self._lock:
            conns = list(self._conns)
        for c in conns:
            with contextlib.suppress(OSError):
                c.shutdown(socket.SHUT_RDWR)
        for t in self._threads:
            t.join(timeout=2)
