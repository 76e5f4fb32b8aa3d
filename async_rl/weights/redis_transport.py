"""``redis://`` and ``rediss://``: weight buckets as Redis string values, moved over raw RESP sockets.

:class:`RedisTransport` speaks just enough RESP on plain blocking sockets, run in worker threads,
to SET a bucket straight from a memoryview and GET it straight into a preallocated buffer
(``recv_into``): about 3x the throughput of redis-py's GET on large values here, because nothing
is copied or reparsed in Python (see ``docs/weights.md``). Works across machines; the default
transport (the run's own Redis).
"""

from __future__ import annotations

import asyncio
import queue
import socket
import ssl
import time
from typing import Any, ClassVar
from urllib.parse import parse_qs, unquote, urlparse

from redis.exceptions import ConnectionError as RedisConnectionError

from async_rl.process.lifecycle import redact_url
from async_rl.run.names import Names
from async_rl.weights.checksums import checksum_stream
from async_rl.weights.transport import (
    MAX_BUCKET_BYTES,
    BucketCorrupt,
    BucketMissing,
    BucketTransport,
    TransportConfig,
    TransportError,
    register_transport,
)

# Kernel socket buffers large enough to keep the loopback pipe full between recv_into calls.
SOCKET_BUFFER_BYTES = 4 << 20
# A bucket larger than this (one huge tensor, e.g. the LM head of a big-vocabulary model) is stored by the
# Redis transport as consecutive values of this size, read back into one buffer.
PART_BYTES = 256 << 20
# Parts per bucket: 16 GiB buckets at most, and a bounded list of keys to delete per bucket.
MAX_PARTS = 64
RECONNECTS = 6
"""Fresh connections tried after a lost one (backoff 0.25, 0.5, 1, 2, 4, 4 s: ~12 s, as ``REDIS_RETRIES``)."""
_RECONNECT_CAP_S = 4.0


class TransportClosed(TransportError):
    """The connection was lost (closed by the server, or it is loading its data after a restart): worth a retry."""


class RedisLost(TransportError, RedisConnectionError):
    """Redis stayed unreachable through every reconnect: a lost server (``describe_failure`` names it), not a bug."""



def _command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


def _tls_context(query: str) -> ssl.SSLContext:
    """The TLS context of a ``rediss://`` URL, from the query parameters redis-py reads too (``ssl_ca_certs``,
    ``ssl_certfile``, ``ssl_keyfile``, ``ssl_cert_reqs=none``); the system's CAs (and ``$SSL_CERT_FILE``) otherwise."""
    q = {k: v[-1] for k, v in parse_qs(query).items()}
    ctx = ssl.create_default_context(cafile=q.get("ssl_ca_certs"))
    if q.get("ssl_certfile"):
        ctx.load_cert_chain(q["ssl_certfile"], q.get("ssl_keyfile"))
    if q.get("ssl_cert_reqs", "").lower() in ("none", "cert_none"):
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx


