"""Bucket planning, packing, tensor views and manifest encoding (no servers)."""

from __future__ import annotations

import pytest
import torch

from async_rl.weights.config import PublisherConfig, ReaderConfig
from async_rl.weights.manifest import (
    ALIGN_BYTES,
    CHECKSUMS,
    DTYPES,
    BucketEntry,
    Manifest,
    ManifestError,
    ManifestTensor,
    PieceEntry,
    checksum_stream,
    pack_bucket,
    plan_buckets,
    view_tensor,
)


def _random(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), shape, generator=g, dtype=torch.int64).to(dtype)


def _all_dtypes() -> dict[str, torch.Tensor]:
    return {f"t.{name}": _random(dt, (3, 5), i) for i, (name, dt) in enumerate(DTYPES.items())}


def test_plan_packs_in_order_aligned_and_gives_big_tensors_their_own_bucket() -> None:
    tensors = {
        "a": torch.zeros(10, dtype=torch.float32),  # 40 B
        "b": torch.zeros(3, dtype=torch.bfloat16),  # 6 B -> offset 64
        "big": torch.zeros(1000, dtype=torch.float32),  # 4000 B > bucket: alone
        "c": torch.zeros(100, dtype=torch.int64),  # 800 B
        "d": torch.zeros(50, dtype=torch.int8),  # 50 B: fits after c
    }
    entries, sizes = plan_buckets(tensors, bucket_bytes=1024)
    placed = {e.name: (e.bucket, e.offset, e.nbytes) for e in entries}
    assert placed == {"a": (0, 0, 40), "b": (0, 64, 6), "big": (1, 0, 4000), "c": (2, 0, 800), "d": (2, 832, 50)}
    assert sizes == [70, 4000, 882]
    assert all(e.offset % ALIGN_BYTES == 0 for e in entries)


def test_plan_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="bucket_bytes"):
        plan_buckets({"a": torch.zeros(1)}, 0)
    with pytest.raises(TypeError, match="'a'"):
        plan_buckets({"a": [1, 2]}, 100)  # type: ignore[dict-item]
    with pytest.raises(ValueError, match="unsupported dtype"):
        plan_buckets({"c": torch.zeros(2, dtype=torch.complex64)}, 100)


def test_pack_and_view_round_trip_every_dtype_including_empty_and_scalar() -> None:
    tensors = _all_dtypes()
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.bfloat16)
    tensors["empty"] = torch.zeros(0, 4)
    tensors["strided"] = torch.arange(24, dtype=torch.float32).view(4, 6).t()  # not contiguous
    entries, sizes = plan_buckets(tensors, bucket_bytes=256)
    buffers = []
    for index, size in enumerate(sizes):
        buf = bytearray(b"\xff" * size)  # garbage must not leak into padding
        pack_bucket(tensors, [e for e in entries if e.bucket == index], memoryview(buf))
        buffers.append(memoryview(buf))
    for e in entries:
        got = view_tensor(buffers[e.bucket], e)
        want = tensors[e.name]
        assert got.dtype == want.dtype and got.shape == want.shape, e.name
        assert torch.equal(got.reshape(-1).view(torch.uint8), want.contiguous().reshape(-1).view(torch.uint8)), e.name
    # Padding is zeroed, so the same tensors always give the same checksum.
    again = bytearray(b"\x00" * sizes[0])
    pack_bucket(tensors, [e for e in entries if e.bucket == 0], memoryview(again))
    assert bytes(again) == bytes(buffers[0])


def test_view_is_zero_copy() -> None:
    tensors = {"w": torch.arange(16, dtype=torch.float32)}
    entries, sizes = plan_buckets(tensors, 1024)
    buf = bytearray(sizes[0])
    pack_bucket(tensors, entries, memoryview(buf))
    view = view_tensor(memoryview(buf), entries[0])
    buf[0:4] = torch.tensor([42.0]).numpy().tobytes()
    assert view[0].item() == 42.0


