"""Snapshots of one rank's weight pieces into reused host buffers: all the training loop waits for.

A :class:`Snapshotter` owns ``num_slots`` (two) sets of host buffers, allocated on the first snapshot and reused
(reallocated only when a piece's shape or dtype changes). :meth:`Snapshotter.take` copies the rank's pieces into a
free slot: on the CPU one memcpy per piece; from a GPU into pinned memory on a side CUDA stream (ordered after
the work already queued on the current stream, ``non_blocking`` device-to-host copies), waiting only for those
copies. After it returns the optimizer may change the weights: the snapshot is a consistent copy of one version.
A slot stays taken until :meth:`Snapshotter.release`: one holds the last published version (the base of the next
delta), the other the version going out, so host memory is bounded by two copies of the rank's pieces.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class Piece:
    """A rank's piece of one Hugging Face tensor: the whole tensor, or a slice along ``dim`` from ``start``."""

    name: str
    """Hugging Face parameter name."""
    tensor: torch.Tensor
    """This rank's part (any device)."""
    full_shape: tuple[int, ...] | None = None
    """Shape of the full tensor; None: ``tensor`` is the whole tensor."""
    dim: int = 0
    """Dimension of the full tensor the piece is a slice of."""
    start: int = 0
    """First index along ``dim``."""

    @property
    def whole(self) -> bool:
        return self.full_shape is None

    def check(self) -> None:
        """ValueError naming the piece when it does not fit its full tensor."""
        if self.full_shape is None:
            return
        shape = tuple(self.tensor.shape)
        full = tuple(self.full_shape)
        if not 0 <= self.dim < len(full) or len(shape) != len(full):
            raise ValueError(f"weights piece {self.name!r}: dim {self.dim} / shape {shape} do not fit {full}")
        same_elsewhere = all(a == b for i, (a, b) in enumerate(zip(shape, full, strict=True)) if i != self.dim)
        if not same_elsewhere or self.start < 0 or self.start + shape[self.dim] > full[self.dim]:
            raise ValueError(f"weights piece {self.name!r}: shape {shape} at {self.start} along {self.dim} "
                             f"lies outside the full shape {full}")  # fmt: skip


@dataclass(slots=True)
class Snapshot:
    """One version of a rank's pieces, in host buffers of a slot."""

    version: int
    pieces: list[Piece]
    """The pieces, their tensors host copies (contiguous, CPU)."""
    slot: int
    taken_at: float
    """time.perf_counter() when the copy started."""
    copy_s: float
    """Seconds the copy took (what the training loop waited)."""


class Snapshotter:
    """Reused host buffers for snapshots of one rank's pieces (see the module docstring)."""

    num_slots: int
    pin: bool
    _buffers: list[dict[str, torch.Tensor]]
    _taken: list[bool]
    _stream: torch.cuda.Stream | None

    def __init__(self, num_slots: int = 2) -> None:
        if num_slots < 1:
            raise ValueError("snapshot slots must be >= 1")
        self.num_slots = num_slots
        self.pin = False
        self._buffers = [{} for _ in range(num_slots)]
        self._taken = [False] * num_slots
        self._stream = None

    @property
    def host_bytes(self) -> int:
        """Host bytes held by all slots' buffers."""
        return sum(t.numel() * t.element_size() for slot in self._buffers for t in slot.values())

    def free_slot(self) -> int | None:
        for i, taken in enumerate(self._taken):
            if not taken:
                return i
        return None

    def release(self, snap: Snapshot | None) -> None:
        if snap is not None:
            self._taken[snap.slot] = False

    def _buffer(self, slot: int, name: str, src: torch.Tensor, cuda: bool) -> torch.Tensor:
        buf = self._buffers[slot].get(name)
        if buf is None or buf.shape != src.shape or buf.dtype != src.dtype:
            buf = torch.empty(src.shape, dtype=src.dtype, device="cpu", pin_memory=cuda)
            self._buffers[slot][name] = buf
        return buf

    def take(self, version: int, source: Iterable[Piece | tuple[str, torch.Tensor]]) -> Snapshot:
        """Copy ``source`` (this rank's pieces, or (name, tensor) pairs of whole tensors) into a free slot; waits
        only for the copies. RuntimeError when no slot is free (the caller coalesces instead)."""
        slot = self.free_slot()
        if slot is None:
            raise RuntimeError("no free snapshot slot: a version is still going out")
        t0 = time.perf_counter()
        pieces: list[Piece] = []
        names: set[str] = set()
        stream = None
        for item in source:
            piece = item if isinstance(item, Piece) else Piece(item[0], item[1])
            piece.check()
            if piece.name in names:
                raise ValueError(f"weights piece {piece.name!r} given twice by one rank")
            names.add(piece.name)
            src = piece.tensor.detach()
            cuda = src.device.type == "cuda"
            dst = self._buffer(slot, piece.name, src, cuda)
            if cuda:
                if stream is None:
                    if self._stream is None:
                        self._stream = torch.cuda.Stream(device=src.device)
                    stream = self._stream
                    stream.wait_stream(torch.cuda.current_stream(src.device))  # after the optimizer's writes
                with torch.cuda.stream(stream):
                    dst.copy_(src, non_blocking=True)
                    src.record_stream(stream)
            else:
                dst.copy_(src)
            pieces.append(Piece(piece.name, dst, piece.full_shape, piece.dim, piece.start))
        if stream is not None:
            stream.synchronize()
        for name in [n for n in self._buffers[slot] if n not in names]:
            del self._buffers[slot][name]  # a piece that is gone (the model changed) frees its buffer
        self._taken[slot] = True
        return Snapshot(version, pieces, slot, t0, time.perf_counter() - t0)
