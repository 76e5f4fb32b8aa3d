"""Bucket planning, packing and the manifest of one weight version.

A version is a set of named tensors packed into buckets: contiguous byte buffers of about
``bucket_bytes`` each (tensors in the given order, each at a 64-byte aligned offset; a tensor
larger than a bucket gets a bucket of its own). The manifest names every tensor's dtype, shape,
bucket and offset, and every bucket's size and checksum, so a reader can verify each bucket and
view its tensors in place without copying.
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from async_rl.checksums import CHECKSUMS, checksum_stream, default_checksum  # noqa: F401 - re-exported
from async_rl.weights.signing import hmac_matches, manifest_hmac

MANIFEST_SCHEMA = 1
# Tensor offsets inside a bucket are aligned to a cache line, so every dtype's view is aligned.
ALIGN_BYTES = 64

DTYPES: dict[str, torch.dtype] = {
    "float64": torch.float64,
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
    "int64": torch.int64,
    "int32": torch.int32,
    "int16": torch.int16,
    "int8": torch.int8,
    "uint8": torch.uint8,
    "bool": torch.bool,
    "float8_e4m3fn": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2,
}
DTYPE_NAMES: dict[torch.dtype, str] = {v: k for k, v in DTYPES.items()}


class ManifestError(ValueError):
    """A manifest that cannot be decoded or is inconsistent."""


class ManifestAuthError(ManifestError):
    """A manifest whose HMAC does not check against the run secret, or that carries none (async_rl.weights.signing)."""


@dataclass(slots=True)
class TensorEntry:
    """Where one tensor lives inside a version."""

    name: str
    """Hugging Face parameter name."""
    dtype: str
    """A key of :data:`DTYPES`."""
    shape: tuple[int, ...]
    """Tensor shape."""
    bucket: int
    """Index of the bucket holding it."""
    offset: int
    """Byte offset inside the bucket."""
    nbytes: int
    """Bytes it occupies (numel x itemsize)."""


@dataclass(slots=True)
class BucketEntry:
    """One bucket's size and checksum."""

    index: int
    """Bucket index (0..num_buckets-1)."""
    nbytes: int
    """Exact byte length of the bucket."""
    checksum: int = 0
    """Checksum of the bucket bytes under :attr:`Manifest.checksum`."""


@dataclass(slots=True)
class Manifest:
    """Everything a reader needs to fetch, verify and view one weight version."""

    version: int
    """Weight version (the learner's counter)."""
    tensors: list[TensorEntry]
    """Tensors in publication order."""
    buckets: list[BucketEntry]
    """Buckets in index order."""
    transport: str
    """Name of the transport holding the bucket bytes ('redis', 'shm')."""
    checksum: str
    """Checksum algorithm (a key of :data:`CHECKSUMS`)."""
    created_at: float = field(default_factory=time.time)
    """Unix time the publisher finished the version."""

    @property
    def total_bytes(self) -> int:
        return sum(b.nbytes for b in self.buckets)

    @property
    def num_buckets(self) -> int:
        return len(self.buckets)

    def encode(self, hmac_key: bytes | None = None) -> bytes:
        """The manifest's bytes; with ``hmac_key``, wrapped with their HMAC (``{"signed": bytes, "hmac": hex}``)."""
        body = self._encode_body()
        if hmac_key is None:
            return body
        return msgpack.packb({"signed": body, "hmac": manifest_hmac(hmac_key, body)})

    def _encode_body(self) -> bytes:
        return msgpack.packb(
            {
                "schema": MANIFEST_SCHEMA,
                "version": self.version,
                "transport": self.transport,
                "checksum": self.checksum,
                "created_at": self.created_at,
                "total_bytes": self.total_bytes,
                "buckets": [[b.index, b.nbytes, b.checksum] for b in self.buckets],
                "tensors": [[t.name, t.dtype, list(t.shape), t.bucket, t.offset, t.nbytes] for t in self.tensors],
            }
        )

    @classmethod
    def decode(cls, data: bytes | str, hmac_key: bytes | None = None) -> Manifest:
        """Decode a manifest; with ``hmac_key`` only a signed one whose HMAC checks (else :class:`ManifestAuthError`)."""
        if not isinstance(data, bytes):
            raise ManifestError("weights manifest must be bytes (is the Redis client decoding responses?)")
        try:
            d: dict[str, Any] = msgpack.unpackb(data)
            if isinstance(d, dict) and "signed" in d:
                body = d["signed"]
                if not isinstance(body, bytes):
                    raise ManifestError("signed weights manifest: 'signed' must be bytes")
                if hmac_key is not None and not hmac_matches(hmac_key, body, d.get("hmac")):
                    raise ManifestAuthError("weights manifest HMAC does not check against the run secret "
                                            "(a different secret, or not written by this run's learner)")  # fmt: skip
                d = msgpack.unpackb(body)
            elif hmac_key is not None:
                raise ManifestAuthError("weights manifest carries no HMAC, but this reader has a run secret")
            if d.get("schema") != MANIFEST_SCHEMA:
                raise ManifestError(f"weights manifest schema {d.get('schema')!r} is not {MANIFEST_SCHEMA}")
            m = cls(
                version=int(d["version"]),
                transport=str(d["transport"]),
                checksum=str(d["checksum"]),
                created_at=float(d["created_at"]),
                buckets=[BucketEntry(int(i), int(n), int(c)) for i, n, c in d["buckets"]],
                tensors=[TensorEntry(n, dt, tuple(s), int(b), int(o), int(nb)) for n, dt, s, b, o, nb in d["tensors"]],
            )
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise ManifestError(f"weights manifest is malformed: {exc!r}") from exc
        if m.total_bytes != int(d["total_bytes"]):
            raise ManifestError("weights manifest total_bytes does not match its buckets")
        m.validate()
        return m

    def validate(self) -> None:
        if self.checksum not in CHECKSUMS:
            raise ManifestError(f"weights manifest checksum {self.checksum!r} is not one of {sorted(CHECKSUMS)}")
        for i, b in enumerate(self.buckets):
            if b.index != i:
                raise ManifestError(f"weights manifest bucket {i} has index {b.index}")
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ManifestError(f"weights manifest names tensor {t.name!r} twice")
            seen.add(t.name)
            if t.dtype not in DTYPES:
                raise ManifestError(f"tensor {t.name!r} has unknown dtype {t.dtype!r}")
            numel = 1
            for s in t.shape:
                numel *= s
            if numel * DTYPES[t.dtype].itemsize != t.nbytes:
                raise ManifestError(f"tensor {t.name!r}: shape {t.shape} x {t.dtype} is not {t.nbytes} bytes")
            if not 0 <= t.bucket < len(self.buckets) or t.offset + t.nbytes > self.buckets[t.bucket].nbytes:
                raise ManifestError(f"tensor {t.name!r} lies outside its bucket {t.bucket}")


