"""The GPU encoder of host versions (async_rl/weights/gpu/encoder.py), run on the CPU: what it writes rebuilds, through
the reader's own decoding and checks, into the slot's version bit for bit; deltas only where they pay."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from async_rl.weights import delta
from async_rl.weights.checksums import CHECKSUMS
from async_rl.weights.gpu.encoder import GpuEncoder
from async_rl.weights.gpu.slots import GpuSlots
from async_rl.weights.manifest import BucketEntry, Manifest
from async_rl.weights.reader import _build
from async_rl.weights.snapshot import Piece


def _weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        "embed": torch.randn(300, 64, generator=g),  # big enough for two buckets of 32 KiB in bf16
        "norm": torch.ones(64),
        "odd": torch.randn(7, 3, generator=g),  # 21 elements: a piece that ends off a word boundary
        "flags": torch.tensor([True, False, True]),
        "steps": torch.arange(5, dtype=torch.int64),
    }


def _step(w: dict[str, torch.Tensor], frac: float, seed: int) -> dict[str, torch.Tensor]:
    """``w`` with about ``frac`` of embed's elements moved by one bf16 step and everything else unchanged."""
    g = torch.Generator().manual_seed(seed)
    out = {k: v.clone() for k, v in w.items()}
    mask = torch.rand(out["embed"].shape, generator=g) < frac
    out["embed"] = torch.where(mask, out["embed"] * 1.05 + 0.01, out["embed"])
    return out


def _fill(slots: GpuSlots, slot: int, version: int, w: dict[str, torch.Tensor]) -> None:
    slots.fill(slot, version, [Piece(k, v) for k, v in w.items()]).wait()


def _rebuild(enc, held: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:  # type: ignore[no-untyped-def]
    """What a reader builds from the encoded version: buckets checked, pieces decoded and checked (reader._build)."""
    hasher = CHECKSUMS["wsum64"]
    for data, want in zip(enc.buckets, enc.sums, strict=True):
        assert hasher(data) == want
    manifest = Manifest(
        version=enc.version, tensors=enc.tensors, checksum="wsum64", transport="redis", kind=enc.kind, base=enc.base,
        buckets=[BucketEntry(i, b.nbytes, s) for i, (b, s) in enumerate(zip(enc.buckets, enc.sums, strict=True))],
        full_version=enc.version if enc.kind == "full" else 0,
    )  # fmt: skip
    manifest.validate()
    return _build(manifest, [memoryview(bytearray(b)) for b in enc.buckets], held)


def _as_slot(w: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in w.items()}


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].view(-1).view(torch.uint8), b[k].contiguous().view(-1).view(torch.uint8)), k


def test_full_then_deltas_rebuild_bit_for_bit() -> None:
    slots = GpuSlots("cpu", num_slots=2, bucket_bytes=1 << 15, dtype=torch.bfloat16)
    enc = GpuEncoder(1 << 15)
    w = _weights()
    _fill(slots, 0, 1, w)
    v1 = enc.encode(slots, 0, 1, full=False, base_version=-1, link_bytes_per_s=None)
    assert v1.kind == "full" and "no base" in v1.reason
    held = _rebuild(v1, None)
    _equal(held, _as_slot(w))
    for version, frac in ((2, 0.01), (3, 0.0), (4, 0.2)):
        w = _step(w, frac, version)
        slot = version % 2
        _fill(slots, slot, version, w)
        out = enc.encode(slots, slot, version, full=False, base_version=version - 1, link_bytes_per_s=None)
        assert out.kind == "delta" and out.base == version - 1, out.reason
        encodings = {t.name: t.pieces[0].encoding for t in out.tensors}
        assert encodings["norm"] == encodings["flags"] == encodings["steps"] == "same"
        assert encodings["embed"] == ("same" if frac == 0 else "sparse")
        # 6 bytes a changed bf16 element (value, index), each bucket padded to 4 KiB
        assert sum(b.nbytes for b in out.buckets) <= max(3 * frac * v1.full_bytes * 1.1, 4096) if frac else not out.buckets
        held = _rebuild(out, held)
        _equal(held, _as_slot(w))


