"""How the bytes of weight buckets move: one interface, a Redis default, shared memory on one host.

The version, the manifest, the leases and the announcement always go through Redis and NATS
(:mod:`async_rl.weights`); only the bucket bytes go through a :class:`BucketTransport`, so a
faster transport (direct TCP pull from the learner's ranks, NCCL) plugs in without touching the
publisher, the reader or the generator.

:class:`RedisTransport` speaks just enough RESP on plain blocking sockets, run in worker threads,
to SET a bucket straight from a memoryview and GET it straight into a preallocated buffer
(``recv_into``): about 3x the throughput of redis-py's GET on large values here, because nothing
is copied or reparsed in Python (see ``docs/weights.md``). :class:`SharedMemoryTransport` writes
each bucket to a file under ``/dev/shm`` and readers map it: zero copies after the publisher's.
"""

from __future__ import annotations

import abc
import asyncio
import contextlib
import mmap
import os
import queue
import shutil
import socket
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar
from urllib.parse import parse_qs, unquote, urlparse

from async_rl.checksums import CHECKSUMS, checksum_stream
from async_rl.lifecycle import redact_url
from async_rl.names import Names

# Kernel socket buffers large enough to keep the loopback pipe full between recv_into calls.
SOCKET_BUFFER_BYTES = 4 << 20
# Target bucket sizes are capped at Redis's default proto-max-bulk-len (512 MiB), its largest value.
MAX_BUCKET_BYTES = 512 << 20
# A bucket larger than this (one huge tensor, e.g. the LM head of a big-vocabulary model) is stored by the
# Redis transport as consecutive values of this size, read back into one buffer.
PART_BYTES = 256 << 20
# Parts per bucket: 16 GiB buckets at most, and a bounded list of keys to delete per bucket.
MAX_PARTS = 64
SCHEMES = ("redis", "rediss", "shm", "peer")
"""URL schemes of the bucket transports: each names one explicitly (see :func:`make_transport`)."""


class TransportError(RuntimeError):
    """The transport failed to move a bucket (connection lost, server error)."""


class BucketMissing(TransportError):
    """A bucket a manifest names is not there (pruned, or never written)."""


class BucketCorrupt(TransportError):
    """A bucket's stored size is not the size the manifest gives."""


