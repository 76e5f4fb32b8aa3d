"""How the bytes of weight buckets move: one interface, one registry of URL schemes, the transport's config.

The version, the manifest, the leases and the announcement always go through Redis and NATS
(:mod:`async_rl.weights`); only the bucket bytes go through a :class:`BucketTransport`, so a faster
transport plugs in without touching the publisher, the reader or the generator. ``transport.url``'s
scheme picks one from :data:`SCHEMES`; its module is imported only then, so a config names ``peer://``
(or a GPU scheme) without importing its dependencies:

- ``redis://`` / ``rediss://``: :mod:`async_rl.weights.redis_transport` (the default: the run's own Redis);
- ``shm://``: :mod:`async_rl.weights.shm_transport` (files under a tmpfs, one host);
- ``peer://``: :mod:`async_rl.weights.peer.transport` (TCP between the peers that hold a version, many hosts).

Adding a scheme (``cuda://``, ``nixl://``, ...):

1. write ``async_rl/weights/<name>_transport.py`` (or a subpackage) with a :class:`BucketTransport`
   subclass, and at its end ``register_transport("<scheme>", factory)``, where ``factory(url, cfg,
   redis_url, names)`` builds it from the URL and the :class:`TransportConfig`;
2. add one line to :data:`SCHEMES`: the scheme, that module, and optionally a light URL check (urllib
   only, no heavy import) that raises ``ValueError`` naming ``transport.url``, run at config time;
3. test it through :func:`make_transport` (``tests/integration/test_weights.py`` runs the round trip for any
   transport). The module may import this one; this one imports no transport module (no cycle).
"""

from __future__ import annotations

import abc
import asyncio
import importlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import ClassVar
from urllib.parse import urlparse

from async_rl.process.lifecycle import redact_url
from async_rl.run.names import Names
from async_rl.weights.checksums import CHECKSUMS

# Target bucket sizes are capped at Redis's default proto-max-bulk-len (512 MiB), its largest value.
MAX_BUCKET_BYTES = 512 << 20


class TransportError(RuntimeError):
    """The transport failed to move a bucket (connection lost, server error)."""


class BucketMissing(TransportError):
    """A bucket a manifest names is not there (pruned, or never written)."""


class BucketCorrupt(TransportError):
    """A bucket's stored size is not the size the manifest gives."""


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

    puts_cross_link: ClassVar[bool] = True
    """:meth:`put` moves the bytes over the link readers fetch from (Redis): its rate is the link's. False
    (``peer://``: a put is a local copy; children fetch later): only :meth:`link_bytes_per_s` says."""

    def link_bytes_per_s(self) -> float | None:
        """The rate this process's buckets leave at, where the transport measures it apart from :meth:`put`
        (``peer://``: what its server streams to children); None: not measured here."""
        return None

    async def close(self) -> None:  # noqa: B027 - optional hook
        """Release connections."""


# ---- the registry ----------------------------------------------------------------------------


def _check_shm(url: str) -> None:
    if not urlparse(url).path:
        raise ValueError(f"transport.url {redact_url(url)!r} names no directory (shm:///dev/shm)")


def _check_peer(url: str) -> None:
    from async_rl.weights.peer.config import parse_peer_url  # urllib only: configs stay light

    parse_peer_url(url)


@dataclass(frozen=True, slots=True)
class Scheme:
    """Where the transport of one URL scheme lives."""

    module: str
    """The module that defines the transport and calls :func:`register_transport` when imported (on first use)."""
    check_url: Callable[[str], None] | None = None
    """A light check of a URL of this scheme, run when the config is built; ValueError naming ``transport.url``."""


SCHEMES: dict[str, Scheme] = {
    "redis": Scheme("async_rl.weights.redis_transport"),
    "rediss": Scheme("async_rl.weights.redis_transport"),
    "shm": Scheme("async_rl.weights.shm_transport", _check_shm),
    "peer": Scheme("async_rl.weights.peer.transport", _check_peer),
}
"""URL schemes of the bucket transports: each names one explicitly; any other scheme is refused."""

TransportFactory = Callable[[str, "TransportConfig", str, Names], BucketTransport]
"""Builds a transport from (its URL, the transport config, the run's Redis URL, the run's names)."""
_FACTORIES: dict[str, TransportFactory] = {}


def register_transport(scheme: str, factory: TransportFactory) -> None:
    """Called by a transport module when imported: ``factory`` builds the transport of ``scheme`` URLs."""
    assert scheme in SCHEMES, f"scheme {scheme!r} has no line in async_rl.weights.transport.SCHEMES"
    _FACTORIES[scheme] = factory


def _scheme(url: str) -> str:
    scheme = urlparse(url).scheme if url else "redis"
    if scheme not in SCHEMES:
        raise ValueError(f"transport.url scheme {scheme!r} is not one of {list(SCHEMES)} (got {redact_url(url)!r})")
    return scheme


def make_transport(cfg: TransportConfig, redis_url: str, names: Names) -> BucketTransport:
    """The transport ``cfg.url`` names by its scheme ('' is the run's Redis at ``redis_url``)."""
    url = cfg.url or redis_url
    scheme = _scheme(url)
    if scheme not in _FACTORIES:
        importlib.import_module(SCHEMES[scheme].module)
    factory = _FACTORIES.get(scheme)
    assert factory is not None, f"{SCHEMES[scheme].module} did not register a transport for {scheme!r}"
    return factory(url, cfg, redis_url, names)


@dataclass(kw_only=True, slots=True)
class TransportConfig:
    """Which transport moves weight bucket bytes."""

    url: str = ""
    """Where bucket bytes go, chosen by the URL's scheme (:data:`SCHEMES`): '' is the run's own Redis;
    ``redis://host:port/db`` another Redis (works across machines; ``rediss://`` over TLS, ``user:password@``
    for an ACL user, ``?ssl_ca_certs=ca.pem`` for a private CA); ``shm:///dev/shm`` files under that tmpfs
    directory (one host); ``peer://0.0.0.0:0?fanout=2`` buckets served over TCP by whoever holds them, the
    publisher and then the generators themselves (:mod:`async_rl.weights.peer`; many hosts). Any other scheme is
    refused."""
    connections: int = 2
    """Redis connections (and worker threads) used for concurrent bucket reads/writes."""
    timeout_s: float = 60.0
    """Socket timeout for one bucket transfer."""

    def __post_init__(self) -> None:
        scheme = _scheme(self.url)
        check = SCHEMES[scheme].check_url
        if check is not None:
            check(self.url)
        if self.connections < 1:
            raise ValueError("transport.connections must be >= 1")
        if self.timeout_s <= 0:
            raise ValueError("transport.timeout_s must be > 0")