class RespConnection:
    """One blocking RESP2 connection: SET from a buffer, GET into a buffer, DEL. Not thread-safe."""

    sock: socket.socket
    _pending: bytearray

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        parsed = urlparse(url)
        if parsed.scheme not in ("redis", "rediss"):
            raise ValueError(f"transport: only redis:// and rediss:// URLs are supported by the bucket transport, "
                             f"got {redact_url(url)!r}")  # fmt: skip
        sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout_s)
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
        if parsed.scheme == "rediss":
            sock = _tls_context(parsed.query).wrap_socket(sock, server_hostname=parsed.hostname)
        self.sock = sock
        self._pending = bytearray()
        if parsed.password:
            user = unquote(parsed.username) if parsed.username else None
            args = [user.encode(), unquote(parsed.password).encode()] if user else [unquote(parsed.password).encode()]
            self._simple(_command(b"AUTH", *args))
        db = parsed.path.lstrip("/")
        if db and db != "0":
            self._simple(_command(b"SELECT", db.encode()))

    def close(self) -> None:
        self.sock.close()

    def _line(self) -> bytes:
        while True:
            end = self._pending.find(b"\r\n")
            if end >= 0:
                line = bytes(self._pending[:end])
                del self._pending[: end + 2]
                return line
            chunk = self.sock.recv(65536)
            if not chunk:
                raise TransportClosed("Redis closed the connection")
            self._pending += chunk

    def _reply_line(self) -> bytes:
        line = self._line()
        if line.startswith(b"-LOADING"):  # a restarted server reading its append-only file back: not yet
            raise TransportClosed(f"Redis is loading: {line[1:].decode(errors='replace')}")
        if line.startswith(b"-"):
            raise TransportError(f"Redis error: {line[1:].decode(errors='replace')}")
        return line

    def _simple(self, cmd: bytes) -> bytes:
        self.sock.sendall(cmd)
        return self._reply_line()

    def set(self, key: str, data: memoryview) -> None:
        k = key.encode()
        self.sock.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, data.nbytes))
        self.sock.sendall(data)
        self.sock.sendall(b"\r\n")
        line = self._reply_line()
        if line != b"+OK":
            raise TransportError(f"unexpected reply to SET {key}: {line!r}")

    def get(self, key: str, hasher: Any = None) -> bytearray | None:
        """The value of ``key`` read straight into a new buffer, or None when absent."""
        n = self._get_header(key)
        if n is None:
            return None
        buf = bytearray(n)
        self._read_value(memoryview(buf), hasher)
        return buf

    def get_into(self, key: str, out: memoryview, hasher: Any = None) -> bool:
        """Read the value of ``key`` into ``out`` (exactly its size, else :class:`BucketCorrupt`); False if absent.

        With ``hasher`` (``update(bytes)``), every chunk is hashed as it arrives, while it is still in cache.
        """
        n = self._get_header(key)
        if n is None:
            return False
        if n != out.nbytes:
            raise BucketCorrupt(f"{key} holds {n} bytes, expected {out.nbytes}")  # the connection is dropped
        self._read_value(out, hasher)
        return True

    def _get_header(self, key: str) -> int | None:
        self.sock.sendall(_command(b"GET", key.encode()))
        line = self._reply_line()
        if not line.startswith(b"$"):
            raise TransportError(f"unexpected reply to GET {key}: {line[:40]!r}")
        n = int(line[1:])
        return None if n < 0 else n

    def _read_value(self, view: memoryview, hasher: Any) -> None:
        n = view.nbytes
        got = min(len(self._pending), n)
        view[:got] = self._pending[:got]
        del self._pending[:got]
        if hasher is not None and got:
            hasher.update(view[:got])
        while got < n:
            r = self.sock.recv_into(view[got:])
            if r == 0:
                raise TransportClosed("Redis closed the connection mid-value")
            if hasher is not None:
                hasher.update(view[got : got + r])
            got += r
        while len(self._pending) < 2:
            chunk = self.sock.recv(2 - len(self._pending))
            if not chunk:
                raise TransportClosed("Redis closed the connection mid-value")
            self._pending += chunk
        del self._pending[:2]

    def delete(self, keys: list[str]) -> int:
        if not keys:
            return 0
        line = self._simple(_command(b"DEL", *(k.encode() for k in keys)))
        return int(line[1:])


