"""The in-memory weight hand-over of the vLLM engine (actors/generator/weight_handover.py), without vLLM.

The worker side runs in a child process here, as in vLLM, so the descriptor really is another process's.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch

from actors.generator.weight_handover import Handle, map_weights, pack_weights

pytestmark = pytest.mark.vllm


def _weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "fp32": torch.randn(3, 5, generator=g),
        "transposed": torch.randn(4, 6, generator=g).t(),  # not contiguous
        "bf16 strided": torch.randn(9, generator=g).to(torch.bfloat16)[::2],
        "scalar": torch.tensor(3.5, dtype=torch.float16),
        "empty": torch.zeros(0, 3),
        "int64": torch.arange(7),
        "bool": torch.randn(5, generator=g) > 0,
        "big": torch.randn(1 << 20, generator=g),  # 4 MB: a thousand pages
    }


def _child_sums(handle: Handle, queue: mp.Queue) -> None:
    named = map_weights(handle)
    queue.put([(name, t.dtype, tuple(t.shape), t.to(torch.float64).sum().item()) for name, t in named])


def test_round_trip_in_another_process() -> None:
    weights = _weights()
    packed = pack_weights(weights)
    try:
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        child = ctx.Process(target=_child_sums, args=(packed.handle, queue))
        child.start()
        got = queue.get(timeout=60)
        child.join(timeout=60)
    finally:
        packed.close()
    assert child.exitcode == 0
    want = [(n, t.dtype, tuple(t.shape), t.to(torch.float64).sum().item()) for n, t in weights.items()]
    assert got == want


def test_views_are_exact_private_and_outlive_the_descriptor() -> None:
    weights = _weights()
    packed = pack_weights(weights)
    named = map_weights(packed.handle)
    packed.close()  # the engine closes its descriptor once the worker mapped the file
    with pytest.raises(RuntimeError, match="closed"):
        _ = packed.handle
    assert [n for n, _ in named] == list(weights)
    for name, view in named:
        assert view.dtype == weights[name].dtype and torch.equal(view, weights[name]), name
        assert view.data_ptr() % 64 == 0, name
    # Copy-on-write: a loader that writes into a view changes neither the source nor another mapping of it.
    again = pack_weights(weights)
    first, second = map_weights(again.handle), map_weights(again.handle)
    again.close()
    first[0][1].add_(1.0)
    assert torch.equal(second[0][1], weights["fp32"]) and torch.equal(first[0][1], weights["fp32"] + 1.0)


def test_bad_handles_are_refused() -> None:
    packed = pack_weights({"w": torch.ones(4)})
    try:
        pid, fd, size, manifest = packed.handle
        with pytest.raises(ValueError, match="outside the 16-byte file"):
            map_weights((pid, fd, size, [("w", "float32", [8], 0)]))
        with pytest.raises(ValueError, match="not a torch dtype"):
            map_weights((pid, fd, size, [("w", "Tensor", [4], 0)]))
        with pytest.raises(FileNotFoundError):
            map_weights((pid, 10_000, size, manifest))  # no such descriptor in that process
    finally:
        packed.close()
