"""Bucket planning, packing and the manifest of one weight version (schema 2: pieces, ranks, deltas).

A version is a set of Hugging Face tensors. Each tensor arrives as one or more **pieces**, each a slice
``[start, start + length)`` along one dimension ``dim`` of the full tensor, written by the rank that owns it (a TP
slice, a PP stage's layers, an EP rank's experts; the torch backend: one piece per tensor, rank 0). A piece's
stored bytes (its *payload*) sit in a bucket, a contiguous byte buffer of about ``bucket_bytes`` (payloads in the
given order, each at a 64-byte aligned offset; a payload larger than a bucket gets a bucket of its own). A payload
is encoded (:mod:`.delta`): ``raw`` (the piece's bytes), ``xor-zstd`` (zstd of the byte-shuffled XOR with the same
piece of version ``base``), ``sparse`` (the changed elements' new values and indices, encoded on the learner's GPU)
or ``same`` (no bytes: unchanged since ``base``). Every piece carries the checksum of its
FULL contents, so a reader that applied a delta checks the result bit for bit. The manifest names every tensor's
dtype, shape and pieces, and every bucket's size and checksum; a ``full`` version needs nothing else, a ``delta``
version needs version ``base`` (itself full or a delta back to ``full_version``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgpack
import torch

from async_rl.weights.checksums import CHECKSUMS, checksum_stream, default_checksum  # noqa: F401 - re-exported
from async_rl.weights.gpu.cuda_ipc import IpcHandle
from async_rl.weights.signing import hmac_matches, manifest_hmac

MANIFEST_SCHEMA = 2
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
    """Where one tensor (or piece payload) is placed by :func:`plan_buckets`."""

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


ENCODINGS = ("raw", "xor-zstd", "same", "sparse")
"""Payload encodings of a piece (see :mod:`async_rl.weights.delta`)."""


@dataclass(slots=True)
class PieceEntry:
    """One rank's piece of a tensor: where its payload is, how it is encoded, where it goes in the full tensor."""

    bucket: int
    """Bucket holding the payload (any index for an empty payload)."""
    offset: int
    """Byte offset of the payload in its bucket."""
    nbytes: int
    """Payload bytes (``raw``: the piece's bytes; ``same``: 0)."""
    checksum: int
    """Checksum (:attr:`Manifest.checksum`) of the piece's full contents, after any delta is applied."""
    dim: int = 0
    """Dimension of the full tensor the piece is a slice of."""
    start: int = 0
    """First index along ``dim``."""
    length: int = -1
    """Size along ``dim`` (-1: the whole tensor; a 0-d tensor has one piece of length -1)."""
    encoding: str = "raw"
    """A key of :data:`ENCODINGS`."""
    rank: int = 0
    """The rank that wrote it (informational)."""

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        if self.length < 0:
            return full
        return full[: self.dim] + (self.length,) + full[self.dim + 1 :]

    def encode(self) -> list[Any]:
        return [self.bucket, self.offset, self.nbytes, self.checksum, self.dim, self.start, self.length,
                self.encoding, self.rank]  # fmt: skip


@dataclass(slots=True)
class ManifestTensor:
    """One Hugging Face tensor of a version and its pieces."""

    name: str
    """Hugging Face parameter name."""
    dtype: str
    """A key of :data:`DTYPES`."""
    shape: tuple[int, ...]
    """Shape of the full tensor."""
    pieces: list[PieceEntry]
    """Its pieces (one per owning rank, or one covering it all), in order along their dimension."""

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    @property
    def whole(self) -> bool:
        """One piece covering the full tensor."""
        return len(self.pieces) == 1 and self.pieces[0].length < 0


KINDS = ("full", "delta")
GPU_TRANSPORT = "cuda"
"""The transport name of GPU-held versions (their manifests and announcements)."""
GPU_CHECKSUM = "wsum64"
"""The checksum of GPU-held versions (:mod:`.gpu_checksum`): computed on the GPU by the learner and by the reader."""


@dataclass(slots=True)
class IpcPlacement:
    """Where a GPU-held version's buckets live: the learner's GPU buffers, one exported handle per bucket."""

    host: str
    """:func:`~async_rl.weights.gpu.cuda_ipc.host_key` of the learner: only processes with the same key map the handles."""
    handles: list[IpcHandle]
    """Bucket ``i`` is the first ``buckets[i].nbytes`` bytes of ``handles[i]``'s buffer."""