class RedisTransport(BucketTransport):
    """Buckets as Redis string values at :meth:`Names.weights_bucket`, moved by a pool of raw connections."""

    name: ClassVar[str] = "redis"
    url: str
    names: Names
    timeout_s: float
    part_bytes: int
    _pool: queue.LifoQueue[RespConnection | None]

    def __init__(
        self, url: str, names: Names, *, connections: int = 2, timeout_s: float = 60.0, part_bytes: int = PART_BYTES
    ) -> None:
        if not 0 < part_bytes <= MAX_BUCKET_BYTES:
            raise ValueError(f"transport part_bytes must be in (0, {MAX_BUCKET_BYTES}]")
        self.url = url
        self.names = names
        self.timeout_s = timeout_s
        self.part_bytes = part_bytes
        self._pool = queue.LifoQueue()
        for _ in range(connections):
            self._pool.put(None)  # connected lazily, in the worker thread

    def _run(self, fn):  # type: ignore[no-untyped-def]
        """Run ``fn(connection)`` in the calling (worker) thread; a connection that failed is replaced.

        A lost connection (the server restarted: a pooled socket is broken, a new one refused while it loads its
        append-only file) is retried on a fresh one with capped backoff, :data:`RECONNECTS` times (~12 s, as the
        run's other Redis clients: ``async_rl.servers.reach``): every call here is idempotent (SET, GET, DEL)."""
        for attempt in range(RECONNECTS + 1):
            conn = self._pool.get()
            ok = False
            try:
                if conn is None:
                    conn = RespConnection(self.url, self.timeout_s)
                result = fn(conn)
                ok = True
                return result
            except (ConnectionError, TransportClosed) as exc:
                if attempt == RECONNECTS:
                    raise RedisLost(f"Redis bucket transfer failed at {redact_url(self.url)} after "
                                         f"{RECONNECTS} reconnects: {exc!r}") from exc  # fmt: skip
            except OSError as exc:
                raise TransportError(f"Redis bucket transfer failed at {redact_url(self.url)}: {exc!r}") from exc
            finally:
                if not ok and conn is not None:
                    conn.close()
                self._pool.put(conn if ok else None)
            time.sleep(min(_RECONNECT_CAP_S, 0.25 * 2**attempt))
        raise AssertionError("unreachable")

    def _part_keys(self, version: int, index: int, nbytes: int) -> list[tuple[str, int, int]]:
        """(key, start, end) of each Redis value holding the bucket."""
        size = self.part_bytes
        num_parts = max(1, -(-nbytes // size))
        if num_parts > MAX_PARTS:
            raise ValueError(f"bucket of {nbytes} bytes exceeds the Redis transport's {MAX_PARTS * size} bytes")
        out = []
        for p in range(num_parts):
            key = (
                self.names.weights_bucket(version, index)
                if p == 0
                else self.names.weights_bucket_part(version, index, p)
            )
            out.append((key, p * size, min((p + 1) * size, nbytes)))
        return out

    async def put(self, version: int, index: int, data: memoryview) -> None:
        parts = self._part_keys(version, index, data.nbytes)

        def put_all(conn: RespConnection) -> None:
            for key, start, end in parts:
                conn.set(key, data[start:end])

        await asyncio.to_thread(self._run, put_all)

    async def get(self, version: int, index: int, nbytes: int | None = None) -> memoryview:
        return (await self._get(version, index, nbytes, None))[0]

    async def get_checked(
        self, version: int, index: int, checksum: str, nbytes: int | None = None
    ) -> tuple[memoryview, int]:
        hasher = checksum_stream(checksum)
        buf, _ = await self._get(version, index, nbytes, hasher)
        return buf, hasher.intdigest()

    async def _get(self, version: int, index: int, nbytes: int | None, hasher: Any) -> tuple[memoryview, Any]:
        key = self.names.weights_bucket(version, index)
        if nbytes is None:  # size unknown: a one-value bucket
            buf = await asyncio.to_thread(self._run, lambda c: c.get(key, hasher))
            if buf is None:
                raise BucketMissing(f"bucket {index} of weights version {version} is missing ({key})")
            return memoryview(buf), hasher
        out = memoryview(bytearray(nbytes))
        parts = self._part_keys(version, index, nbytes)

        def get_all(conn: RespConnection) -> str | None:
            for part_key, start, end in parts:
                if not conn.get_into(part_key, out[start:end], hasher):
                    return part_key
            return None

        missing = await asyncio.to_thread(self._run, get_all)
        if missing is not None:
            raise BucketMissing(f"bucket {index} of weights version {version} is missing ({missing})")
        return out, hasher

    async def delete(self, version: int, num_buckets: int) -> None:
        keys = []
        for i in range(num_buckets):
            keys.append(self.names.weights_bucket(version, i))
            keys += [self.names.weights_bucket_part(version, i, p) for p in range(1, MAX_PARTS)]
        await asyncio.to_thread(self._run, lambda c: c.delete(keys))

    async def close(self) -> None:
        while not self._pool.empty():
            conn = self._pool.get_nowait()
            if conn is not None:
                conn.close()




def _from_config(url: str, cfg: TransportConfig, redis_url: str, names: Names) -> RedisTransport:
    return RedisTransport(url, names, connections=cfg.connections, timeout_s=cfg.timeout_s)


register_transport("redis", _from_config)
register_transport("rediss", _from_config)
