"""The GPU weight path's host-testable parts: the wsum64 checksum (torch and numpy agree), GPU slots planned and
filled (on the CPU device), and GPU manifests (IPC placement encoded, signed and validated)."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from async_rl.weights.checksums import CHECKSUMS, checksum_stream
from async_rl.weights.gpu.checksum import ALIGN_BYTES, padded, to_unsigned, wsum64
from async_rl.weights.gpu.cuda_ipc import IpcHandle, host_key
from async_rl.weights.gpu.slots import GpuSlots
from async_rl.weights.manifest import GPU_CHECKSUM, GPU_TRANSPORT, IpcPlacement, Manifest, ManifestError
from async_rl.weights.snapshot import Piece


def _torch_sum(data: bytes) -> int:
    buf = torch.zeros(padded(len(data)), dtype=torch.uint8)
    buf.numpy()[: len(data)] = np.frombuffer(data, dtype=np.uint8)
    return to_unsigned(int(wsum64(buf)))


@pytest.mark.parametrize("n", [0, 1, 4095, 4096, 4097, 100_003, 3 << 20])
def test_wsum64_is_the_same_in_torch_in_numpy_and_incrementally(n: int) -> None:
    data = os.urandom(n)
    one_shot = CHECKSUMS["wsum64"](memoryview(data))
    stream = checksum_stream("wsum64")
    for start in range(0, n, 65_537):  # uneven chunks
        stream.update(memoryview(data)[start : start + 65_537])
    assert _torch_sum(data) == one_shot == stream.intdigest()


def test_wsum64_sees_a_flipped_bit_and_moved_bytes() -> None:
    data = bytearray(os.urandom(4 * ALIGN_BYTES))
    base = _torch_sum(bytes(data))
    flipped = bytearray(data)
    flipped[12_345] ^= 0x10
    rows = bytearray(data)
    rows[:ALIGN_BYTES], rows[ALIGN_BYTES : 2 * ALIGN_BYTES] = data[ALIGN_BYTES : 2 * ALIGN_BYTES], data[:ALIGN_BYTES]
    words = bytearray(data)
    words[0:4], words[4:8] = data[4:8], data[0:4]
    shifted = bytes(64) + bytes(data[:-64])
    for changed in (flipped, rows, words, shifted):
        assert _torch_sum(bytes(changed)) != base


def test_wsum64_refuses_what_it_cannot_sum() -> None:
    with pytest.raises(ValueError, match="multiple of 4096"):
        wsum64(torch.zeros(100, dtype=torch.uint8))
    with pytest.raises(ValueError, match="flat uint8"):
        wsum64(torch.zeros(4096, dtype=torch.float32))


def _pieces(seed: int, start: int | None = None) -> list[Piece]:
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(6, 10, generator=g)
    qkv = Piece("qkv.weight", full) if start is None else Piece("qkv.weight", full[start : start + 3], (6, 10), 0, start)
    return [
        Piece("embed.weight", torch.randn(50, 16, generator=g)),
        Piece("norm.weight", torch.randn(16, generator=g)),
        Piece("steps", torch.tensor([seed], dtype=torch.int64)),
        qkv,
    ]


def test_slots_hold_versions_in_the_generators_dtype_with_checksums_of_their_bytes() -> None:
    slots = GpuSlots("cpu", num_slots=2, bucket_bytes=1024, dtype=torch.bfloat16)
    fills = [slots.fill(v % 2, v, _pieces(v)) for v in (1, 2)]
    for fill in fills:
        sums = fill.wait()
        tensors, buckets = slots.manifest_parts(sums)
        m = Manifest(version=fill.version, tensors=tensors, buckets=buckets, transport=GPU_TRANSPORT,
                     checksum=GPU_CHECKSUM, full_version=fill.version)  # fmt: skip
        m.validate()
        assert len(buckets) > 1 and all(b.nbytes % ALIGN_BYTES == 0 for b in buckets)
        for bucket, buf in zip(buckets, slots._buffers[fill.slot] or [], strict=True):
            assert bucket.checksum == CHECKSUMS["wsum64"](memoryview(buf.numpy()))  # the reader's check, on the host
        got = {p.name: p.tensor for p in slots.tensors(fill.slot)}
        for p in _pieces(fill.version):
            want = p.tensor.to(torch.bfloat16) if p.tensor.is_floating_point() else p.tensor
            assert got[p.name].dtype == want.dtype and torch.equal(got[p.name], want), p.name
    assert fills[0].slot != fills[1].slot
    with pytest.raises(ValueError, match="changed during the run"):
        slots.fill(0, 3, [Piece("embed.weight", torch.zeros(51, 16))])


def test_two_ranks_slots_make_one_valid_version() -> None:
    parts = []
    for rank, start in ((0, 0), (1, 3)):
        slots = GpuSlots("cpu", num_slots=2, bucket_bytes=2048, rank=rank)
        pieces = [p for p in _pieces(5, start) if rank == 0 or p.name == "qkv.weight"]
        parts.append(slots.manifest_parts(slots.fill(0, 5, pieces).wait(), first_bucket=10 * rank))
    qkv = [t for tensors, _ in parts for t in tensors if t.name == "qkv.weight"]
    assert [(t.pieces[0].start, t.pieces[0].length, t.pieces[0].rank) for t in qkv] == [(0, 3, 0), (3, 3, 1)]
    assert parts[1][1][0].index == 10


def _handle(i: int) -> IpcHandle:
    return IpcHandle(f"GPU-{i}", bytes([i]) * 64, 1 << 20, 4096 * i, b"rc", 8, b"ev" * 32, True)


def test_gpu_manifests_carry_their_ipc_placement_signed() -> None:
    slots = GpuSlots("cpu", num_slots=2, bucket_bytes=2048)
    fill = slots.fill(0, 7, _pieces(7))
    tensors, buckets = slots.manifest_parts(fill.wait())
    placement = IpcPlacement(host_key(), [_handle(i) for i in range(len(buckets))])
    m = Manifest(version=7, tensors=tensors, buckets=buckets, transport=GPU_TRANSPORT, checksum=GPU_CHECKSUM,
                 full_version=7, taken_at=123.5, ipc=placement)  # fmt: skip
    key = b"k" * 32
    back = Manifest.decode(m.encode(key), key)
    assert back.ipc == placement and back.taken_at == 123.5 and back.buckets == buckets
    with pytest.raises(ManifestError, match="HMAC"):
        Manifest.decode(m.encode(b"other" * 8), key)
    short = Manifest(version=7, tensors=tensors, buckets=buckets, transport=GPU_TRANSPORT, checksum=GPU_CHECKSUM,
                     full_version=7, ipc=IpcPlacement(host_key(), placement.handles[:-1]))  # fmt: skip
    with pytest.raises(ManifestError, match="IPC handles"):
        short.validate()
    wrong = Manifest(version=7, tensors=tensors, buckets=buckets, transport=GPU_TRANSPORT, checksum="xxh3_64",
                     full_version=7, ipc=placement)  # fmt: skip
    with pytest.raises(ManifestError, match="wsum64"):
        wrong.validate()


def test_gpu_path_settings_are_checked_and_named() -> None:
    from async_rl.weights.config import PublisherConfig, ReaderConfig

    for kwargs, key in (({"gpu": "maybe"}, "publisher.gpu"), ({"gpu_slots": 1}, "publisher.gpu_slots"),
                        ({"gpu_dtype": "int8"}, "publisher.gpu_dtype"), ({"gpu_bucket_bytes": 0}, "gpu_bucket_bytes")):
        with pytest.raises(ValueError, match=key):
            PublisherConfig(**kwargs)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="gpu_lease_ttl_s"):
        ReaderConfig(gpu_lease_ttl_s=0)
    with pytest.raises(ValueError, match=r"gpu_lease_max_s \(1.0\) must be >= gpu_lease_ttl_s \(2.0\)"):
        ReaderConfig(gpu_lease_max_s=1.0)


def test_a_vllm_workers_copies_agree_or_say_why() -> None:
    """What vLLM's workers answer to a GPU copy, checked in the engine's process: every tensor-parallel rank's
    checksums the same (else CorruptVersion), every rank able to map the learner's buffers (else IpcUnavailable), and
    the copy done when the last rank had read them."""
    from actors.generator.vllm_worker_copies import copies_agree
    from async_rl.weights.gpu.cuda_ipc import IpcUnavailable
    from async_rl.weights.reader import CorruptVersion

    copied = copies_agree([{"sums": [1, 2], "copied_at": 3.0}, {"sums": [1, 2], "copied_at": 4.5}], 7)
    assert copied.sums == [1, 2] and copied.copied_at == 4.5
    with pytest.raises(CorruptVersion, match="v7: tensor-parallel rank 1 copied other bytes than rank 0"):
        copies_agree([{"sums": [1, 2], "copied_at": 3.0}, {"sums": [1, 3], "copied_at": 3.0}], 7)
    with pytest.raises(IpcUnavailable, match="cannot map the learner's GPU buffers: no peer access"):
        copies_agree([{"sums": [1, 2], "copied_at": 3.0}, {"unavailable": "no peer access"}], 7)
