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
import mmap
import os
import queue
import shutil
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal
from urllib.parse import unquote, urlparse

from async_rl.checksums import CHECKSUMS, checksum_stream
from async_rl.names import Names

# Kernel socket buffers large enough to keep the loopback pipe full between recv_into calls.
SOCKET_BUFFER_BYTES = 4 << 20
# Redis refuses bulk strings over proto-max-bulk-len (512 MiB by default).
MAX_BUCKET_BYTES = 512 << 20


class TransportError(RuntimeError):
    """The transport failed to move a bucket (connection lost, server error)."""


class BucketMissing(TransportError):
    """A bucket a manifest names is not there (pruned, or never written)."""


@dataclass(kw_only=True, slots=True)
class TransportConfig:
    """Which transport moves weight bucket bytes."""

    type: Literal["redis", "shm"] = "redis"
    """'redis': buckets are Redis values (works across machines); 'shm': files under shm_dir (one host)."""
    connections: int = 2
    """Redis connections (and worker threads) used for concurrent bucket reads/writes."""
    timeout_s: float = 60.0
    """Socket timeout for one bucket transfer."""
    shm_dir: str = "/dev/shm"
    """Directory of the shared-memory transport (a tmpfs)."""

    def __post_init__(self) -> None:
        if self.connections < 1:
            raise ValueError("transport.connections must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("transport.timeout_s must be > 0")


class BucketTransport(abc.ABC):
    """Moves the bytes of one weight bucket; keyed by (version, bucket index)."""

    name: ClassVar[str]

    @abc.abstractmethod
    async def put(self, version: int, index: int, data: memoryview) -> None:
        """Store bucket ``index`` of ``version`` (overwrites)."""

    @abc.abstractmethod
    async def get(self, version: int, index: int) -> memoryview:
        """The bytes of a bucket, writable or read-only; raises :class:`BucketMissing` if absent."""

    async def get_checked(self, version: int, index: int, checksum: str) -> tuple[memoryview, int]:
        """The bucket and its checksum under ``checksum`` (a transport that can hash while receiving does)."""
        buf = await self.get(version, index)
        return buf, await asyncio.to_thread(CHECKSUMS[checksum], buf)

    @abc.abstractmethod
    async def delete(self, version: int, num_buckets: int) -> None:
        """Remove every bucket of ``version`` (missing ones are fine)."""

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


def make_transport(cfg: TransportConfig, redis_url: str, names: Names) -> BucketTransport:
    if cfg.type == "redis":
        return RedisTransport(redis_url, names, connections=cfg.connections, timeout_s=cfg.timeout_s)
    return SharedMemoryTransport(names, root=cfg.shm_dir)


# ---- Redis ---------------------------------------------------------------------------------


def _command(*parts: bytes) -> bytes:
    out = [b"*%d\r\n" % len(parts)]
    for p in parts:
        out.append(b"$%d\r\n%s\r\n" % (len(p), p))
    return b"".join(out)


class RespConnection:
    """One blocking RESP2 connection: SET from a buffer, GET into a buffer, DEL. Not thread-safe."""

    sock: socket.socket
    _pending: bytearray

    def __init__(self, url: str, timeout_s: float = 60.0) -> None:
        parsed = urlparse(url)
        if parsed.scheme != "redis":
            raise ValueError(f"transport: only redis:// URLs are supported by the bucket transport, got {url!r}")
        self.sock = socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or 6379), timeout_s)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, SOCKET_BUFFER_BYTES)
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SOCKET_BUFFER_BYTES)
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
        """The value of ``key`` read straight into a new buffer, or None when absent.

        With ``hasher`` (``update(bytes)``), every chunk is hashed as it arrives, while it is still in cache.
        """
        self.sock.sendall(_command(b"GET", key.encode()))
        line = self._reply_line()
        if not line.startswith(b"$"):
            raise TransportError(f"unexpected reply to GET {key}: {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return None
        buf = bytearray(n)
        view = memoryview(buf)
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
        return buf

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
    _pool: queue.LifoQueue[RespConnection | None]

    def __init__(self, url: str, names: Names, *, connections: int = 2, timeout_s: float = 60.0) -> None:
        self.url = url
        self.names = names
        self.timeout_s = timeout_s
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

    async def put(self, version: int, index: int, data: memoryview) -> None:
        if data.nbytes > MAX_BUCKET_BYTES:
            raise ValueError(f"bucket of {data.nbytes} bytes exceeds Redis's 512 MiB value limit")
        key = self.names.weights_bucket(version, index)
        await asyncio.to_thread(self._run, lambda c: c.set(key, data))

    async def get(self, version: int, index: int) -> memoryview:
        key = self.names.weights_bucket(version, index)
        buf = await asyncio.to_thread(self._run, lambda c: c.get(key))
        if buf is None:
            raise BucketMissing(f"bucket {index} of weights version {version} is missing ({key})")
        return memoryview(buf)

    async def get_checked(self, version: int, index: int, checksum: str) -> tuple[memoryview, int]:
        key = self.names.weights_bucket(version, index)
        hasher = checksum_stream(checksum)
        buf = await asyncio.to_thread(self._run, lambda c: c.get(key, hasher))
        if buf is None:
            raise BucketMissing(f"bucket {index} of weights version {version} is missing ({key})")
        return memoryview(buf), hasher.intdigest()

    async def delete(self, version: int, num_buckets: int) -> None:
        keys = [self.names.weights_bucket(version, i) for i in range(num_buckets)]
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

    async def get(self, version: int, index: int) -> memoryview:
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
        await asyncio.to_thread(shutil.rmtree, self.root / f"v{version}", True)
