"""``wsum64``: the checksum of a weight bucket computed where its bytes are (the learner's or a reader's GPU).

The GPU path (:mod:`async_rl.weights.gpu.publisher`) must not bring a version to the host to hash it, and
xxh3 has no GPU kernel in torch. ``wsum64`` is made of two torch reductions that need no temporary copy:

* the bucket, padded with zeros to a multiple of :data:`ALIGN_BYTES`, is read as a matrix of 32-bit words,
  :data:`ROW_WORDS` to a row;
* each row and each column is summed modulo 2**32 (int32 sums wrap; integer addition is associative, so the
  result does not depend on the order a GPU reduces in);
* the row sums and the column sums are weighted by fixed odd 64-bit multipliers of their position and added
  modulo 2**64.

A flipped bit changes one row sum; bytes moved to another row (an offset error, a stale or foreign buffer)
change two weighted row sums, bytes moved inside a row two weighted column sums. It guards against the
mistakes of a copy path (wrong handle, offset, version), not against an adversary: the manifest's HMAC
(:mod:`async_rl.weights.signing`) and the same-host boundary are the trust story. Two reads of the bucket:
about 2.6 ms for 3.3 GB on an H100. The same function runs on the CPU, here in torch and in
:mod:`async_rl.weights.checksums` in numpy (``CHECKSUMS['wsum64']``, incremental too): tests check that they agree.
"""

from __future__ import annotations

import functools

import torch

from async_rl.weights.checksums import _WSUM_COLUMN_SALT, WSUM_ROW_WORDS, wsum_multipliers

ROW_WORDS = WSUM_ROW_WORDS
"""32-bit words summed per row: 4 KiB rows, so a GPU reduces long contiguous runs."""
ALIGN_BYTES = ROW_WORDS * 4
"""A ``wsum64`` bucket's size is a multiple of this (GPU buckets are allocated padded with zeros)."""


def padded(nbytes: int) -> int:
    """``nbytes`` rounded up to :data:`ALIGN_BYTES`."""
    return -(-nbytes // ALIGN_BYTES) * ALIGN_BYTES


@functools.lru_cache(maxsize=32)
def _multipliers(n: int, salt: int, device: str) -> torch.Tensor:
    """``n`` odd int64 multipliers of positions 1..n (the host's, :func:`async_rl.weights.checksums.wsum_multipliers`), cached
    on ``device`` per length."""
    return torch.from_numpy(wsum_multipliers(0, n, salt)).to(device)


def wsum64(buf: torch.Tensor) -> torch.Tensor:
    """The checksum of ``buf`` (uint8, contiguous, size a multiple of :data:`ALIGN_BYTES`) as a 0-d int64 tensor on
    its device; queued on the current stream, nothing waits for it."""
    if buf.dtype != torch.uint8 or buf.dim() != 1:
        raise ValueError(f"wsum64 takes a flat uint8 tensor, got {buf.dtype} of shape {tuple(buf.shape)}")
    if buf.numel() % ALIGN_BYTES:
        raise ValueError(f"wsum64: {buf.numel()} bytes is not a multiple of {ALIGN_BYTES}")
    if buf.numel() == 0:
        return torch.zeros((), dtype=torch.int64, device=buf.device)
    words = buf.view(torch.int32).view(-1, ROW_WORDS)
    return _weighted(words.sum(dim=1, dtype=torch.int32), words.sum(dim=0, dtype=torch.int32))


def _weighted(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """The checksum from the int32 (wrapped) sums of every row and of every column."""
    device = str(rows.device)
    rows, cols = rows.to(torch.int64), cols.to(torch.int64)
    col_weights = _multipliers(ROW_WORDS, _WSUM_COLUMN_SALT, device)
    return (rows * _multipliers(rows.numel(), 0, device)).sum() + (cols * col_weights).sum()


def wsum64_region(buf: torch.Tensor, offset: int, nbytes: int) -> torch.Tensor:
    """The checksum of ``nbytes`` bytes of ``buf`` (flat uint8) from ``offset`` (a multiple of 4), as :func:`wsum64` of
    those bytes alone zero-padded: the bytes of a piece in a bucket, without a copy of it. The bytes from ``offset +
    nbytes`` to the next multiple of 4 must be zeros in ``buf`` (padding, as in every bucket). Queued on the current
    stream, a 0-d int64 tensor."""
    if buf.dtype != torch.uint8 or buf.dim() != 1 or offset % 4:
        raise ValueError(f"wsum64_region takes a flat uint8 tensor and an offset that is a multiple of 4, got "
                         f"{buf.dtype} {tuple(buf.shape)} at {offset}")  # fmt: skip
    end = offset + -(-nbytes // 4) * 4
    if end > buf.numel():
        raise ValueError(f"wsum64_region: {nbytes} bytes at {offset} run past the buffer's {buf.numel()}")
    words = buf[offset:end].view(torch.int32)
    full = words.numel() // ROW_WORDS * ROW_WORDS
    main = words[:full].view(-1, ROW_WORDS)
    tail = torch.zeros(ROW_WORDS, dtype=torch.int32, device=buf.device)
    tail[: words.numel() - full] = words[full:]
    rows = torch.cat([main.sum(dim=1, dtype=torch.int32), tail.sum(dim=0, dtype=torch.int32).view(1)])
    return _weighted(rows, main.sum(dim=0, dtype=torch.int32) + tail)  # int32 addition wraps, as the sums do


def to_unsigned(value: int) -> int:
    """A checksum as the unsigned 64-bit integer manifests carry."""
    return value & 0xFFFFFFFFFFFFFFFF
