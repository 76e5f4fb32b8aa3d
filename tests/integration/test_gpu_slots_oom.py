"""The GPU weight path when its slots do not fit: the publisher says which keys to change, and abandoning it leaves
no GPU version behind for readers (the learner then publishes through the host transport only)."""

from __future__ import annotations

import pytest
import torch

from async_rl.weights.config import PublisherConfig
from async_rl.weights.gpu.publisher import GpuPublisher, GpuSlotsOutOfMemory
from async_rl.weights.gpu.slots import GpuSlots


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


async def test_learner_with_gpu_auto_falls_back_to_the_host_transport(redis_client, names, servers, caplog) -> None:
    """A learner whose slots do not fit (publisher.gpu=auto) warns once, gives the GPU path up for good and publishes
    the same version, and the next ones, through the host transport; with publisher.gpu=on the error stands."""
    import contextlib
    import logging

    from actors.learner.checkpoint import LearnerState
    from actors.learner.config import LearnerConfig
    from actors.learner.publishing import Publishing
    from actors.learner.torch_backend import TorchBackend
    from async_rl.config.configurable import load_config
    from async_rl.model.presets import load_model
    from async_rl.servers.control import ControlPlane

    class FullGpuBackend(TorchBackend):
        """The quickstart's torch backend, its versions offered to slots that find the device full."""

        def gpu_export(self, cfg: PublisherConfig) -> _FullGpu:
            return _FullGpu("cpu", num_slots=cfg.gpu_slots)

    def learner_cfg(gpu: str) -> LearnerConfig:
        return load_config(LearnerConfig, None, [f"run.redis_url={servers.redis_url}", f"run.nats_url={servers.nats_url}",
                                                 f"run.prefix={names.prefix}", f"publisher.gpu={gpu}"])  # fmt: skip

    cfg = learner_cfg("auto")
    backend = FullGpuBackend(load_model(cfg.model.name, seed=cfg.model.seed, dtype=cfg.model.dtype), cfg.torch)
    async with contextlib.AsyncExitStack() as stack, ControlPlane(servers.nats_url, name="test") as control:
        pub = Publishing(cfg, backend, on_commit=lambda _record: None)
        await pub.open(stack, redis_client, control)
        with caplog.at_level(logging.WARNING, logger="actors.learner.publishing"):
            await pub.start(LearnerState())  # v0, waited for
            await pub.publish(1, wait=True)
        assert pub.weights is pub.host
        assert await pub.publisher.latest_version() == 1
        warned = [r.getMessage() for r in caplog.records if "host transport only" in r.getMessage()]
        assert len(warned) == 1 and "publisher.gpu=off" in warned[0]
    async with contextlib.AsyncExitStack() as stack, ControlPlane(servers.nats_url, name="test") as control:
        strict = Publishing(learner_cfg("on"), backend, on_commit=lambda _record: None)
        await strict.open(stack, redis_client, control)
        with pytest.raises(GpuSlotsOutOfMemory):
            await strict.publish(2, wait=True)
