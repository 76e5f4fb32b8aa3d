"""Weight versions for the host transport, encoded where they are: on the learner's GPU.

Generators that cannot map the learner's GPU (other hosts, another namespace) take versions through a host transport
(Redis, shm, ``peer://``). A version kept in a GPU slot (:mod:`.gpu_slots`) is encoded for them on the GPU, on a side
stream, and only what goes on the wire crosses to pinned host memory:

* a **full** version: every piece ``raw``;
* a **delta** from the last version sent (a copy of it kept on the GPU, in the slots' layout: the *base*): per piece,
  the elements whose bit pattern changed, compacted on the GPU into a ``sparse`` payload (their new values, then their
  int32 indices; :func:`~async_rl.weights.delta.sparse_nbytes`), ``same`` where none changed, ``raw`` where a sparse
  payload would not be smaller;
* the checksums (``wsum64``): of every piece's full contents (readers check what they rebuild) and of every bucket
  (readers and relays check what they receive), both computed on the GPU.

A version goes out as a delta only when that is faster than sending it whole at the link's measured rate, counting the
readers' rebuild of the pieces that changed (:data:`REBUILD_BYTES_PER_S`). The host plans the buckets from the GPU's
per-piece change counts (one small copy) and hands the pinned buckets to the transport: it never hashes, compresses or
copies a full version. One bucket at a time is packed in a reused GPU buffer, checksummed and copied to its pinned
buffer; pinned buffers are reused from version to version (valid until the next :meth:`GpuEncoder.encode`). The slot's
own buckets are read in order, each once a pass (:meth:`~async_rl.weights.gpu.slots.WholeVersion.bucket_reader`), so a
version held on several GPUs (rank 0's mirror of every rank's slot) needs room here for one of its buckets only, and
the base moves bucket by bucket as the packing passes them.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from async_rl.weights.delta import SPARSE_INDEX_BYTES, sparse_nbytes
from async_rl.weights.gpu.checksum import padded, to_unsigned, wsum64, wsum64_region
from async_rl.weights.gpu.slots import WholeVersion
from async_rl.weights.manifest import ManifestTensor, plan_sizes

log = logging.getLogger(__name__)

REBUILD_BYTES_PER_S = 3e9
"""What a reader rebuilds per second of the pieces a delta changed (a copy of its held piece, the changed elements
written, the result hashed): 1.5-2 GB/s on one thread of the 2-core CPU machine (numpy), pieces rebuilt on two threads
there (:data:`~async_rl.weights.delta.PIECE_THREADS`). A delta has to save more link time than this costs."""
_MAX_SPARSE_ELEMENTS = 2**31 - 1
_INTS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


@dataclass(slots=True)
class EncodedVersion:
    """One version encoded for the host transport: its buckets (pinned host memory) and what the manifest says."""

    version: int
    kind: str
    """``full`` or ``delta``."""
    base: int
    """The version a delta applies to (-1: full)."""
    tensors: list[ManifestTensor]
    """Pieces with bucket indices from 0."""
    buckets: list[memoryview]
    """Each bucket's bytes (padded with zeros to a multiple of 4 KiB): valid until the next encode."""
    sums: list[int]
    """``wsum64`` of each bucket."""
    full_bytes: int
    encode_s: float
    """Seconds from the start of the encode to the buckets in host memory."""
    changed_frac: float
    """Elements whose bit pattern changed since the base (1.0 for a version encoded without a base)."""
    reason: str
    """Why it is full or a delta (logged, and in the tests)."""


def _ints(t: torch.Tensor, itemsize: int) -> torch.Tensor:
    """``t``'s bytes (flat uint8) as integers of ``itemsize`` bytes."""
    return t.view(_INTS[itemsize])


