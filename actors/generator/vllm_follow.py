"""Weight versions followed inside vLLM's engine core process (``vllm.follow="core"``; one GPU an engine).

The generator's process follows versions with :class:`~actors.generator.weight_sync.WeightSync` on its event loop,
which also runs vLLM's front end: on a busy node that loop answered 37-71 ms late (p50 of each heartbeat's worst),
and a version went through it three times (its announcement, the copy's answer, the swap's). Here the same
``WeightSync`` runs on an event loop of its own, in a thread of the engine core's process, where the only worker
of a one-GPU engine lives (vLLM's ``UniProcExecutor``): it hears the learner's announcements on NATS, takes a GPU
version's lease and copies it from the learner's buffers into the worker's staging slots on a stream of its own
while the engine core keeps decoding (``arl_copy_ipc``), or fetches a host version, checks it, and marks it ready.
A version marked ready goes into use at once, from the follower's thread: its in-place load queued on the stream the
steps run on, after the steps launched so far, and the steps scheduled from then on labelled with it, as
``vllm.swap="boundary"`` does between two steps, with no request from anywhere and no wait for the core's next step
(on two H200s that wait was 3-19 ms a version, p50 13). Only while the core is between a step's ``schedule`` and the
return of its ``execute_model`` (the step labelled, its forward and logits not yet queued) is the version left for
the core to load when the launch returns (:meth:`CoreFollower.launched`); the follower's lock orders the two threads.
Sampling reads the logits only; prompt logprobs and a speculative drafter, which the generator never asks for, would
read the weights after that. The generator's process asks only for a report (:meth:`CoreFollower.report`, a utility
call at each heartbeat).

The engine core's methods ``arl_follow_start``, ``arl_follow_report`` and ``arl_follow_stop`` (:func:`start`,
:func:`report`, :func:`stop`) are given to vLLM's ``EngineCore`` by :func:`actors.generator.vllm_swap.install`. The
engine runs with ``UniProcExecutor`` (``distributed_executor_backend="uni"``) so that its worker is in this process.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Mapping
from typing import Any

import torch

log = logging.getLogger(__name__)

FOLLOWER: CoreFollower | None = None
"""The follower of this process (the engine core's), once started."""
KEPT = 64
"""Swaps and latencies kept for the next report (reports come every heartbeat)."""


class CoreStage:
    """The :class:`~actors.generator.engine.Engine` side a ``WeightSync`` needs, done by the worker in this process."""

    name = "vllm-core"

    def __init__(self, follower: CoreFollower) -> None:
        self.follower = follower

    @property
    def version(self) -> int:
        return self.follower.applied

    def gpu_copier(self) -> Any:
        return self._copy if torch.cuda.is_available() else None

    async def ready(self) -> None:
        pass

    async def _copy(self, manifest: Any) -> Any:
        from actors.generator.vllm_worker_copies import copies_agree

        t0 = time.perf_counter()
        result = await asyncio.to_thread(self.follower.copy_here, manifest)
        copied = copies_agree([result], manifest.version)
        with self.follower._state:  # the core's thread may be loading, which drops the records it passed
            self.follower.copies[manifest.version] = {"total_s": time.perf_counter() - t0, "s": result["s"],
                                                      **{k: result[k] for k in ("copy_s", "prepare_s", "load")}}
        return copied

    def stage_copied(self, version: int) -> None:
        self.follower.mark_ready(version)

    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        self.follower.stage_host(tensors, version)

    def open_stage(self, version: int, layout: Any) -> None:
        return None

    async def wait_applied(self, version: int, timeout_s: float | None = None) -> bool:
        deadline = time.monotonic() + (timeout_s if timeout_s is not None else float("inf"))
        while self.follower.applied < version:
            if time.monotonic() >= deadline:
                return False
            await asyncio.sleep(0.005)
        return True


class CoreFollower:
    """A ``WeightSync`` on a thread of the engine core's process (module docstring)."""

    def __init__(self, core: Any, cfg: dict[str, Any]) -> None:
        from actors.generator.config import GeneratorConfig
        from async_rl.config.configurable import from_dict

        self.core = core
        self.worker = core.model_executor.driver_worker.worker  # UniProcExecutor: this process's one worker
        self.cfg = from_dict(GeneratorConfig, cfg)
        self.lock = threading.Lock()
        """Held while the worker's staging changes: a copy, a load. The core's thread never waits for it (a copy holds
        it for its whole length): it loads only where it gets it at once, else the follower's thread does."""
        self._state = threading.Lock()
        """Guards the version ready, the launch window and the records; taken after :attr:`lock`, held briefly."""
        self.ready: int | None = None
        self._launching = False
        """The core is between a step's ``schedule`` and the return of its ``execute_model``: no load then."""
        self._steps_stream = None
        """The stream the core's steps run on (this is made in the core's thread, by :func:`start`: vLLM's own)."""
        if torch.cuda.is_available():
            from actors.generator.vllm_worker import steps_stream

            self._steps_stream = steps_stream()
        self.applied = -1
        self.error: str | None = None
        self.last_load_error: str | None = None
        self.swaps: list[tuple[int, float]] = []
        self.pauses: list[float] = []
        self.copies: dict[int, dict[str, Any]] = {}
        """Each GPU version's copy, by version (:meth:`CoreStage._copy`): its seconds (``total_s``) and the worker's
        breakdown, as its answer to ``arl_copy_ipc`` has it."""
        self._ready_at: dict[int, float] = {}
        self.versions: list[dict[str, Any]] = []
        """Each version put in use since the last report: its copy, its wait from ready to the load, the load."""
        self.failures = 0
        self._stop = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._sync: Any = None
        self._device = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.thread = threading.Thread(target=self._main, name="arl-follow", daemon=True)
        self._core_thread = threading.current_thread()
        """The engine core's (:func:`start` is its utility call, made there)."""

    # ------------------------------------------------------------------ the follower's thread
    def _main(self) -> None:
        if self._device is not None:
            torch.cuda.set_device(self._device)
        try:
            asyncio.run(self._follow())
        except BaseException as exc:  # reported: the generator's process ends with it
            self.error = f"{type(exc).__name__}: {exc}"
            log.exception("the engine core's weight follower failed")

    async def _follow(self) -> None:
        from actors.generator.weight_sync import WeightSync
        from async_rl.process.lifecycle import redact_url
        from async_rl.servers.control import ControlPlane
        from async_rl.servers.reach import redis_client
        from async_rl.weights import WeightReader
        from async_rl.weights.gpu.reader import GpuReader
        from async_rl.weights.transport import make_transport

        cfg, names = self.cfg, self.cfg.run.names
        assert cfg.run.redis_url and cfg.run.nats_url, "the generator's process passes its resolved URLs"
        self._loop = asyncio.get_running_loop()
        redis = redis_client(cfg.run.redis_url)
        control = await ControlPlane(cfg.run.nats_url, name=f"{cfg.generator_id}-core", cfg=cfg.control).connect()
        try:
            transport = make_transport(cfg.transport, cfg.run.redis_url, names)
            reader = WeightReader(redis, transport, names, cfg.weight_sync.reader, reader_id=cfg.generator_id)
            gpu = None
            if cfg.weight_sync.gpu and torch.cuda.is_available():
                gpu = GpuReader(redis, names, None, cfg.weight_sync.reader, reader_id=cfg.generator_id)
            where = f"prefix {names.prefix!r} at {redact_url(cfg.run.redis_url)}"
            stage: Any = CoreStage(self)  # what WeightSync asks of an engine
            self._sync = sync = WeightSync(stage, reader, names, cfg.weight_sync, control, where=where, gpu=gpu)
            if not self._stop.is_set() and await sync.start():
                await sync.run()
        finally:
            if self._sync is not None:
                await self._sync.close()
            await control.close()
            await redis.aclose()

    def copy_here(self, manifest: Any) -> dict[str, Any]:
        """The worker's copy of a GPU version (a thread of the follower's loop), on the copy's own stream, waited
        for: the version is whole on this GPU before it is marked ready."""
        if self._device is not None:
            torch.cuda.set_device(self._device)
        _, stream = self.worker._arl_ipc or self.worker._arl_copy_path()
        try:
            with self.lock, torch.cuda.stream(stream):
                result = self.worker.arl_copy_ipc(manifest.encode(), manifest.version)
                stream.synchronize()
        finally:
            self._apply_waiting()  # a version the core could not load while this copy held the staging
        return result

    def stage_host(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """A host version (checked by the sync): converted, on the GPU where the load replays, kept, ready."""
        named = list(self.worker._arl_weights.prepare(tensors).items())
        if self._device is not None and self.worker._arl_plan is not None:
            stream = torch.cuda.Stream()
            with torch.cuda.stream(stream):
                named = [(n, t.to(torch.device("cuda", self._device))) for n, t in named]
            stream.synchronize()
        with self.lock:
            self.worker._arl_keep(version, named)
        self.mark_ready(version)

    def mark_ready(self, version: int) -> None:
        """``version`` goes into use now, or when the step being launched is (module docstring)."""
        with self._state:
            if self.ready is None or version > self.ready:
                self.ready = version
            self._ready_at[version] = time.perf_counter()
        self._apply_waiting()

    def _apply_waiting(self) -> None:
        """The follower's side: the version ready loaded now, unless a step is being launched. Again if that launch
        returned meanwhile: the core found the staging lock held by this thread and left the version to it."""
        while True:
            with self.lock, self._state:
                if not self._launching:
                    self._apply(self.core.scheduler)
            with self._state:
                if self.ready is None or self._launching:
                    return

    # ------------------------------------------------------------------ the engine core's thread
    def before_schedule(self, scheduler: Any) -> None:
        """A step is being scheduled: a version ready now is loaded before it, which it labels; none until launched."""
        with self._state:
            self._launching = True
        self._apply_if_free(scheduler)

    def launched(self) -> None:
        """The step's forward and logits are queued: a version made ready meanwhile is loaded after them. (vLLM calls
        ``execute_model`` after every ``schedule``; were it not, the versions would wait for the next step.)"""
        with self._state:
            self._launching = False
        self._apply_if_free(self.core.scheduler)

    def _apply_if_free(self, scheduler: Any) -> None:
        if self.ready is None or not self.lock.acquire(blocking=False):  # a copy under way: its version comes next
            return
        try:
            with self._state:
                self._apply(scheduler)
        finally:
            self.lock.release()

    def _apply(self, scheduler: Any) -> None:
        """The ready version's load queued on the steps' stream, the steps from now on labelled (both locks held)."""
        version, self.ready = self.ready, None
        if version is None or version <= self.applied:
            return
        try:
            with torch.cuda.stream(self._steps_stream):  # None (no CUDA): no stream to set
                r = self.worker.arl_apply_ordered(version)
        except Exception as exc:  # the old weights stay; the sync's next version may load
            self.failures += 1
            self.last_load_error = f"version {version}: {exc!r}"
            log.exception("could not load weight version %d; version %d stays in use", version, self.applied)
            return
        scheduler.arl_relabel(str(version))
        self.applied = version
        self.swaps = [*self.swaps[-(KEPT - 1):], (version, time.time())]
        if r["gpu_s"] is not None:
            self.pauses = [*self.pauses[-(KEPT - 1):], float(r["gpu_s"])]
        ready_at = self._ready_at.get(version)
        self.versions = [*self.versions[-(KEPT - 1):], {
            "version": version, "copy": self.copies.get(version), "gpu_s": r["gpu_s"], "call_s": r["s"],
            "by": "core" if threading.current_thread() is self._core_thread else "follower",
            "waited_s": None if ready_at is None else time.perf_counter() - ready_at}]  # fmt: skip
        for kept in (self.copies, self._ready_at):  # this version's and the ones it overtook
            for v in [v for v in kept if v <= version]:
                del kept[v]

    def report(self) -> dict[str, Any]:
        """What the generator's process shows (its heartbeat, its log), taken: swaps since the last report with their
        snapshot-to-applied seconds, pauses, each version's breakdown, snapshot-to-staged seconds, the sync's
        state."""
        sync = self._sync
        taken = dict(sync.taken_at) if sync is not None else {}
        with self._state:
            swaps, self.swaps = self.swaps, []
            pauses, self.pauses = self.pauses, []
            versions, self.versions = self.versions, []
        return {
            "version": self.applied, "swaps": swaps, "pauses": pauses, "versions": versions,
            "staged_latencies": sync.take_staged_latencies() if sync is not None else [],
            "taken_at": {str(v): taken[v] for v, _ in swaps if v in taken},
            "wanted": sync.wanted_version if sync is not None else -1,
            "staged": sync.staged_version if sync is not None else -1,
            "refused": sorted(sync.refused) if sync is not None else [],
            "failures": (sync.num_failures if sync is not None else 0) + self.failures,
            "fetched": None if sync is None or sync.last_fetch is None else [sync.last_fetch.version,
                                                                              sync.last_fetch.total_s],
            "load_error": self.last_load_error, "error": self.error, "alive": self.thread.is_alive(),
        }  # fmt: skip

    def stop(self) -> None:
        self._stop.set()
        loop, sync = self._loop, self._sync
        if loop is not None and sync is not None:
            loop.call_soon_threadsafe(sync.stop)
        self.thread.join(timeout=10)


def start(core: Any, cfg: dict[str, Any]) -> bool:
    """The engine core's ``arl_follow_start``: follow the run ``cfg`` names (a ``GeneratorConfig`` as a dict)."""
    global FOLLOWER
    if FOLLOWER is not None:
        raise RuntimeError("this engine core follows weight versions already")
    executor = core.model_executor
    if not hasattr(executor, "driver_worker"):
        raise RuntimeError(f"vllm.follow='core' needs vLLM's worker in the engine core's process "
                           f"(UniProcExecutor), not {type(executor).__name__}")  # fmt: skip
    FOLLOWER = CoreFollower(core, cfg)
    if not getattr(executor, "_arl_launch_noted", False):  # the step's launch ends the window of no loads
        launch = executor.execute_model

        def execute_model(*args: Any, **kwargs: Any) -> Any:
            try:
                return launch(*args, **kwargs)
            finally:
                if FOLLOWER is not None:
                    FOLLOWER.launched()

        executor.execute_model, executor._arl_launch_noted = execute_model, True
    FOLLOWER.thread.start()
    return True


def report(core: Any) -> dict[str, Any] | None:
    """The engine core's ``arl_follow_report``: :meth:`CoreFollower.report`, None before :func:`start`."""
    return None if FOLLOWER is None else FOLLOWER.report()


def stop(core: Any) -> bool:
    """The engine core's ``arl_follow_stop``: the follower's sync stopped, its thread joined."""
    global FOLLOWER
    if FOLLOWER is not None:
        FOLLOWER.stop()
        FOLLOWER = None
    return True
