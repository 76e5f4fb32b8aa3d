"""A GPU-held version's manifest for tests without a GPU: the learner's GPU slots filled on the CPU device, and IPC
handles made up (nothing may map them: the copier under test stands where a vLLM worker's copy is)."""

from __future__ import annotations

import time

from async_rl.weights.gpu.cuda_ipc import IpcHandle, host_key
from async_rl.weights.gpu.slots import GpuSlots
from async_rl.weights.manifest import GPU_CHECKSUM, GPU_TRANSPORT, IpcPlacement, Manifest
from async_rl.weights.snapshot import Piece


def gpu_manifest(version: int, pieces: list[Piece]) -> Manifest:
    """The manifest the learner's publisher commits for ``pieces`` as ``version`` (validated)."""
    slots = GpuSlots("cpu", num_slots=2, bucket_bytes=2048)
    tensors, buckets = slots.manifest_parts(slots.fill(0, version, pieces).wait())
    handles = [IpcHandle(f"GPU-{i}", bytes([i]) * 64, 1 << 20, 0, b"rc", 8, b"ev" * 32, True)
               for i in range(len(buckets))]
    m = Manifest(version=version, tensors=tensors, buckets=buckets, transport=GPU_TRANSPORT, checksum=GPU_CHECKSUM,
                 full_version=version, taken_at=time.time(), ipc=IpcPlacement(host_key(), handles))  # fmt: skip
    m.validate()
    return m
