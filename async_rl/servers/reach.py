"""Can this process reach its servers? One probe per server at start, one line when the answer is no.

Every process checks its Redis and NATS URLs before it builds anything heavy and exits non-zero within
seconds with one line naming the URL (credentials redacted) and what it found:

* nothing listening (connection refused), no answer (a host down or a port filtered), a name that does
  not resolve;
* the wrong protocol: a NATS server greets every connection with ``INFO {...}``, a Redis server says
  nothing until asked and answers ``PING`` with ``+PONG`` (or ``-NOAUTH``), so a Redis URL pointing at
  a NATS port, or the other way round, is named as such;
* credentials refused (Redis ``WRONGPASS`` / ``NOAUTH``, NATS ``Authorization Violation``), or a TLS
  handshake that fails.

At run time, Redis clients made by :func:`redis_client` retry a lost connection with capped exponential
backoff a bounded number of times (:data:`REDIS_RETRIES`, about 15 s in all) and then raise, so the process
exits for its supervisor (systemd, Kubernetes, Slurm) to restart it instead of waiting silently;
:func:`describe_failure` turns what they raise into the same kind of line.
"""

from __future__ import annotations

import asyncio
import socket
import ssl
from typing import Any
from urllib.parse import urlsplit

from async_rl.process.lifecycle import redact_url

PROBE_TIMEOUT_S = 2.0
"""Time limit of each network step of a probe (connect, greeting, handshake); both probes finish within 5 s."""
# A NATS server sends INFO as soon as it accepts; on a loaded machine that can take a few hundred ms.
_GREETING_WAIT_S = 1.0
REDIS_RETRIES = 6
"""Retries of a failed Redis command (backoff 0.25, 0.5, 1, 2, 4, 4 s with jitter: ~12 s, then the error)."""
_REDIS_BACKOFF_CAP_S = 4.0


class Unreachable(ConnectionError):
    """A server cannot be used; the message is one line naming the (redacted) URL and what was found."""


def _host_port(url: str, default_port: int) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "127.0.0.1", parts.port or default_port


def _connect(kind: str, url: str, default_port: int, timeout_s: float) -> socket.socket:
    host, port = _host_port(url, default_port)
    where = f"{kind} at {redact_url(url)}"
    try:
        return socket.create_connection((host, port), timeout=timeout_s)
    except ConnectionRefusedError:
        raise Unreachable(f"cannot reach {where}: nothing is listening on {host}:{port} (connection refused)") from None
    except socket.gaierror as exc:
        raise Unreachable(f"cannot reach {where}: host {host!r} does not resolve ({exc.strerror})") from None
    except TimeoutError:
        raise Unreachable(f"cannot reach {where}: no answer from {host}:{port} within {timeout_s:.0f} s "
                          "(host down or port filtered)") from None  # fmt: skip
    except OSError as exc:
        raise Unreachable(f"cannot reach {where}: {exc.strerror or exc}") from None


def _greeting(sock: socket.socket, wait_s: float) -> bytes:
    """Whatever the server says unasked within ``wait_s`` (b'' if nothing)."""
    sock.settimeout(wait_s)
    try:
        return sock.recv(4096)
    except TimeoutError:
        return b""


