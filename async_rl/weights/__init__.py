"""Versioned weight buckets: planning and manifest, publisher, reader (protocol in ``docs/weights.md``)."""

from async_rl.weights.manifest import DTYPES, BucketEntry, Manifest, ManifestError, TensorEntry, plan_buckets
from async_rl.weights.publisher import PublisherConfig, PublishStats, WeightPublisher
from async_rl.weights.reader import (
    CorruptVersion,
    FetchedVersion,
    ReaderConfig,
    VersionUnavailable,
    WeightReader,
    WeightsError,
)

__all__ = [
    "DTYPES",
    "BucketEntry",
    "CorruptVersion",
    "FetchedVersion",
    "Manifest",
    "ManifestError",
    "PublishStats",
    "PublisherConfig",
    "ReaderConfig",
    "TensorEntry",
    "VersionUnavailable",
    "WeightPublisher",
    "WeightReader",
    "WeightsError",
    "plan_buckets",
]
