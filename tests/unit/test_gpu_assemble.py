"""Assembling a GPU-held version from its buckets (async_rl/weights/gpu/reader.py ``assemble``), on the CPU: whole
tensors as views of their bucket, tensors of several ranks from their pieces, and, for a reader that keeps them
(the vLLM worker's staging slots), the next version of the same layout assembled into the same tensors."""

from __future__ import annotations

import torch

from async_rl.weights.gpu.reader import BucketAssembly, assemble, pieces_by_bucket
from async_rl.weights.manifest import BucketEntry, Manifest, ManifestTensor, PieceEntry

CPU = torch.device("cpu")


def _version() -> tuple[Manifest, dict[str, torch.Tensor]]:
    """``embed`` [3, 2] whole in bucket 0, ``experts`` [4, 2] in two pieces along dim 0 (one per rank, one per
    bucket) and a 0-d ``scale`` whole in bucket 1; float32."""
    tensors = [
        ManifestTensor("embed", "float32", (3, 2), [PieceEntry(bucket=0, offset=0, nbytes=24, checksum=0)]),
        ManifestTensor("experts", "float32", (4, 2), [
            PieceEntry(bucket=0, offset=24, nbytes=16, checksum=0, dim=0, start=0, length=2, rank=0),
            PieceEntry(bucket=1, offset=0, nbytes=16, checksum=0, dim=0, start=2, length=2, rank=1)]),
        ManifestTensor("scale", "float32", (), [PieceEntry(bucket=1, offset=16, nbytes=4, checksum=0)]),
    ]  # fmt: skip
    manifest = Manifest(version=1, tensors=tensors, buckets=[BucketEntry(0, 40), BucketEntry(1, 20)],
                        transport="cuda", checksum="wsum64", num_ranks=2)  # fmt: skip
    values = {"embed": torch.arange(6.0).view(3, 2), "experts": torch.arange(10.0, 18.0).view(4, 2),
              "scale": torch.tensor(7.0)}  # fmt: skip
    return manifest, values


def _buckets(values: dict[str, torch.Tensor]) -> list[torch.Tensor]:
    """The two ranks' buckets holding ``values`` as :func:`_version` places them."""
    b0 = torch.cat([values["embed"].reshape(-1), values["experts"][:2].reshape(-1)])
    b1 = torch.cat([values["experts"][2:].reshape(-1), values["scale"].reshape(1)])
    return [b0.view(torch.uint8).clone(), b1.view(torch.uint8).clone()]


def test_whole_tensors_are_views_and_pieces_are_assembled() -> None:
    manifest, values = _version()
    buffers = _buckets(values)
    out = assemble(manifest, buffers, CPU)
    for name, want in values.items():
        assert torch.equal(out[name], want), name
    assert out["embed"].untyped_storage().data_ptr() == buffers[0].untyped_storage().data_ptr()
    assert out["scale"].untyped_storage().data_ptr() == buffers[1].untyped_storage().data_ptr()


def test_owned_tensors_take_the_next_version_in_place_and_leave_the_buckets_free() -> None:
    manifest, values = _version()
    buffers = _buckets(values)
    kept = assemble(manifest, buffers, CPU, own=True)
    ptrs = {b.untyped_storage().data_ptr() for b in buffers}
    assert all(t.untyped_storage().data_ptr() not in ptrs for t in kept.values()), "a tensor still in a bucket"
    views = {name: t.view(-1)[:1] for name, t in kept.items()}  # what a bound load plan would hold on to
    nxt = {name: v + 100 for name, v in values.items()}
    for dst, src in zip(buffers, _buckets(nxt), strict=True):  # the next version received into the same buckets
        dst.copy_(src)
    for name, t in kept.items():
        assert torch.equal(t, values[name]), f"{name} changed with the buckets"
    again = assemble(manifest, buffers, CPU, into=kept, own=True)
    for name, want in nxt.items():
        assert again[name] is kept[name]
        assert torch.equal(kept[name], want), name
        assert views[name].item() == want.reshape(-1)[0].item(), f"{name}: a view of the kept tensor is stale"


def test_a_version_assembled_bucket_by_bucket_as_its_buckets_arrive() -> None:
    manifest, values = _version()
    kept = assemble(manifest, _buckets(values), CPU, own=True)
    nxt = {name: v + 100 for name, v in values.items()}
    by_bucket = pieces_by_bucket(manifest)
    assert {b: [(t.name, i) for t, i in pieces] for b, pieces in by_bucket.items()} == {
        0: [("embed", 0), ("experts", 0)], 1: [("experts", 1), ("scale", 0)]}  # fmt: skip
    received = _buckets(values)  # the buffers the next versions are received into
    by_bucket_of = BucketAssembly(manifest, received, kept)
    assert by_bucket_of.serves(received, kept) and not by_bucket_of.serves(_buckets(values), kept)
    for dst, src in zip(received, _buckets(nxt), strict=True):
        dst.copy_(src)
    by_bucket_of(1)  # rank 1's bucket first: only its pieces change
    assert torch.equal(kept["experts"][2:], nxt["experts"][2:]) and torch.equal(kept["scale"], nxt["scale"])
    assert torch.equal(kept["experts"][:2], values["experts"][:2]) and torch.equal(kept["embed"], values["embed"])
    by_bucket_of(0)
    for name, want in nxt.items():
        assert torch.equal(kept[name], want), name