def test_a_delta_that_would_not_pay_goes_out_full() -> None:
    slots = GpuSlots("cpu", num_slots=2, bucket_bytes=1 << 15, dtype=torch.bfloat16)
    enc = GpuEncoder(1 << 15)
    w = _weights()
    _fill(slots, 0, 1, w)
    enc.encode(slots, 0, 1, full=True, base_version=-1, link_bytes_per_s=None)
    # Every element changed: a sparse payload is three times the raw bytes; the version goes out whole.
    w2 = {k: (~v if v.dtype == torch.bool else v + 1) for k, v in w.items()}
    _fill(slots, 1, 2, w2)
    out = enc.encode(slots, 1, 2, full=False, base_version=1, link_bytes_per_s=None)
    assert out.kind == "full" and {t.pieces[0].encoding for t in out.tensors} == {"raw"}
    _equal(_rebuild(out, None), _as_slot(w2))
    # A few changes, but a link faster than the readers' rebuild: whole again. A slow link: the delta.
    w3 = _step(w2, 0.3, 3)
    _fill(slots, 0, 3, w3)
    fast = enc.encode(slots, 0, 3, full=False, base_version=2, link_bytes_per_s=1e12)
    assert fast.kind == "full" and "GB/s" in fast.reason
    w4 = _step(w3, 0.01, 4)
    _fill(slots, 1, 4, w4)
    slow = enc.encode(slots, 1, 4, full=False, base_version=3, link_bytes_per_s=1e6)
    assert slow.kind == "delta", slow.reason
    # A base that is not the one asked for (a publish failed after encoding) gives a full version.
    _fill(slots, 0, 5, w4)
    out = enc.encode(slots, 0, 5, full=False, base_version=3, link_bytes_per_s=None)
    assert out.kind == "full" and "no base v3" in out.reason


def test_without_delta_every_version_is_full_and_no_base_is_kept() -> None:
    slots = GpuSlots("cpu", num_slots=2, bucket_bytes=1 << 15, dtype=torch.bfloat16)
    enc = GpuEncoder(1 << 15, delta=False)
    w = _weights()
    for version in (1, 2):
        _fill(slots, version % 2, version, w)
        out = enc.encode(slots, version % 2, version, full=False, base_version=version - 1, link_bytes_per_s=None)
        assert out.kind == "full"
    assert enc.device_bytes == enc._staging.numel()  # type: ignore[union-attr]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.uint8, torch.int64])
def test_sparse_payloads_decode_and_refuse_garbage(dtype: torch.dtype) -> None:
    itemsize = dtype.itemsize
    base = (torch.arange(50) % 7).to(dtype)
    new = base.clone()
    new[[3, 17, 49]] = 5
    words = {1: np.uint8, 2: np.uint16, 4: np.uint32, 8: np.uint64}[itemsize]
    index = np.array([3, 17, 49], dtype=np.int32)
    values = new.view(-1).view(torch.uint8).numpy().view(words)[index]
    payload = bytearray(delta.sparse_nbytes(3, itemsize))
    payload[: 3 * itemsize] = values.tobytes()
    start = len(payload) - 12
    payload[start:] = index.tobytes()
    old = delta.as_bytes(base)
    got = delta.decode("sparse", memoryview(bytes(payload)), old, old.nbytes, itemsize)
    assert got.tobytes() == delta.as_bytes(new).tobytes() and old.tobytes() == delta.as_bytes(base).tobytes()
    bad = bytearray(payload)
    bad[start : start + 4] = np.int32(50).tobytes()
    with pytest.raises(ValueError, match="outside its piece"):
        delta.decode("sparse", memoryview(bytes(bad)), old, old.nbytes, itemsize)
    with pytest.raises(ValueError, match="whole"):
        delta.decode("sparse", memoryview(bytes(payload[:-1])), old, old.nbytes, itemsize)


def test_sparse_sizes() -> None:
    assert delta.sparse_nbytes(0, 2) == 0
    assert [delta.sparse_nbytes(k, 2) for k in (1, 2, 3)] == [8, 12, 20]
    assert [delta.sparse_nbytes(k, 1) for k in (1, 4, 5)] == [8, 20, 28]
    assert all(delta.sparse_nbytes(k, s) // (4 + s) == k for k in range(50) for s in (1, 2, 4, 8))
