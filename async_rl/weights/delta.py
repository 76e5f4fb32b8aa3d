"""Delta payloads: a piece of version v stored as what changed since the same piece of version ``base``.

Encoding ``xor-zstd``: the XOR of the two versions' bit patterns (zero wherever a value did not change), its bytes
regrouped by position in the element (byte shuffle: all first bytes, then all second bytes, ...; sign, exponent and
high mantissa bytes rarely change, so their planes are runs of zeros), then zstd (level ``zstd_level``). A piece
whose XOR is all zero is ``same`` (no bytes); one whose encoding is not smaller than its raw bytes stays ``raw``.
The reader XORs the decoded bytes into its copy of ``base`` and checks the result against the checksum of the full
piece, so a delta is exact or refused.

Encoding ``sparse`` (written on the learner's GPU, :mod:`.gpu_encoder`: no CPU pass over the version): the new values
of the ``k`` elements that changed, then, at the next multiple of 4 bytes, their int32 element indices in the piece
(:func:`sparse_nbytes`). The reader copies its ``base`` piece and writes the values at those indices; the same checksum
check makes it exact or refused.

Measured on the quickstart's model at its learning rate (one AdamW step, fp32 and bf16 bit patterns, ratio of
stored to raw bytes): zstd-1 of the shuffled XOR 0.68 / 0.35, without the shuffle 0.79 / 0.43, lz4 of the
shuffled XOR 0.78 / 0.57; zstd-1 is the smallest at 0.2-0.8 GB/s on this machine, in a background thread.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import numpy as np
import zstandard

ZSTD_MAX_LEVEL = 22
PIECE_THREADS = max(1, min(8, os.cpu_count() or 1))
"""Threads that encode (publisher) or decode and check (reader) pieces side by side: XOR, shuffle, zstd and the
checksum all release the GIL. On the H100 machine's 16 cores one thread encoded 214 MB of bf16 deltas in ~1 s,
which put the version a second behind the learner; past 8 threads memory bandwidth, not cores, is the limit."""

_T = TypeVar("_T")
_R = TypeVar("_R")
_pool: ThreadPoolExecutor | None = None


def map_pieces(fn: Callable[[_T], _R], items: Iterable[_T]) -> list[_R]:
    """``[fn(x) for x in items]`` on :data:`PIECE_THREADS` threads, in order; the first exception is raised."""
    global _pool
    items = list(items)
    if PIECE_THREADS == 1 or len(items) < 2:
        return [fn(x) for x in items]
    if _pool is None:
        _pool = ThreadPoolExecutor(PIECE_THREADS, thread_name_prefix="weights-piece")
    return list(_pool.map(fn, items))


def as_bytes(t) -> np.ndarray:  # type: ignore[no-untyped-def]
    """The bytes of a contiguous CPU tensor as a uint8 array (no copy)."""
    flat = t.reshape(-1)
    if flat.numel() == 0:
        return np.empty(0, dtype=np.uint8)
    import torch

    return flat.view(torch.uint8).numpy()


def _wide(a: np.ndarray) -> np.ndarray:
    """``a`` (uint8) viewed with the widest unsigned dtype its length allows: XOR runs 8 bytes at a time."""
    for dt in (np.uint64, np.uint32, np.uint16):
        if a.nbytes % np.dtype(dt).itemsize == 0 and a.ctypes.data % np.dtype(dt).itemsize == 0:
            return a.view(dt)
    return a


def xor(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """A new uint8 array ``a ^ b`` (same lengths)."""
    if a.nbytes != b.nbytes:
        raise ValueError(f"delta: XOR of {a.nbytes} and {b.nbytes} bytes")
    out = np.empty(a.nbytes, dtype=np.uint8)
    if _wide(out).dtype == _wide(a).dtype == _wide(b).dtype:
        np.bitwise_xor(_wide(a), _wide(b), out=_wide(out))
    else:
        np.bitwise_xor(a, b, out=out)
    return out


def shuffle(a: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1 or a.nbytes % itemsize:
        return a
    return np.ascontiguousarray(a.reshape(-1, itemsize).T).reshape(-1)


def unshuffle(a: np.ndarray, itemsize: int) -> np.ndarray:
    if itemsize == 1 or a.nbytes % itemsize:
        return a
    return np.ascontiguousarray(a.reshape(itemsize, -1).T).reshape(-1)


SPARSE_INDEX_BYTES = 4
"""Bytes of one element index of a ``sparse`` payload (int32: pieces of up to 2**31 elements)."""
_UINTS = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}


def sparse_nbytes(changed: int, itemsize: int) -> int:
    """Bytes of a ``sparse`` payload of ``changed`` elements of ``itemsize`` bytes: the values, padded to 4, then the
    indices."""
    return -(-changed * itemsize // SPARSE_INDEX_BYTES) * SPARSE_INDEX_BYTES + changed * SPARSE_INDEX_BYTES


def _sparse_decode(payload: memoryview, base: np.ndarray, itemsize: int) -> np.ndarray:
    changed = payload.nbytes // (SPARSE_INDEX_BYTES + itemsize)  # the padding (< 4 bytes) is below one element's share
    if sparse_nbytes(changed, itemsize) != payload.nbytes or itemsize not in _UINTS or base.nbytes % itemsize:
        raise ValueError(f"a sparse payload of {payload.nbytes} bytes does not hold whole {itemsize}-byte elements")
    start = sparse_nbytes(changed, itemsize) - changed * SPARSE_INDEX_BYTES
    values = np.frombuffer(payload, dtype=_UINTS[itemsize], count=changed)
    index = np.frombuffer(payload, dtype=np.int32, count=changed, offset=start)
    out = base.copy()  # never written in place: the engine may still be copying the held version
    words = out.view(_UINTS[itemsize])
    if changed and (int(index.min()) < 0 or int(index.max()) >= words.size):
        raise ValueError(f"a sparse payload indexes outside its piece of {words.size} elements")
    words[index] = values
    return out


def encode(new: np.ndarray, base: np.ndarray | None, itemsize: int, zstd_level: int) -> tuple[str, memoryview]:
    """(encoding, payload) of the piece ``new`` against ``base`` (None: no base, ``raw``). The ``raw`` payload is a
    view of ``new``: keep it alive and unchanged until it is written."""
    if base is None or new.nbytes == 0:
        return "raw", new.data
    x = xor(new, base)
    if not _wide(x).any():
        return "same", memoryview(b"")
    packed = zstandard.ZstdCompressor(level=zstd_level).compress(shuffle(x, itemsize).data)
    if len(packed) >= new.nbytes:
        return "raw", new.data
    return "xor-zstd", memoryview(packed)


def decode(encoding: str, payload: memoryview, base: np.ndarray | None, nbytes: int, itemsize: int) -> np.ndarray:
    """The piece's bytes from its payload (``base``: the same piece of the base version, for delta encodings);
    ValueError when the payload does not decode to ``nbytes``."""
    if encoding == "raw":
        if payload.nbytes != nbytes:
            raise ValueError(f"raw payload of {payload.nbytes} bytes, expected {nbytes}")
        return np.frombuffer(payload, dtype=np.uint8)
    if base is None:
        raise ValueError(f"a {encoding!r} payload needs the base version's piece")
    if base.nbytes != nbytes:
        raise ValueError(f"base piece of {base.nbytes} bytes, expected {nbytes}")
    if encoding == "same":
        if payload.nbytes:
            raise ValueError(f"an unchanged ('same') piece carries {payload.nbytes} bytes")
        return base
    if encoding == "xor-zstd":
        try:
            raw = zstandard.ZstdDecompressor().decompress(payload, max_output_size=nbytes)
        except zstandard.ZstdError as exc:
            raise ValueError(f"xor-zstd payload does not decode: {exc}") from None
        if len(raw) != nbytes:
            raise ValueError(f"xor-zstd payload decodes to {len(raw)} bytes, expected {nbytes}")
        return xor(unshuffle(np.frombuffer(raw, dtype=np.uint8), itemsize), base)
    if encoding == "sparse":
        return _sparse_decode(payload, base, itemsize)
    raise ValueError(f"unknown payload encoding {encoding!r}")
