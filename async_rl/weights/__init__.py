"""Versioned weight buckets: planning and manifest, publisher, reader (protocol in ``docs/weights.md``).

Public names load on first use (:mod:`async_rl.lazy`), so ``async_rl.weights.config`` stays torch-free.

May import: lazy, process, run, servers.
"""

from typing import TYPE_CHECKING

from async_rl.lazy import lazy_exports

_EXPORTS = {
    "DTYPES": "manifest", "BucketEntry": "manifest", "Manifest": "manifest", "ManifestError": "manifest",
    "TensorEntry": "manifest", "plan_buckets": "manifest",
    "PublisherConfig": "config", "ReaderConfig": "config",
    "PublishStats": "publisher", "WeightPublisher": "publisher",
    "CorruptVersion": "reader", "FetchedVersion": "reader", "VersionUnavailable": "reader", "WeightReader": "reader",
    "WeightsError": "reader", "LeaseOutlasted": "reader",
}  # fmt: skip
__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
__all__ = sorted(_EXPORTS)

if TYPE_CHECKING:  # the real imports, for type checkers
    from async_rl.weights.config import PublisherConfig, ReaderConfig
    from async_rl.weights.manifest import DTYPES, BucketEntry, Manifest, ManifestError, TensorEntry, plan_buckets
    from async_rl.weights.publisher import PublishStats, WeightPublisher
    from async_rl.weights.reader import (
        CorruptVersion,
        FetchedVersion,
        LeaseOutlasted,
        VersionUnavailable,
        WeightReader,
        WeightsError,
    )