def _manifest(tensors: dict[str, torch.Tensor], bucket_bytes: int) -> Manifest:
    entries, sizes = plan_buckets(tensors, bucket_bytes)
    return Manifest(
        version=7,
        tensors=[ManifestTensor(e.name, e.dtype, e.shape, [PieceEntry(e.bucket, e.offset, e.nbytes, 99)])
                 for e in entries],
        buckets=[BucketEntry(i, s, 1234 + i) for i, s in enumerate(sizes)],
        transport="redis",
        checksum="xxh3_64",
        full_version=7,
    )  # fmt: skip


def test_manifest_encode_decode_and_validation() -> None:
    tensors = _all_dtypes()
    m = _manifest(tensors, 128)
    back = Manifest.decode(m.encode())
    assert back == m
    assert back.total_bytes == sum(b.nbytes for b in m.buckets) and back.num_buckets == len(m.buckets)

    bad = Manifest.decode(m.encode())
    bad.tensors[0].pieces[0].nbytes += 1
    with pytest.raises(ManifestError, match="bytes"):
        Manifest.decode(bad.encode())
    bad = Manifest.decode(m.encode())
    last = bad.tensors[-1].pieces[0]
    last.offset = bad.buckets[last.bucket].nbytes
    with pytest.raises(ManifestError, match="outside its bucket"):
        Manifest.decode(bad.encode())
    bad = Manifest.decode(m.encode())
    bad.tensors[0].dtype = "float128"
    with pytest.raises(ManifestError, match="unknown dtype"):
        Manifest.decode(bad.encode())
    bad = Manifest.decode(m.encode())
    bad.tensors[0].pieces[0].encoding = "xor-zstd"
    with pytest.raises(ManifestError, match="a full version stores raw pieces"):
        Manifest.decode(bad.encode())
    with pytest.raises(ManifestError, match="malformed"):
        Manifest.decode(b"\x81\xa6schema\x02")
    with pytest.raises(ManifestError):
        Manifest.decode(b"not msgpack at all")


def test_manifest_pieces_must_tile_their_tensor() -> None:
    w = ManifestTensor("w", "float32", (4, 6), [PieceEntry(0, 0, 32, 1, 1, 0, 2), PieceEntry(0, 64, 32, 2, 1, 2, 2)])
    m = Manifest(version=1, tensors=[w], buckets=[BucketEntry(0, 160)], transport="redis", checksum="xxh3_64",
                 full_version=1)  # fmt: skip
    with pytest.raises(ManifestError, match="pieces cover 4 of 6 along dimension 1"):
        m.validate()
    w.pieces.append(PieceEntry(0, 0, 0, 3, 1, 5, 2, "same"))
    with pytest.raises(ManifestError, match="do not tile"):
        m.validate()
    w.pieces[-1] = PieceEntry(0, 128, 32, 3, 1, 4, 2)
    m.validate()


def test_checksums_detect_one_flipped_bit() -> None:
    data = bytearray(torch.randn(4096).numpy().tobytes())
    for name, fn in CHECKSUMS.items():
        before = fn(memoryview(data))
        data[100] ^= 0x01
        assert fn(memoryview(data)) != before, name
        data[100] ^= 0x01


def test_streaming_checksums_equal_one_shot() -> None:
    data = memoryview(bytearray(torch.randn(100_003).numpy().tobytes()))
    for name, fn in CHECKSUMS.items():
        h = checksum_stream(name)
        for start in range(0, data.nbytes, 65_537):  # uneven chunks, as recv_into delivers them
            h.update(data[start : start + 65_537])
        assert h.intdigest() == fn(data), name
    with pytest.raises(ValueError, match="unknown checksum 'md5'"):
        checksum_stream("md5")


def test_config_errors_name_the_field() -> None:
    with pytest.raises(ValueError, match="weights.bucket_bytes"):
        PublisherConfig(bucket_bytes=0)
    with pytest.raises(ValueError, match="weights.bucket_bytes"):
        PublisherConfig(bucket_bytes=1 << 30)
    with pytest.raises(ValueError, match="weights.keep_versions"):
        PublisherConfig(keep_versions=0)
    with pytest.raises(ValueError, match="weights.checksum"):
        PublisherConfig(checksum="md5")
    with pytest.raises(ValueError, match="lease_ttl_s"):
        ReaderConfig(lease_ttl_s=0)