class GpuEncoder:
    """Encodes whole versions held on the GPU (:class:`~async_rl.weights.gpu.slots.WholeVersion`) for the host
    transport (module docstring)."""

    bucket_bytes: int
    delta: bool
    base_version: int
    """The version the base holds (-1: none)."""
    _base: list[torch.Tensor] | None
    _host: list[torch.Tensor]
    _staging: torch.Tensor | None
    _stream: torch.cuda.Stream | None

    def __init__(self, bucket_bytes: int, *, delta: bool = True) -> None:
        self.bucket_bytes = bucket_bytes
        self.delta = delta
        self.base_version = -1
        self._base = None
        self._host = []
        self._staging = None
        self._stream = None

    @property
    def device_bytes(self) -> int:
        """GPU bytes held: the base and the packing buffer."""
        base = sum(b.numel() for b in self._base) if self._base is not None else 0
        return base + (self._staging.numel() if self._staging is not None else 0)

    def encode(self, slots: WholeVersion, slot: int, version: int, *, full: bool, base_version: int,
               link_bytes_per_s: float | None) -> EncodedVersion:  # fmt: skip
        """Encode the version ``slot`` holds: full when ``full`` (or no base holds ``base_version``), else a delta from
        ``base_version`` when that is faster at ``link_bytes_per_s`` (None: not measured yet, fewer bytes wins).
        Blocks until its buckets are in host memory (call it in a worker thread)."""
        t0 = time.perf_counter()
        cuda = slots.device.type == "cuda"
        if cuda and self._stream is None:
            self._stream = torch.cuda.Stream(device=slots.device)
        with torch.no_grad(), torch.cuda.stream(self._stream) if cuda else contextlib.nullcontext():
            enc = self._encode(slots, slot, version, full, base_version, link_bytes_per_s, cuda)
        enc.encode_s = time.perf_counter() - t0
        return enc

    def _encode(self, slots: WholeVersion, slot: int, version: int, full: bool, base_version: int,
                link: float | None, cuda: bool) -> EncodedVersion:  # fmt: skip
        placed = slots.placed
        reason = "asked for full"
        if not full and (self._base is None or self.base_version != base_version or base_version < 0):
            full, reason = True, f"no base v{base_version} on the GPU (it holds v{self.base_version})"
        use_base = not full and self._base is not None
        # One pass over the buckets (each read once, in order): every piece's checksum and, against the base, how many
        # of its elements changed.
        sums_q, counts_q = [], []
        read = _Buckets(slots.bucket_reader(slot))
        for x in placed:
            buf = read.get(x.bucket, x.nbytes)
            sums_q.append(wsum64_region(buf, x.offset, x.nbytes))
            if use_base:
                assert self._base is not None
                new, old = buf[x.offset : x.offset + x.nbytes], self._base[x.bucket][x.offset : x.offset + x.nbytes]
                counts_q.append(torch.count_nonzero(_ints(new, x.dtype.itemsize) != _ints(old, x.dtype.itemsize)))
        host = torch.stack(sums_q + counts_q).cpu().tolist() if sums_q else []  # the one wait before packing
        piece_sums = [to_unsigned(s) for s in host[: len(placed)]]
        changed = host[len(placed) :]
        full_bytes = sum(x.nbytes for x in placed)
        numel = sum(x.nbytes // x.dtype.itemsize for x in placed)
        encodings = ["raw"] * len(placed)
        sizes = [x.nbytes for x in placed]
        changed_frac = 1.0
        if use_base:
            changed_frac = sum(changed) / max(numel, 1)
            for i, (x, k) in enumerate(zip(placed, changed, strict=True)):
                if k == 0:
                    encodings[i], sizes[i] = "same", 0
                elif x.nbytes // x.dtype.itemsize <= _MAX_SPARSE_ELEMENTS and sparse_nbytes(k, x.dtype.itemsize) < x.nbytes:
                    encodings[i], sizes[i] = "sparse", sparse_nbytes(k, x.dtype.itemsize)
            rebuilt = sum(x.nbytes for x, e in zip(placed, encodings, strict=True) if e == "sparse")
            faster, why = _delta_faster(sum(sizes), rebuilt, full_bytes, link)
            reason = f"{changed_frac:.1%} of the elements changed: {why}"
            if not faster:
                encodings, sizes, use_base = ["raw"] * len(placed), [x.nbytes for x in placed], False
        places, bucket_sizes = plan_sizes(sizes, self.bucket_bytes)
        keep = self._base_for(slots)  # the version being encoded becomes the base of the next delta, bucket by bucket
        self.base_version = -1  # until every bucket of it is in the base
        read = _Buckets(slots.bucket_reader(slot), keep)
        packed = self._pack(version, placed, read, self._base if use_base else None, changed if use_base else [],
                            encodings, places, bucket_sizes, slots.device, cuda)  # fmt: skip
        sums = [to_unsigned(s) for s in packed.cpu().tolist()]  # the buckets in host memory, the base moved
        if keep is not None:
            self.base_version = version
        tensors = [x.entry(b, o, n, s, e)
                   for x, (b, o), n, s, e in zip(placed, places, sizes, piece_sums, encodings, strict=True)]
        kind = "delta" if use_base else "full"
        return EncodedVersion(version, kind, base_version if use_base else -1, tensors,
                              [self._host[i][: padded(n)].numpy().data for i, n in enumerate(bucket_sizes)], sums,
                              full_bytes, 0.0, changed_frac, reason)  # fmt: skip

    def _pack(self, version, placed, read, base, changed, encodings, places, bucket_sizes, device, cuda) -> torch.Tensor:  # type: ignore[no-untyped-def]
        """Each bucket packed in the GPU buffer, checksummed, copied to its pinned buffer (queued, nothing waits); the
        bucket checksums (int64, on the GPU). The slot's buckets are read in order (``read``), each once."""
        largest = padded(max(bucket_sizes, default=0))
        if self._staging is None or self._staging.numel() < largest:
            self._staging = None
            self._staging = torch.empty(largest, dtype=torch.uint8, device=device)
        for i, n in enumerate(bucket_sizes):
            if i == len(self._host) or self._host[i].numel() < padded(n):
                buf = torch.empty(padded(n), dtype=torch.uint8, pin_memory=cuda)
                self._host[i : i + 1] = [buf]
        by_bucket: list[list[int]] = [[] for _ in bucket_sizes]
        for j, (bucket, _) in enumerate(places):
            if encodings[j] != "same":
                by_bucket[bucket].append(j)
        sums = []
        for i, n in enumerate(bucket_sizes):
            out = self._staging[: padded(n)]
            out.zero_()  # the gaps between payloads: deterministic bytes under the checksum
            for j in by_bucket[i]:
                x, offset = placed[j], places[j][1]
                region = read.get(x.bucket, x.nbytes)[x.offset : x.offset + x.nbytes]
                if encodings[j] == "raw":
                    out[offset : offset + x.nbytes].copy_(region)
                    continue
                itemsize, k = x.dtype.itemsize, changed[j]
                new = _ints(region, itemsize)
                index = (new != _ints(base[x.bucket][x.offset : x.offset + x.nbytes], itemsize)).nonzero().view(-1)
                if index.numel() != k:  # the slot changed under the encoder: a bug, never a wrong delta
                    raise RuntimeError(f"weights v{version}: {x.name!r} changed while it was encoded")
                _ints(out[offset : offset + k * itemsize], itemsize).copy_(new[index])
                at = offset + sparse_nbytes(k, itemsize) - k * SPARSE_INDEX_BYTES
                out[at : at + k * SPARSE_INDEX_BYTES].view(torch.int32).copy_(index)
            sums.append(wsum64(out))
            self._host[i][: padded(n)].copy_(out, non_blocking=cuda)  # the next bucket's packing waits for it (one stream)
        read.finish()  # the buckets no piece was packed from hold no change: the base has them already
        return torch.stack(sums) if sums else torch.zeros(0, dtype=torch.int64, device=device)

    def _base_for(self, slots: WholeVersion) -> list[torch.Tensor] | None:
        """The base's buckets, allocated in the slots' layout the first time (None: deltas are off, or no GPU memory
        for them)."""
        if not self.delta:
            return None
        sizes = slots.bucket_nbytes
        if self._base is None or [b.numel() for b in self._base] != sizes:
            self._base = None
            try:
                self._base = [torch.empty(n, dtype=torch.uint8, device=slots.device) for n in sizes]
            except torch.cuda.OutOfMemoryError:
                log.warning("weights: no GPU memory for the base of host deltas (%.1f GB): versions for other hosts go "
                            "out full (publisher.delta=false says so up front)", sum(sizes) / 1e9)  # fmt: skip
                self.delta, self.base_version = False, -1
                return None
        return self._base


class _Buckets:
    """A slot's buckets read in order, one at a time (:meth:`WholeVersion.bucket_reader`); with ``keep``, each bucket
    read is copied into the base once the reading moves past it (a bucket is never read again after that)."""

    def __init__(self, reader: Callable[[int], torch.Tensor], keep: list[torch.Tensor] | None = None) -> None:
        self.reader, self.keep = reader, keep
        self.index = -1
        self.buf: torch.Tensor | None = None
        self.seen: set[int] = set()

    def get(self, index: int, nbytes: int) -> torch.Tensor:
        """Bucket ``index`` (for an empty piece, whichever bucket is at hand: none of its bytes are read)."""
        if self.buf is not None and (index == self.index or nbytes == 0):
            return self.buf
        if index in self.seen:
            raise RuntimeError(f"weights: bucket {index} read again after the encoder moved past it")
        self._leave()
        buf = self.reader(index)
        self.index, self.buf = index, buf
        return buf

    def _leave(self) -> None:
        if self.buf is not None:
            self.seen.add(self.index)
            if self.keep is not None:
                self.keep[self.index].copy_(self.buf)
        self.index, self.buf = -1, None

    def finish(self) -> None:
        """The last bucket read moves to the base."""
        self._leave()


def _delta_faster(delta_bytes: int, rebuilt_bytes: int, full_bytes: int, link: float | None) -> tuple[bool, str]:
    """Whether a delta of ``delta_bytes`` (readers rebuilding ``rebuilt_bytes``) beats ``full_bytes`` at ``link``
    bytes/s (None: not measured yet, fewer bytes wins), and why."""
    sizes = f"{delta_bytes / 1e6:.1f} of {full_bytes / 1e6:.1f} MB"
    if link is None:
        return delta_bytes < full_bytes, f"{sizes}, link not measured yet"
    delta_s = delta_bytes / link + rebuilt_bytes / REBUILD_BYTES_PER_S
    full_s = full_bytes / link
    return delta_s < full_s, f"{sizes}, {delta_s:.3f} s against {full_s:.3f} s whole at {link / 1e9:.2f} GB/s"