def probe_redis(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`Unreachable` unless ``url`` is a Redis server that accepts this client (``PING``)."""
    import redis
    from redis import exceptions as rex

    where = f"Redis at {redact_url(url)}"
    scheme = urlsplit(url).scheme
    if scheme == "redis":  # plain TCP: a NATS server gives itself away by greeting first
        sock = _connect("Redis", url, 6379, timeout_s)
        try:
            hello = _greeting(sock, min(0.3, timeout_s))
        finally:
            sock.close()
        if hello.startswith(b"INFO "):
            raise Unreachable(f"cannot use {where}: a NATS server answered there, not Redis (wrong port?)")
        if hello:
            raise Unreachable(f"cannot use {where}: the server there is not Redis (it sent {hello[:40]!r})")
    elif scheme == "rediss":
        _connect("Redis", url, 6379, timeout_s).close()
    client = redis.Redis.from_url(url, socket_connect_timeout=timeout_s, socket_timeout=timeout_s, retry=None)
    try:
        client.ping()
    except rex.AuthenticationError as exc:
        raise Unreachable(f"cannot use {where}: credentials refused ({exc})") from None
    except rex.ResponseError as exc:
        if "NOAUTH" in str(exc) or "WRONGPASS" in str(exc):
            raise Unreachable(f"cannot use {where}: credentials refused ({exc})") from None
        raise Unreachable(f"cannot use {where}: PING answered with an error ({exc})") from None
    except rex.TimeoutError:
        raise Unreachable(f"cannot use {where}: no answer to PING within {timeout_s:.0f} s") from None
    except (rex.ConnectionError, rex.InvalidResponse) as exc:
        text = str(exc)
        if scheme == "redis" and ("reset by peer" in text or "closed by server" in text):
            raise Unreachable(f"cannot use {where}: the server closed the connection on a plain-text PING "
                              "(a TLS port? use rediss://)") from None  # fmt: skip
        raise Unreachable(f"cannot use {where}: {_why(exc)}") from None
    finally:
        client.close()


def probe_nats(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Raise :class:`Unreachable` unless ``url`` is a NATS server that accepts this client (``CONNECT``)."""
    where = f"NATS at {redact_url(url)}"
    if urlsplit(url).scheme in ("nats", "tls"):
        sock = _connect("NATS", url, 4222, timeout_s)
        try:
            hello = _greeting(sock, min(_GREETING_WAIT_S, timeout_s))
            if not hello.startswith(b"INFO "):
                reply = b""
                if not hello:  # say something Redis understands: a Redis server answers a RESP PING
                    sock.sendall(b"*1\r\n$4\r\nPING\r\n")
                    reply = _greeting(sock, min(0.5, timeout_s))
                if reply.startswith((b"+PONG", b"-NOAUTH", b"-ERR")):
                    raise Unreachable(f"cannot use {where}: a Redis server answered there, not NATS (wrong port?)")
                raise Unreachable(f"cannot use {where}: no NATS greeting (INFO) within {_GREETING_WAIT_S:.0f} s"
                                  + (f"; it sent {hello[:40]!r}" if hello else ""))  # fmt: skip
        finally:
            sock.close()
    try:
        asyncio.run(_nats_connect(url, timeout_s))
    except Unreachable:
        raise
    except Exception as exc:  # nats-py raises many types: auth, TLS, timeouts, protocol
        text = str(exc) or type(exc).__name__
        if "authorization" in text.lower() or "authentication" in text.lower():
            raise Unreachable(f"cannot use {where}: credentials refused ({text.strip()})") from None
        if isinstance(exc, ssl.SSLError):
            raise Unreachable(f"cannot use {where}: TLS handshake failed ({text.strip()})") from None
        raise Unreachable(f"cannot use {where}: {type(exc).__name__}: {text.strip()}") from None


async def _nats_connect(url: str, timeout_s: float) -> None:
    import nats

    errors: list[BaseException] = []

    async def on_error(exc: BaseException) -> None:  # nats-py reports auth errors here as well as raising
        errors.append(exc)

    nc = await asyncio.wait_for(
        nats.connect(url, connect_timeout=timeout_s, allow_reconnect=False, max_reconnect_attempts=0,
                     error_cb=on_error, name="async-rl-probe"),  # fmt: skip
        timeout_s * 2,
    )
    try:
        await nc.flush(timeout=max(1, int(timeout_s)))
    finally:
        await nc.close()


def check_servers(redis_url: str | None, nats_url: str | None, timeout_s: float = PROBE_TIMEOUT_S) -> None:
    """Probe both servers (the ones given); raise :class:`Unreachable` with one line for the first that fails."""
    if redis_url:
        probe_redis(redis_url, timeout_s)
    if nats_url:
        probe_nats(nats_url, timeout_s)


def redis_client(url: str, **kwargs: Any) -> Any:
    """A ``redis.asyncio`` client that retries a lost connection with capped backoff :data:`REDIS_RETRIES` times,
    then raises (bytes responses, as the buffer needs)."""
    import redis.asyncio as aioredis
    from redis.asyncio.retry import Retry
    from redis.backoff import EqualJitterBackoff
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    retry = Retry(EqualJitterBackoff(cap=_REDIS_BACKOFF_CAP_S, base=0.25), REDIS_RETRIES)
    kwargs.setdefault("socket_connect_timeout", PROBE_TIMEOUT_S)
    kwargs.setdefault("health_check_interval", 30)
    return aioredis.Redis.from_url(url, retry=retry, retry_on_error=[RedisConnectionError, RedisTimeoutError],
                                   **kwargs)  # fmt: skip


def describe_failure(exc: BaseException, redis_url: str | None, nats_url: str | None) -> str | None:
    """One line for a server lost at run time (what a process prints before exiting non-zero), or None when
    ``exc`` is not a lost server. Every failure inside ``exc`` (an exception group's, their causes) is looked at,
    so the line names each server lost, Redis or NATS with its URL, not only the first task's complaint."""
    from redis import exceptions as rex

    from async_rl.servers.control import ControlPlaneLost

    lost: dict[str, str] = {}
    for leaf in _leaves(exc):
        seen: set[int] = set()
        cur: BaseException | None = leaf
        while cur is not None and id(cur) not in seen:  # a wrapped cause (TaskFailed) still names the server
            seen.add(id(cur))
            if isinstance(cur, ControlPlaneLost):
                lost.setdefault("nats", str(cur))
                break
            if isinstance(cur, (rex.ConnectionError, rex.TimeoutError)):
                lost.setdefault("redis", f"lost Redis at {redact_url(redis_url)} after {REDIS_RETRIES} retries: "
                                         f"{_why(cur)}")  # fmt: skip
                break
            mod = type(cur).__module__
            if mod.startswith("nats") and any(w in type(cur).__name__ for w in ("Connection", "Closed", "NoServers",
                                                                                "Timeout", "Stale")):  # fmt: skip
                lost.setdefault("nats", f"lost NATS at {redact_url(nats_url)}: {type(cur).__name__}: {cur}")
                break
            cur = cur.__cause__ or cur.__context__
    return "; ".join(lost[k] for k in ("redis", "nats") if k in lost) or None


def _leaves(exc: BaseException) -> list[BaseException]:
    """The exceptions inside ``exc``, depth first (``exc`` itself when it is not a group)."""
    if isinstance(exc, BaseExceptionGroup):
        return [leaf for inner in exc.exceptions for leaf in _leaves(inner)]
    return [exc]


def _why(exc: BaseException) -> str:
    text = str(exc)
    if isinstance(exc, ssl.SSLError) or "SSL" in text or "TLS" in text:
        return f"TLS handshake failed ({text})"
    if "Connection refused" in text:
        return "nothing is listening (connection refused)"
    if "Protocol Error" in text or "protocol" in text.lower():
        return f"the server does not speak the Redis protocol ({text})"
    return text or type(exc).__name__