@dataclass(slots=True)
class Manifest:
    """Everything a reader needs to fetch, verify and assemble one weight version."""

    version: int
    """Weight version (the learner's counter)."""
    tensors: list[ManifestTensor]
    """Tensors in publication order."""
    buckets: list[BucketEntry]
    """Buckets in index order."""
    transport: str
    """Name of the transport holding the bucket bytes ('redis', 'shm')."""
    checksum: str
    """Checksum algorithm (a key of :data:`CHECKSUMS`)."""
    kind: str = "full"
    """``full``: every payload is ``raw``; ``delta``: payloads relative to version ``base``."""
    base: int = -1
    """The version a delta applies to (-1 for a full version)."""
    full_version: int = -1
    """The full version this version's chain of deltas starts from (itself for a full version)."""
    num_ranks: int = 1
    """Ranks that wrote pieces."""
    created_at: float = field(default_factory=time.time)
    """Unix time the publisher finished the version."""
    taken_at: float = 0.0
    """Unix time the learner's snapshot of it began (0: not said): readers measure snapshot-to-applied from it."""
    ipc: IpcPlacement | None = None
    """A GPU-held version (transport ``cuda``): its buckets are the learner's GPU buffers, mapped over CUDA IPC."""

    @property
    def total_bytes(self) -> int:
        """Bytes stored (sent) for this version."""
        return sum(b.nbytes for b in self.buckets)

    @property
    def full_bytes(self) -> int:
        """Bytes of the full tensors (what a full version of the same weights stores, less alignment padding)."""
        return sum(t.nbytes for t in self.tensors)

    def layout(self) -> dict[str, torch.Tensor]:
        """Every tensor's name, shape and dtype, as meta tensors (no memory): what an engine checks before bytes come."""
        return {t.name: torch.empty(t.shape, dtype=DTYPES[t.dtype], device="meta") for t in self.tensors}

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
                "kind": self.kind,
                "base": self.base,
                "full_version": self.full_version,
                "num_ranks": self.num_ranks,
                "transport": self.transport,
                "checksum": self.checksum,
                "created_at": self.created_at,
                "taken_at": self.taken_at,
                "ipc": None if self.ipc is None else [self.ipc.host, [h.encode() for h in self.ipc.handles]],
                "total_bytes": self.total_bytes,
                "buckets": [[b.index, b.nbytes, b.checksum] for b in self.buckets],
                "tensors": [[t.name, t.dtype, list(t.shape), [p.encode() for p in t.pieces]] for t in self.tensors],
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
                kind=str(d["kind"]),
                base=int(d["base"]),
                full_version=int(d["full_version"]),
                num_ranks=int(d["num_ranks"]),
                transport=str(d["transport"]),
                checksum=str(d["checksum"]),
                created_at=float(d["created_at"]),
                taken_at=float(d.get("taken_at", 0.0)),
                ipc=None if d.get("ipc") is None else IpcPlacement(
                    str(d["ipc"][0]), [IpcHandle.decode(h) for h in d["ipc"][1]]),
                buckets=[BucketEntry(int(i), int(n), int(c)) for i, n, c in d["buckets"]],
                tensors=[
                    ManifestTensor(n, dt, tuple(int(x) for x in s), [
                        PieceEntry(int(b), int(o), int(nb), int(c), int(dim), int(st), int(ln), str(enc), int(rk))
                        for b, o, nb, c, dim, st, ln, enc, rk in pieces
                    ])
                    for n, dt, s, pieces in d["tensors"]
                ],
            )  # fmt: skip
        except ManifestError:
            raise
        except (KeyError, TypeError, ValueError, msgpack.UnpackException) as exc:
            raise ManifestError(f"weights manifest is malformed: {exc!r}") from exc
        if m.total_bytes != int(d["total_bytes"]):
            raise ManifestError("weights manifest total_bytes does not match its buckets")
        m.validate()
        return m

    def validate(self) -> None:
        """Check everything a reader relies on; :class:`ManifestError` naming the tensor or field otherwise."""
        if self.checksum not in CHECKSUMS:
            raise ManifestError(f"weights manifest checksum {self.checksum!r} is not one of {sorted(CHECKSUMS)}")
        if self.kind not in KINDS:
            raise ManifestError(f"weights manifest kind {self.kind!r} is not one of {list(KINDS)}")
        if self.kind == "full" and (self.base != -1 or self.full_version != self.version):
            raise ManifestError(f"full weights version {self.version}: base must be -1 and full_version itself")
        if self.kind == "delta" and not 0 <= self.full_version <= self.base < self.version:
            raise ManifestError(f"delta weights version {self.version}: needs full_version <= base < version, got "
                                f"full_version {self.full_version}, base {self.base}")  # fmt: skip
        for i, b in enumerate(self.buckets):
            if b.index != i:
                raise ManifestError(f"weights manifest bucket {i} has index {b.index}")
        if self.ipc is not None:
            if self.kind != "full" or self.checksum != GPU_CHECKSUM:
                raise ManifestError(f"GPU-held weights version {self.version} must be full with checksum {GPU_CHECKSUM}")
            if len(self.ipc.handles) != len(self.buckets):
                raise ManifestError(f"GPU-held weights version {self.version}: {len(self.ipc.handles)} IPC handles "
                                    f"for {len(self.buckets)} buckets")  # fmt: skip
            for b, h in zip(self.buckets, self.ipc.handles, strict=True):
                if b.nbytes > h.storage_bytes:
                    raise ManifestError(f"GPU-held weights version {self.version}: bucket {b.index} of {b.nbytes} "
                                        f"bytes exceeds its buffer of {h.storage_bytes}")  # fmt: skip
        seen: set[str] = set()
        for t in self.tensors:
            if t.name in seen:
                raise ManifestError(f"weights manifest names tensor {t.name!r} twice")
            seen.add(t.name)
            if t.dtype not in DTYPES:
                raise ManifestError(f"tensor {t.name!r} has unknown dtype {t.dtype!r}")
            _validate_pieces(self, t)


