"""Checksums of weight buckets: one-shot and incremental (hashing while bytes arrive)."""

from __future__ import annotations

import zlib
from collections.abc import Callable


def _xxh3_64(data: memoryview) -> int:
    import xxhash

    return xxhash.xxh3_64_intdigest(data)


def _crc32(data: memoryview) -> int:
    return zlib.crc32(data)


# Measured on 256 MiB here: xxh3_64 3.5 GB/s, zlib.crc32 1.1 GB/s, blake2b 0.28 GB/s (a memcpy: 0.7-2.7 GB/s).
CHECKSUMS: dict[str, Callable[[memoryview], int]] = {"xxh3_64": _xxh3_64, "crc32": _crc32}


class _Crc32Stream:
    value: int

    def __init__(self) -> None:
        self.value = 0

    def update(self, data: memoryview) -> None:
        self.value = zlib.crc32(data, self.value)

    def intdigest(self) -> int:
        return self.value


def checksum_stream(name: str):  # type: ignore[no-untyped-def]
    """An incremental hasher (``update(bytes)``, ``intdigest()``) equal to ``CHECKSUMS[name]`` over all updates."""
    if name == "xxh3_64":
        import xxhash

        return xxhash.xxh3_64()
    if name == "crc32":
        return _Crc32Stream()
    raise ValueError(f"unknown checksum {name!r}; known: {sorted(CHECKSUMS)}")


def default_checksum() -> str:
    try:
        import xxhash  # noqa: F401
    except ImportError:  # pragma: no cover - xxhash is a dependency
        return "crc32"
    return "xxh3_64"
