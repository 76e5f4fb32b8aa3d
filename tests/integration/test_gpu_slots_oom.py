"""The GPU weight path when its slots do not fit: the publisher says which keys to change, and abandoning it leaves
no GPU version behind for readers (the learner then publishes through the host transport only)."""

from __future__ import annotations

import pytest
import torch

from async_rl.weights.config import PublisherConfig
from async_rl.weights.gpu_publisher import GpuPublisher, GpuSlotsOutOfMemory
from async_rl.weights.gpu_slots import GpuSlots


class _FullGpu(GpuSlots):
    """Real slots whose allocation finds the device full (as torch reports it)."""

    def allocate(self, slot: int) -> list[torch.Tensor]:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 3.30 GiB")


async def test_slots_that_do_not_fit_name_the_keys_and_leave_nothing_behind(redis_client, names) -> None:
    cfg = PublisherConfig()
    pub = GpuPublisher(redis_client, names, cfg, _FullGpu("cpu", num_slots=2))
    await redis_client.set(names.weights_gpu_latest, 7)  # a previous learner's GPU version, gone with it
    await redis_client.set(names.weights_gpu_manifest(7), b"stale")
    with pytest.raises(GpuSlotsOutOfMemory, match="publisher.gpu=off"):
        await pub.offer(1, lambda: [("w", torch.ones(4))])
    await pub.abandon()
    assert await pub.latest_version() is None
    assert await redis_client.get(names.weights_gpu_manifest(7)) is None
    assert pub.slots.num_slots == 0 and pub.host is None
