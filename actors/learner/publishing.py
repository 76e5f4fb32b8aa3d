"""The learner's weight publishing: which publisher takes each version, the version numbers, and their metrics.

* **Two routes.** The host transport's :class:`BackgroundPublisher` always; in front of it, when the backend's
  weights are on a CUDA GPU (``backend.gpu_export``, with ``publisher.gpu`` on or auto), a :class:`GpuPublisher`
  that keeps versions in ``publisher.gpu_slots`` GPU buffers for same-host generators (CUDA IPC) and feeds the host
  transport (``publisher.gpu_host_copies``).
* **Fallback.** With ``publisher.gpu=auto``, slots that do not fit the GPU (:class:`GpuSlotsOutOfMemory`) are given
  up for good and the versions go through the host transport alone; ``publisher.gpu=on`` raises instead.
* **Numbers never reused.** At start, versions published past the restored checkpoint (lost steps), a visible
  version whose bytes left with the previous process (a transport that keeps none, ``peer://``), or a version the
  previous learner was still writing (staged, never committed: a learner fenced out of the run may still be putting
  its buckets) move the restored weights to the next number, published at once.
* **Fenced.** The publishers carry the learner's fence (:mod:`async_rl.run.lease`): their staging, commits and
  pruning are refused by Redis once another learner took the run.
* **The step waits for the snapshot only.** :meth:`Publishing.publish` returns once the weights are copied (``wait``:
  once the version is out); a step that finds a version still going out skips its own
  (:mod:`async_rl.weights.background`).
* **Metrics.** ``weights/*`` of the versions committed during a step (:func:`publish_metrics`).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Callable

import redis.asyncio as aioredis

from actors.learner.backend import TrainingBackend
from actors.learner.checkpoint import LearnerState
from actors.learner.config import LearnerConfig
from async_rl.run.lease import Fence
from async_rl.servers.control import ControlPlane
from async_rl.weights import WeightPublisher
from async_rl.weights.background import BackgroundPublisher, PublishRecord
from async_rl.weights.gpu.publisher import GpuPublisher, GpuSlotsOutOfMemory
from async_rl.weights.manifest import GPU_TRANSPORT
from async_rl.weights.transport import BucketTransport, make_transport

log = logging.getLogger(__name__)


class Publishing:
    """The learner's weight publishing (see the module docstring); its resources close with the learner's stack."""

    cfg: LearnerConfig
    backend: TrainingBackend
    publisher: WeightPublisher | None
    host: BackgroundPublisher | None
    """The host transport's publisher (the one behind :attr:`weights`, or :attr:`weights` itself)."""
    weights: BackgroundPublisher | GpuPublisher | None
    """Publishes the versions: from GPU buffers (same-host generators over CUDA IPC, feeding the host transport),
    or through the host transport alone."""
    _on_commit: Callable[[PublishRecord], None]
    _transport: BucketTransport | None
    _gpu_latest: int | None
    """Newest version in the GPU slots' records when they opened (None: none, or no GPU slots)."""
    _staged: int | None
    """Newest version an earlier learner staged and never committed (None: none)."""
    _fence: Fence | None

    def __init__(self, cfg: LearnerConfig, backend: TrainingBackend, on_commit: Callable[[PublishRecord], None], *,
                 fence: Fence | None = None):  # fmt: skip
        self.cfg = cfg
        self.backend = backend
        self.publisher = None
        self.weights = self.host = None
        self._on_commit = on_commit
        self._transport = None
        self._gpu_latest = None
        self._staged = None
        self._fence = fence

    async def open(self, stack: contextlib.AsyncExitStack, redis: aioredis.Redis, control: ControlPlane) -> None:
        """The transport and publishers, each entered in ``stack`` as it opens."""
        cfg, names = self.cfg, self.cfg.run.names
        assert cfg.run.redis_url, "URLs are resolved by the entry point"
        transport = self._transport = make_transport(cfg.transport, cfg.run.redis_url, names)
        stack.push_async_callback(transport.close)
        self.publisher = WeightPublisher(redis, transport, names, cfg.publisher, control, fence=self._fence)
        self._staged = max(await self.publisher.clean_staging(), default=None)
        host = BackgroundPublisher(self.publisher, on_commit=self._on_commit)
        stack.push_async_callback(host.aclose)  # before the transport closes: the version going out ends
        self.weights = self.host = host
        export = self.backend.gpu_export(cfg.publisher) if cfg.publisher.gpu != "off" else None
        if cfg.publisher.gpu == "on" and export is None:
            raise ValueError(f"publisher.gpu=on needs the learner's weights on a CUDA GPU; this {cfg.backend} backend "
                             f"publishes from {self.backend.publish_device}")  # fmt: skip
        if export is not None:
            gpu = GpuPublisher(redis, names, cfg.publisher, export, control=control,
                               host=host if cfg.publisher.gpu_host_copies else None, on_commit=self._on_commit,
                               fence=self._fence)  # fmt: skip
            self._gpu_latest = await gpu.latest_version()
            await gpu.clean()  # the buffers of a previous learner's versions died with it
            stack.push_async_callback(gpu.aclose)
            self.weights = gpu
            log.info("weights: versions kept in %d GPU slots for same-host generators (CUDA IPC)%s",
                     cfg.publisher.gpu_slots,
                     ", and published through the host transport" if cfg.publisher.gpu_host_copies else "")  # fmt: skip

    async def start(self, state: LearnerState) -> float | None:
        """Number the restored weights past every version published before (``state.version``), and publish them
        unless they are out already (then ``state.published_version``). Returns the seconds the learner waited for
        that version to be out (None: nothing to publish)."""
        assert self.publisher is not None and self.host is not None and self._transport is not None
        transport = self._transport
        latest = await self.publisher.latest_version()
        if self._gpu_latest is not None:
            latest = max(latest if latest is not None else -1, self._gpu_latest)
        if latest is not None and latest > state.version:
            # Killed between a publish and the checkpoint covering it: the versions past the checkpoint came from
            # lost steps, and their numbers are never reused (generators only take newer ones). The restored
            # weights go out now as the next version, so generators leave the lost trajectory at once.
            log.warning("weights v%d-v%d came from steps lost with the previous learner; the restored step %d "
                        "is published as v%d", state.version + 1, latest, state.step, latest + 1)  # fmt: skip
            state.version = latest + 1
        elif latest is not None and latest == state.version and not transport.durable:
            # The bytes of the visible version left with the previous learner's process (peer://): generators that
            # start now, or miss a delta, would find no source. The restored weights go out again, as a new number.
            log.info("weights v%d were served by the previous learner (transport %s keeps no bytes): the restored "
                     "step %d is published as v%d", latest, transport.name, state.step, latest + 1)  # fmt: skip
            state.version = latest + 1
        if self._staged is not None and self._staged >= state.version:
            # A version the previous learner was still writing: if that learner lives on (fenced out of the run), its
            # buckets may still arrive under that number, so it is never committed by anyone.
            log.info("weights v%d were being written when the previous learner left; the restored step %d is "
                     "published as v%d", self._staged, state.step, self._staged + 1)  # fmt: skip
            state.version = self._staged + 1
        if latest is None or latest < state.version:
            return await self.publish(state.version, wait=True)
        state.published_version = latest
        self.host.published_version = latest  # out already: the loop's final flush has nothing to send
        return None

    def offered_version(self, published_version: int) -> int:
        """The newest version handed to the publisher (snapshotted; committed or going out), given the newest
        committed one."""
        assert self.weights is not None
        inflight = self.weights.inflight_version
        return max(published_version, inflight if inflight is not None else -1)

    @property
    def versions_skipped(self) -> int:
        assert self.weights is not None
        return self.weights.versions_skipped

    def take_records(self) -> list[PublishRecord]:
        """The versions committed since the last call."""
        assert self.weights is not None
        return self.weights.take_records()

    async def publish(self, version: int, *, wait: bool = False) -> float:
        """Snapshot the weights as ``version`` and publish them in the background (``wait``: until it is out, after
        the version going out before it). A step that finds a version still going out skips its own. Returns the
        seconds the caller waited."""
        assert self.weights is not None
        t0 = time.monotonic()
        try:
            if wait:
                await self.weights.flush(version, self.backend.snapshot_source)
                return time.monotonic() - t0
            offered = await self.weights.offer(version, self.backend.snapshot_source)
        except GpuSlotsOutOfMemory as exc:
            if self.cfg.publisher.gpu == "on" or self.host is None or not isinstance(self.weights, GpuPublisher):
                raise
            log.warning("%s; publishing through the host transport only from now on", exc)
            await self.weights.abandon()
            self.weights = self.host
            import torch

            torch.cuda.empty_cache()  # the slots' memory back to the driver, for training
            return await self.publish(version, wait=wait)
        if not offered:
            log.debug("weights v%d skipped: v%s is still going out", version, self.weights.inflight_version)
        return time.monotonic() - t0


def publish_metrics(records: list[PublishRecord]) -> dict[str, float]:
    """Metrics of the versions committed during a step (the newest one's sizes; empty when none was)."""
    out: dict[str, float] = {}
    host = [r for r in records if r.kind != GPU_TRANSPORT]
    if host:
        r = host[-1]
        out.update({"weights/bytes": float(r.bytes_sent), "weights/full_bytes": float(r.full_bytes),
                    "weights/delta_ratio": r.delta_ratio, "weights/publish_latency_s": r.latency_s,
                    "weights/full": float(r.kind == "full"), "weights/encode_s": r.stats.pack_s})  # fmt: skip
    gpu = [r for r in records if r.kind == GPU_TRANSPORT]
    if gpu:  # snapshot queued to the version visible in GPU buffers (same-host generators)
        out["weights/gpu_publish_latency_s"] = gpu[-1].latency_s
        out["weights/gpu_wait_s"] = gpu[-1].stats.pack_s  # the GPU's copies and checksums, seen from the host
        out["weights/gpu_commit_s"] = gpu[-1].stats.put_s  # manifest committed and announced
    return out