@dataclass(kw_only=True, slots=True)
class TransportConfig:
    """Which transport moves weight bucket bytes."""

    url: str = ""
    """Where bucket bytes go, chosen by the URL's scheme (:data:`SCHEMES`): '' is the run's own Redis;
    ``redis://host:port/db`` another Redis (works across machines; ``rediss://`` over TLS, ``user:password@``
    for an ACL user, ``?ssl_ca_certs=ca.pem`` for a private CA); ``shm:///dev/shm`` files under that tmpfs
    directory (one host); ``peer://0.0.0.0:0?fanout=2`` buckets served over TCP by whoever holds them, the
    publisher and then the generators themselves (:mod:`async_rl.peer`; many hosts). Any other scheme is
    refused."""
    connections: int = 2
    """Redis connections (and worker threads) used for concurrent bucket reads/writes."""
    timeout_s: float = 60.0
    """Socket timeout for one bucket transfer."""

    def __post_init__(self) -> None:
        scheme = urlparse(self.url).scheme if self.url else "redis"
        if scheme not in SCHEMES:
            raise ValueError(f"transport.url scheme {scheme!r} is not one of {list(SCHEMES)} "
                             f"(got {redact_url(self.url)!r})")  # fmt: skip
        if scheme == "shm" and not urlparse(self.url).path:
            raise ValueError(f"transport.url {redact_url(self.url)!r} names no directory (shm:///dev/shm)")
        if scheme == "peer":
            from async_rl.peer.config import parse_peer_url  # urllib only: configs stay light

            parse_peer_url(self.url)
        if self.connections < 1:
            raise ValueError("transport.connections must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("transport.timeout_s must be > 0")


class BucketTransport(abc.ABC):
    """Moves the bytes of one weight bucket; keyed by (version, bucket index)."""

    name: ClassVar[str]
    durable: ClassVar[bool] = True
    """The bytes outlive the process that put them (Redis, shared memory). False (``peer://``): they leave with it,
    so a restarted learner publishes its weights again rather than pointing generators at a version nobody holds."""

    @abc.abstractmethod
    async def put(self, version: int, index: int, data: memoryview) -> None:
        """Store bucket ``index`` of ``version`` (overwrites)."""

    @abc.abstractmethod
    async def get(self, version: int, index: int, nbytes: int | None = None) -> memoryview:
        """The bytes of a bucket (``nbytes``: its size from the manifest, when known; needed for buckets
        larger than one Redis value), writable or read-only; :class:`BucketMissing` if absent."""

    async def get_checked(
        self, version: int, index: int, checksum: str, nbytes: int | None = None
    ) -> tuple[memoryview, int]:
        """The bucket and its checksum under ``checksum`` (a transport that can hash while receiving does)."""
        buf = await self.get(version, index, nbytes)
        return buf, await asyncio.to_thread(CHECKSUMS[checksum], buf)

    @abc.abstractmethod
    async def delete(self, version: int, num_buckets: int) -> None:
        """Remove every bucket of ``version`` (missing ones are fine)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def make_transport(cfg: TransportConfig, redis_url: str, names: Names) -> BucketTransport:
    """The transport ``cfg.url`` names by its scheme ('' is the run's Redis at ``redis_url``)."""
    url = cfg.url or redis_url
    scheme = urlparse(url).scheme
    if scheme in ("redis", "rediss"):
        return RedisTransport(url, names, connections=cfg.connections, timeout_s=cfg.timeout_s)
    if scheme == "shm":
        return SharedMemoryTransport(names, root=urlparse(url).path)
    if scheme == "peer":
        from async_rl.peer.transport import PeerTransport  # imports this module: loaded on use

        return PeerTransport(url, redis_url, names, timeout_s=cfg.timeout_s)
    raise ValueError(f"transport: no transport for scheme {scheme!r} of {redact_url(url)!r}; known: {list(SCHEMES)}")


# ---- Redis ---------------------------------------------------------------------------------


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
                raise TransportError("Redis closed the connection")
            self._pending += chunk

    def _reply_line(self) -> bytes:
        line = self._line()
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
                raise TransportError("Redis closed the connection mid-value")
            if hasher is not None:
                hasher.update(view[got : got + r])
            got += r
        while len(self._pending) < 2:
            chunk = self.sock.recv(2 - len(self._pending))
            if not chunk:
                raise TransportError("Redis closed the connection mid-value")
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
        """Run ``fn(connection)`` in the calling (worker) thread; a connection that failed is replaced."""
        conn = self._pool.get()
        ok = False
        try:
            if conn is None:
                conn = RespConnection(self.url, self.timeout_s)
            result = fn(conn)
            ok = True
            return result
        except OSError as exc:
            raise TransportError(f"Redis bucket transfer failed: {exc!r}") from exc
        finally:
            if not ok and conn is not None:
                conn.close()
            self._pool.put(conn if ok else None)

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


# ---- shared memory (one host) --------------------------------------------------------------


class SharedMemoryTransport(BucketTransport):
    """Buckets as files under a tmpfs (``/dev/shm/<prefix>/v<version>/<index>``); readers map them."""

    name: ClassVar[str] = "shm"
    root: Path

    def __init__(self, names: Names, root: str | Path = "/dev/shm") -> None:
        self.root = Path(root) / f"async-rl-{names.prefix}"

    def _path(self, version: int, index: int) -> Path:
        return self.root / f"v{version}" / f"{index}.bin"

    async def put(self, version: int, index: int, data: memoryview) -> None:
        path = self._path(version, index)

        def write() -> None:
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp = path.with_suffix(".tmp")
            with open(tmp, "wb") as fh:
                fh.write(data)
            os.replace(tmp, path)

        await asyncio.to_thread(write)

    async def get(self, version: int, index: int, nbytes: int | None = None) -> memoryview:
        path = self._path(version, index)

        def open_map() -> memoryview:
            with open(path, "rb") as fh:
                size = os.fstat(fh.fileno()).st_size
                if size == 0:
                    return memoryview(b"")
                return memoryview(mmap.mmap(fh.fileno(), size, prot=mmap.PROT_READ))

        try:
            return await asyncio.to_thread(open_map)
        except FileNotFoundError:
            raise BucketMissing(f"bucket {index} of weights version {version} is missing ({path})") from None

    async def delete(self, version: int, num_buckets: int) -> None:
        def remove() -> None:
            shutil.rmtree(self.root / f"v{version}", ignore_errors=True)
            with contextlib.suppress(OSError):  # not empty (other versions) or gone already
                self.root.rmdir()

        await asyncio.to_thread(remove)
