"""The torch engine's weight hot-swap: a standby model loaded in the background, swapped in at a step boundary.

:meth:`WeightSwap.stage_weights` (any thread) checks the names and shapes, then a loader thread copies the
tensors into a standby copy of the model while generation continues on the active one; at the next step
boundary the two references are exchanged, so the pause (:attr:`WeightSwap.last_swap_pause_s`) is a pointer
swap whatever the model size. :meth:`WeightSwap.open_stage` does the same with a version whose tensors arrive
bucket by bucket: the loader copies each part as it comes and marks the standby ready only once the last one is in.
The KV cache carries over, and the tokens sampled after the swap carry the new version. The standby (created
with the first staged version) doubles the parameter memory. A staged version must be complete (every weight,
in state_dict or checkpoint names: see :mod:`.param_slots`).

Threads and locks: ``_stage_cond`` hands the pending version to the loader thread; ``_swap_lock`` guards the
active/standby pair, the version in use, the ready version, the busy flag, the waiters and the swap record
(``_staged_cond`` is a condition on it). The decode thread swaps at a step boundary (:meth:`WeightSwap._step_model`)
and at the end of a batch (:meth:`WeightSwap._batch_running`); the loader swaps itself when no batch runs.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import deque
from collections.abc import Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from actors.generator.config import TorchEngineConfig
from actors.generator.engine import StagingStream
from actors.generator.param_slots import ParamSlots
from actors.generator.queued_stream import QueuedStream, StreamAborted

log = logging.getLogger(__name__)

SWAPS_KEPT = 256
"""Swaps remembered for :meth:`WeightSwap.take_swaps` between two heartbeats (a few per second at most)."""


class WeightSwap:
    """Active and standby model with a loader thread: the :class:`~actors.generator.torch_engine.TorchEngine`'s
    weight hot-swap (a mixin; see the module docstring)."""

    config: TorchEngineConfig
    """Set by the engine (``load_threads``)."""
    device: torch.device
    """Set by the engine."""
    _closed: bool
    """Set by the engine's close (the loader stops and nothing more is staged)."""
    last_swap_pause_s: float
    """Time generation stood still for the last swap (a reference exchange under a lock)."""
    last_load_s: float
    """Time the last staged version took to copy into the standby model (generation goes on meanwhile)."""
    last_stage_error: str | None
    """Why the last staged version could not be loaded (None when it loaded)."""
    _active: PreTrainedModel
    _standby: PreTrainedModel | None
    _slots_active: ParamSlots
    _slots_standby: ParamSlots | None
    _version: int
    _ready_version: int | None
    _pending: tuple[Mapping[str, torch.Tensor] | QueuedStream, int] | None
    _streaming: QueuedStream | None
    """The stream the loader is consuming (aborted on close, so that the loader does not wait for it)."""
    _busy: bool
    _waiters: list[tuple[int, asyncio.AbstractEventLoop, asyncio.Future]]
    _swap_lock: threading.Lock
    _staged_cond: threading.Condition
    """Notified (under ``_swap_lock``) when a version is loaded into the standby or swapped in."""
    _stage_cond: threading.Condition
    _loader: threading.Thread | None
    _swaps: deque[tuple[int, float]]
    """(version, unix time) of swaps not yet taken by :meth:`take_swaps`."""
    _swap_timings: deque[tuple[float, float]]
    """(standby copy seconds, loaded-to-swapped seconds) of swaps not yet taken by :meth:`take_swap_timings`."""
    _ready_at: float
    """``time.perf_counter()`` when the ready version finished loading."""

    def __init__(self, model: PreTrainedModel) -> None:
        """``model`` is the active model, already on the engine's device."""
        self._active = model
        self._slots_active = ParamSlots(self._active)
        self._slots_standby = None
        self._swaps = deque(maxlen=SWAPS_KEPT)
        self._swap_timings = deque(maxlen=SWAPS_KEPT)
        self._ready_at = 0.0
        self._standby = None
        self._version = -1
        self._ready_version = None
        self._pending = None
        self._streaming = None
        self._busy = False
        self._waiters = []
        self._swap_lock = threading.Lock()
        self._staged_cond = threading.Condition(self._swap_lock)
        self._stage_cond = threading.Condition()
        self._loader = None
        self.last_swap_pause_s = 0.0
        self.last_load_s = 0.0
        self.last_stage_error = None

    # ---------------------------------------------------------------- the engine's weight interface

    @property
    def version(self) -> int:
        return self._version

    @property
    def ready_version(self) -> int | None:
        """Version loaded in the standby and waiting for the next step boundary (None: nothing waiting)."""
        return self._ready_version

    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        """Check names/shapes now (ValueError), load in the background, swap at the next step boundary.

        The engine keeps references to ``tensors`` until they are copied: do not modify them.
        """
        self._stage(tensors, version, tensors)

    def open_stage(self, version: int, layout: Mapping[str, torch.Tensor]) -> StagingStream:
        """:meth:`stage_weights` in parts: ``layout`` (every name, shape and dtype) is checked now, the loader copies
        each part as it is put, and the standby becomes ready for the swap at :meth:`StagingStream.finish`."""
        stream = QueuedStream(layout)
        self._stage(stream, version, layout)
        return stream

    def _stage(self, source: Mapping[str, torch.Tensor] | QueuedStream, version: int,
               layout: Mapping[str, torch.Tensor]) -> None:  # fmt: skip
        if self._closed:
            raise RuntimeError("engine is closed")
        if version <= self._version:
            raise ValueError(f"staged version {version} is not newer than the version in use ({self._version})")
        self._slots_active.check(layout)
        with self._stage_cond:
            self._pending = (source, version)
            self._stage_cond.notify()
            if self._loader is None:
                self._loader = threading.Thread(target=self._loader_main, name="torch-engine-loader", daemon=True)
                self._loader.start()

    async def wait_applied(self, version: int, timeout_s: float | None = None) -> bool:
        loop = asyncio.get_running_loop()
        fut: asyncio.Future = loop.create_future()
        entry = (version, loop, fut)
        with self._swap_lock:
            if self._version >= version:
                return True
            self._waiters.append(entry)
        try:
            await asyncio.wait_for(fut, timeout_s)
            return True
        except TimeoutError:
            return False
        finally:
            with self._swap_lock:
                if entry in self._waiters:
                    self._waiters.remove(entry)

    def wait_staged(self, version: int, timeout_s: float | None = None) -> bool:
        """Block until ``version`` (or newer) is loaded in the standby or in use; True if so, False on timeout.

        A blocking call for threads (tests, benchmarks); coroutines use :meth:`wait_applied`.
        """

        def ready() -> bool:
            return self._version >= version or (self._ready_version is not None and self._ready_version >= version)

        with self._staged_cond:
            return self._staged_cond.wait_for(ready, timeout_s)

    def take_swaps(self) -> list[tuple[int, float]]:
        with self._swap_lock:
            out = list(self._swaps)
            self._swaps.clear()
        return out

    def take_swap_timings(self) -> list[tuple[float, float]]:
        with self._swap_lock:
            out = list(self._swap_timings)
            self._swap_timings.clear()
        return out

    # ---------------------------------------------------------------- loader and swap

    def _stop_loader(self) -> None:
        """Drop a version not yet loaded and wake the loader to see ``_closed`` (a stream it waits on is aborted)."""
        with self._stage_cond:
            self._pending = None
            if self._streaming is not None:
                self._streaming.abort()
            self._stage_cond.notify_all()

    def _loader_main(self) -> None:
        threads = self.config.load_threads if self.device.type == "cpu" else 1
        pool = ThreadPoolExecutor(threads, thread_name_prefix="torch-engine-copy") if threads > 1 else None
        try:
            self._load_loop(pool)
        finally:
            if pool is not None:
                pool.shutdown()

    def _load_loop(self, pool: ThreadPoolExecutor | None) -> None:
        while True:
            with self._stage_cond:
                while self._pending is None and not self._closed:
                    self._stage_cond.wait()
                if self._closed:
                    return
                source, version = self._pending  # type: ignore[misc]
                self._pending = None
                self._streaming = source if isinstance(source, QueuedStream) else None
            try:
                self._load_standby(source, version, pool)
                self.last_stage_error = None
            except StreamAborted:
                log.info("staged weight version %d was abandoned while it arrived; keeping version %d", version,
                         self._version)  # fmt: skip
            except Exception as exc:  # a bad version must not kill the loader; the old weights stay
                self.last_stage_error = f"version {version}: {exc!r}"
                log.exception("could not load staged weight version %d; keeping version %d", version, self._version)

    def _load_standby(self, source: Mapping[str, torch.Tensor] | QueuedStream, version: int,
                      pool: ThreadPoolExecutor | None) -> None:  # fmt: skip
        with self._swap_lock:
            self._ready_version = None  # the standby is about to be overwritten; an unapplied version is dropped
            standby, slots = self._standby, self._slots_standby
        if standby is None:
            standby = self._new_standby()
            slots = ParamSlots(standby)
        assert slots is not None
        t0 = time.perf_counter()
        parts = source.parts() if isinstance(source, QueuedStream) else (source,)
        if self.device.type == "cuda":
            stream = torch.cuda.Stream(device=self.device)
            with torch.cuda.stream(stream):
                for tensors in parts:
                    slots.copy_(tensors)
            stream.synchronize()
        else:
            for tensors in parts:
                slots.copy_(tensors, pool)
        self.last_load_s = time.perf_counter() - t0
        with self._swap_lock:
            self._standby, self._slots_standby = standby, slots
            if version <= self._version:
                return
            self._ready_version = version
            self._ready_at = time.perf_counter()
            self._staged_cond.notify_all()
            if not self._busy:
                self._swap_locked()

    def _new_standby(self) -> PreTrainedModel:
        """A second instance of the model architecture, parameters left uninitialised (a staged version
        overwrites every one of them); buffers (e.g. rotary frequencies) are copied from the active model.
        Skipping the random init makes the first swap of a 1 GB model seconds faster."""
        cfg = self._active.config
        dtype = next(self._active.parameters()).dtype
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")
        model = model.to_empty(device=self.device)
        model.tie_weights()  # to_empty turns tied meta parameters into separate ones
        active_buffers = dict(self._active.named_buffers())
        with torch.no_grad():
            for name, buf in model.named_buffers():
                buf.copy_(active_buffers[name])
        return model.eval()

    def _swap_locked(self) -> None:
        """Exchange active and standby (caller holds ``_swap_lock`` and no forward is running)."""
        t0 = time.perf_counter()
        assert self._standby is not None and self._ready_version is not None and self._slots_standby is not None
        self._active, self._standby = self._standby, self._active
        self._slots_active, self._slots_standby = self._slots_standby, self._slots_active
        self._version, self._ready_version = self._ready_version, None
        self.last_swap_pause_s = time.perf_counter() - t0
        self._swaps.append((self._version, time.time()))
        self._swap_timings.append((self.last_load_s, t0 - self._ready_at))
        self._staged_cond.notify_all()
        done = [w for w in self._waiters if w[0] <= self._version]
        for w in done:
            self._waiters.remove(w)
            try:
                w[1].call_soon_threadsafe(_resolve, w[2])
            except RuntimeError:  # the waiter's loop is closed
                pass

    def _step_model(self) -> tuple[PreTrainedModel, int]:
        """The model and version for the next forward, after a swap if a staged version is ready."""
        if self._ready_version is not None:
            t0 = time.perf_counter()
            with self._swap_lock:
                if self._ready_version is not None:
                    self._swap_locked()
                    self.last_swap_pause_s = time.perf_counter() - t0
        return self._active, self._version

    @contextmanager
    def _batch_running(self) -> Iterator[None]:
        """A batch is being decoded: the loader leaves the swap to :meth:`_step_model`; a version that became
        ready during the last step goes in as the batch ends."""
        with self._swap_lock:
            self._busy = True
        try:
            yield
        finally:
            with self._swap_lock:
                self._busy = False
                if self._ready_version is not None:
                    self._swap_locked()


def _resolve(fut: asyncio.Future) -> None:
    if not fut.done():
        fut.set_result(None)