def _aligned(n: int) -> int:
    return (n + ALIGN_BYTES - 1) // ALIGN_BYTES * ALIGN_BYTES


def plan_buckets(tensors: Mapping[str, torch.Tensor], bucket_bytes: int) -> tuple[list[TensorEntry], list[int]]:
    """Place tensors (in order) into buckets of about ``bucket_bytes``; returns entries and bucket sizes."""
    if bucket_bytes <= 0:
        raise ValueError("weights.bucket_bytes must be > 0")
    entries: list[TensorEntry] = []
    sizes: list[int] = []
    fill = 0
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"weights: {name!r} is a {type(t).__name__}, not a torch.Tensor")
        if t.dtype not in DTYPE_NAMES:
            raise ValueError(f"weights: tensor {name!r} has unsupported dtype {t.dtype}")
        nbytes = t.numel() * t.element_size()
        start = _aligned(fill)
        if not sizes or (fill > 0 and start + nbytes > bucket_bytes):
            sizes.append(0)
            start = 0
        entries.append(TensorEntry(name, DTYPE_NAMES[t.dtype], tuple(t.shape), len(sizes) - 1, start, nbytes))
        fill = start + nbytes
        sizes[-1] = fill
    return entries, sizes


def pack_bucket(tensors: Mapping[str, torch.Tensor], entries: Iterable[TensorEntry], out: memoryview) -> None:
    """Copy the tensors of one bucket into ``out`` (a writable buffer of the bucket's exact size)."""
    dst = torch.frombuffer(out, dtype=torch.uint8) if out.nbytes else torch.empty(0, dtype=torch.uint8)
    pos = 0
    for e in entries:
        if e.offset > pos:
            dst[pos : e.offset].zero_()  # alignment padding: deterministic bytes, deterministic checksum
        src = tensors[e.name].detach()
        if src.device.type != "cpu":
            src = src.to("cpu")
        src = src.contiguous().reshape(-1).view(torch.uint8)
        dst[e.offset : e.offset + e.nbytes].copy_(src)
        pos = e.offset + e.nbytes


def view_tensor(buf: memoryview, e: TensorEntry) -> torch.Tensor:
    """The tensor ``e`` as a view of its bucket's bytes (no copy; read-only buffers give read-only tensors)."""
    dtype = DTYPES[e.dtype]
    if e.nbytes == 0:
        return torch.empty(e.shape, dtype=dtype)
    flat = torch.frombuffer(buf, dtype=dtype, count=e.nbytes // dtype.itemsize, offset=e.offset)
    return flat.view(e.shape)
