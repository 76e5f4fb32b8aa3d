"""The ``peer://`` URL: where this process serves buckets and how many children it feeds (torch-free, no I/O)."""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import parse_qs, urlparse

# A child that cannot connect to a source within this many seconds names it and picks another.
DEFAULT_CONNECT_TIMEOUT_S = 5.0
# Relay entries live this long without a heartbeat (one every third of it): a dead peer leaves the tree after it.
DEFAULT_TTL_S = 10.0


@dataclass(frozen=True, slots=True)
class PeerUrl:
    """``peer://BIND_HOST:PORT?fanout=F&advertise=HOST&keep=K&ttl_s=T&connect_timeout_s=C&same_host=fd|tcp``."""

    bind_host: str
    """Address the bucket server listens on ('0.0.0.0': every interface)."""
    port: int
    """Port (0: any free one)."""
    fanout: int
    """Children this process streams to at once (the learner's: how many peers the publisher serves;
    0 on a generator: it only pulls, never relays)."""
    advertise: str
    """Address other peers connect to ('': the bind address, or the local address that reaches Redis)."""
    keep: int
    """Versions a generator holds for serving (the newest ones it pulled); the publisher holds each version until
    its own pruning deletes it (a delta's full base stays as long as the publisher keeps it)."""
    ttl_s: float
    """Lifetime of this peer's relay entries without a heartbeat."""
    connect_timeout_s: float
    """Time to connect to a source before trying another."""
    same_host: str
    """'fd': a source on this host (same kernel and network namespace) hands over memfds, no bytes copied;
    'tcp': bytes over TCP even then (to measure the network path on one machine)."""


_KNOWN = {"fanout", "advertise", "keep", "ttl_s", "connect_timeout_s", "same_host"}


def parse_peer_url(url: str) -> PeerUrl:
    """Parse and check a ``peer://`` URL; ValueError naming the part that is wrong."""
    parsed = urlparse(url)
    if parsed.scheme != "peer":
        raise ValueError(f"transport.url {url!r}: not a peer:// URL")
    q = {k: v[-1] for k, v in parse_qs(parsed.query, keep_blank_values=True).items()}
    unknown = sorted(set(q) - _KNOWN)
    if unknown:
        raise ValueError(f"transport.url {url!r}: unknown parameter(s) {unknown}; known: {sorted(_KNOWN)}")
    try:
        port = parsed.port or 0
        out = PeerUrl(
            bind_host=parsed.hostname or "0.0.0.0",
            port=port,
            fanout=int(q.get("fanout", "2")),
            advertise=q.get("advertise", ""),
            keep=int(q.get("keep", "2")),
            ttl_s=float(q.get("ttl_s", str(DEFAULT_TTL_S))),
            connect_timeout_s=float(q.get("connect_timeout_s", str(DEFAULT_CONNECT_TIMEOUT_S))),
            same_host=q.get("same_host", "fd"),
        )
    except ValueError as exc:
        raise ValueError(f"transport.url {url!r}: {exc}") from None
    if out.fanout < 0:
        raise ValueError(f"transport.url {url!r}: fanout must be >= 0")
    if out.keep < 1:
        raise ValueError(f"transport.url {url!r}: keep must be >= 1")
    if out.same_host not in ("fd", "tcp"):
        raise ValueError(f"transport.url {url!r}: same_host must be 'fd' or 'tcp', got {out.same_host!r}")
    if out.ttl_s <= 0 or out.connect_timeout_s <= 0:
        raise ValueError(f"transport.url {url!r}: ttl_s and connect_timeout_s must be > 0")
    return out