def _validate_pieces(m: Manifest, t: ManifestTensor) -> None:
    itemsize = DTYPES[t.dtype].itemsize
    if not t.pieces:
        raise ManifestError(f"tensor {t.name!r} has no pieces")
    if not t.whole:
        dim = t.pieces[0].dim
        if not 0 <= dim < len(t.shape):
            raise ManifestError(f"tensor {t.name!r}: piece dimension {dim} is outside its shape {t.shape}")
        pos = 0
        for p in t.pieces:
            if p.dim != dim or p.start != pos or p.length <= 0:
                raise ManifestError(f"tensor {t.name!r}: pieces do not tile dimension {dim} of {t.shape} "
                                    f"(a piece at {p.start}+{p.length} along {p.dim}, expected start {pos})")  # fmt: skip
            pos += p.length
        if pos != t.shape[dim]:
            raise ManifestError(f"tensor {t.name!r}: pieces cover {pos} of {t.shape[dim]} along dimension {dim}")
    for p in t.pieces:
        if p.encoding not in ENCODINGS:
            raise ManifestError(f"tensor {t.name!r}: piece encoding {p.encoding!r} is not one of {list(ENCODINGS)}")
        if m.kind == "full" and p.encoding != "raw":
            raise ManifestError(f"tensor {t.name!r}: a full version stores raw pieces, not {p.encoding!r}")
        raw = math.prod(p.shape(t.shape)) * itemsize
        if p.encoding == "raw" and p.nbytes != raw:
            raise ManifestError(f"tensor {t.name!r}: raw piece of {p.nbytes} bytes, its shape x {t.dtype} is {raw}")
        if p.encoding == "same" and p.nbytes != 0:
            raise ManifestError(f"tensor {t.name!r}: an unchanged ('same') piece stores {p.nbytes} bytes, not 0")
        if p.nbytes and (not 0 <= p.bucket < len(m.buckets) or p.offset + p.nbytes > m.buckets[p.bucket].nbytes):
            raise ManifestError(f"tensor {t.name!r}: a piece lies outside its bucket {p.bucket}")


def merge_rank_tensors(parts: Iterable[Iterable[ManifestTensor]]) -> list[ManifestTensor]:
    """The tensors of several ranks' parts (in rank order) as one list, each tensor's pieces in order along their
    dimension; ValueError when two ranks disagree on a tensor's dtype or shape."""
    merged: dict[str, ManifestTensor] = {}
    for part in parts:
        for t in part:
            have = merged.get(t.name)
            if have is None:
                merged[t.name] = ManifestTensor(t.name, t.dtype, t.shape, list(t.pieces))
            elif (have.dtype, have.shape) != (t.dtype, t.shape):
                raise ValueError(f"weights: ranks disagree on tensor {t.name!r}: {have.dtype} {have.shape} vs "
                                 f"{t.dtype} {t.shape}")  # fmt: skip
            else:
                have.pieces.extend(t.pieces)
    for t in merged.values():
        t.pieces.sort(key=lambda p: p.start)
    return list(merged.values())


def plan_sizes(sizes: Iterable[int], bucket_bytes: int) -> tuple[list[tuple[int, int]], list[int]]:
    """Place payloads of ``sizes`` bytes (in order) into buckets of about ``bucket_bytes``: (bucket, offset) of
    each, and the bucket sizes. Empty payloads take no room (bucket 0, offset 0)."""
    if bucket_bytes <= 0:
        raise ValueError("weights.bucket_bytes must be > 0")
    places: list[tuple[int, int]] = []
    buckets: list[int] = []
    fill = 0
    for nbytes in sizes:
        if nbytes == 0:
            places.append((0, 0))
            continue
        start = _aligned(fill)
        if not buckets or (fill > 0 and start + nbytes > bucket_bytes):
            buckets.append(0)
            start = 0
        places.append((len(buckets) - 1, start))
        fill = start + nbytes
        buckets[-1] = fill
    return places, buckets


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
