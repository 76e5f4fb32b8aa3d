"""Generator-side weight sync: load the newest version first, then follow new ones in the background.

:meth:`WeightSync.start` fetches the newest complete version (waiting for the first publish if
there is none yet, saying so every ``wait_log_interval_s``, and giving up at once on :meth:`stop`),
hands it to the engine and waits until the engine applied it, so that the generator's first token
comes from learner weights. Afterwards :meth:`run` (a task of the generator's TaskGroup: if it
fails, the process ends with its error) runs two loops until :meth:`stop`: one follows ``weights:latest`` (woken by NATS announcements, with a periodic
poll of the key as a fallback when a message is missed), one fetches the wanted version in the
background, verifies every bucket and calls :meth:`Engine.stage_weights` (or, for a full version and an engine
that takes one in parts, :meth:`Engine.open_stage` before the first bucket, then hands over each bucket's
tensors once verified: the engine copies one while the next is fetched); the engine keeps generating meanwhile
and stops only for its swap. A version that is corrupt (checksum or size
mismatch, bad manifest) or that the engine refuses is never applied: it is logged, counted and
not retried; the engine keeps its last good weights. A version that vanished (pruned while we
were behind) is skipped for the newer one.

Delta versions (docs/weights.md): the sync holds the tensors of the version it staged last (host memory, shared
with the engine's pending copy and never written) and applies the next delta onto them. A delta that does not
check bit for bit is refused; the version is then built again from its newest full version, and if that fails
too the publisher is asked for a full one (:meth:`WeightReader.request_full`), which the sync moves to when it
comes. A generator that joins late or missed versions builds the newest from its full version plus the deltas
after it.

GPU-held versions (``gpu``: a :class:`~async_rl.weights.gpu.reader.GpuReader`, for a CUDA engine on the learner's
host): the sync follows ``weights:gpu:latest`` and the announcements with transport ``cuda`` as well, and takes
such a version GPU to GPU in milliseconds. When this process cannot map the learner's buffers (another host or
namespace, a device it cannot see) it says so once and follows the host transport's versions only; a GPU version
whose buffers were reused before it was read is skipped for the next, as a pruned one.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from redis.exceptions import RedisError

from actors.generator.config import WeightSyncConfig
from actors.generator.engine import Engine, StagingStream
from async_rl.process.lifecycle import raise_if_cancel_requested
from async_rl.run.names import Names
from async_rl.servers.control import ControlPlane, Message, WeightsAnnounced
from async_rl.weights import CorruptVersion, FetchedVersion, VersionUnavailable, WeightReader
from async_rl.weights.gpu.cuda_ipc import IpcUnavailable
from async_rl.weights.gpu.reader import GpuReader
from async_rl.weights.manifest import GPU_TRANSPORT, Manifest
from async_rl.weights.reader import Sink, StreamOpener, WeightsError
from async_rl.weights.transport import TransportError

log = logging.getLogger(__name__)

TAKEN_AT_KEPT = 64
"""Snapshot times of this many recent versions are kept (the heartbeat turns swaps into snapshot-to-applied)."""
# Errors that may pass on their own (server restart, network blip): retried with capped backoff.
TRANSIENT_ERRORS = (RedisError, TransportError, OSError, asyncio.TimeoutError)


class WeightSync:
    """Keeps an engine on the newest good weight version (see the module docstring)."""

    engine: Engine
    reader: WeightReader
    control: ControlPlane | None
    names: Names
    cfg: WeightSyncConfig
    staged_version: int
    """Newest version handed to the engine (-1: none)."""
    host_wanted: int
    """Newest version known to exist on the host transport."""
    gpu_wanted: int
    """Newest GPU-held version known to exist (-1: none, or no GPU path)."""
    gpu: GpuReader | None
    """The same-host GPU path (None: host transport only; dropped when this process cannot map the buffers)."""
    taken_at: dict[int, float]
    """Unix time each recently staged version's snapshot began on the learner (0: not said), by version."""
    staged_latencies: list[float]
    """Snapshot-to-staged seconds of the versions staged since the last :meth:`take_staged_latencies`."""
    num_staged: int
    num_refused: int
    """Versions refused as corrupt or rejected by the engine."""
    num_unavailable: int
    """Versions that vanished or were incomplete when fetched."""
    num_transient_errors: int
    refused: set[int]
    last_fetch: FetchedVersion | None
    """The last staged version's manifest and timings (its tensors dropped)."""
    num_full_requests: int
    """Full versions asked of the publisher (a delta that could not be built bit for bit, a chain that is gone)."""
    bytes_fetched: int
    """Bucket bytes fetched over the sync's life."""
    _held: FetchedVersion | None
    """The last staged version with its tensors: the base the next delta applies to."""
    last_error: str
    _wake: asyncio.Event
    _stop: asyncio.Event
    _progress: asyncio.Condition
    _sub: Any
    _failures_in_a_row: int
    where: str
    """Where weights come from (for the "still waiting" line): the run's prefix and Redis URL, no credentials."""

    def __init__(
        self,
        engine: Engine,
        reader: WeightReader,
        names: Names,
        cfg: WeightSyncConfig | None = None,
        control: ControlPlane | None = None,
        where: str = "",
        gpu: GpuReader | None = None,
    ) -> None:
        self.engine = engine
        self.gpu = gpu
        self.host_wanted = self.gpu_wanted = -1
        self.taken_at = {}
        self.staged_latencies = []
        self.reader = reader
        self.names = names
        self.cfg = cfg or WeightSyncConfig()
        self.control = control
        self.staged_version = -1
        self.num_staged = self.num_refused = self.num_unavailable = self.num_transient_errors = 0
        self.refused = set()
        self.last_fetch = None
        self.num_full_requests = 0
        self.bytes_fetched = 0
        self._held = None
        self.last_error = ""
        self._wake = asyncio.Event()
        self._stop = asyncio.Event()
        self._progress = asyncio.Condition()
        self._sub = None
        self._failures_in_a_row = 0
        self.where = where or f"prefix {names.prefix}"

    def take_staged_latencies(self) -> list[float]:
        out, self.staged_latencies = self.staged_latencies, []
        return out

    @property
    def num_failures(self) -> int:
        return self.num_refused + self.num_unavailable

    @property
    def wanted_version(self) -> int:
        """Newest version known to exist on a path this sync can take."""
        return max(self.host_wanted, self.gpu_wanted if self.gpu is not None else -1)

    def _want(self, version: int, gpu: bool = False) -> None:
        if gpu and self.gpu is None:
            return
        before = self.wanted_version
        if gpu:
            self.gpu_wanted = max(self.gpu_wanted, version)
        else:
            self.host_wanted = max(self.host_wanted, version)
        if self.wanted_version > before:
            self._wake.set()

    async def _on_announcement(self, msg: Message) -> None:
        assert isinstance(msg, WeightsAnnounced)
        self._want(msg.version, gpu=msg.transport == GPU_TRANSPORT)

    async def _refresh_latest(self) -> None:
        latest = await self.reader.latest_version()
        if latest is not None:
            self._want(latest)
        if self.gpu is not None:
            gpu_latest = await self.gpu.latest_version()
            if gpu_latest is not None:
                self._want(gpu_latest, gpu=True)

    def _drop_gpu(self, exc: Exception) -> None:
        """This process cannot use the GPU path: say so once, and follow the host transport from now on."""
        log.warning("weights: cannot take the learner's GPU buffers here (%s); following the host transport's "
                    "versions (latest %d) instead", exc, self.host_wanted)  # fmt: skip
        if self.gpu is not None:
            self.gpu.close()
        self.gpu = None
        self.gpu_wanted = -1

    async def _wait(self, event: asyncio.Event, timeout_s: float) -> bool:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(event.wait(), timeout_s)
        return event.is_set()

    async def start(self) -> bool:
        """Subscribe and load the newest version into the engine (waiting until applied); False if stopped first."""
        if self.control is not None:
            self._sub = await self.control.subscribe(
                self.names.weights_subject, self._on_announcement, kinds=(WeightsAnnounced,)
            )
        if self.cfg.first_version_timeout_s > 0:
            return await self._load_first()
        return True

    async def run(self) -> None:
        """Follow new versions until :meth:`stop`: the poll and fetch loops in a TaskGroup of their own, so
        that an error in either ends both and reaches the caller's TaskGroup (the process then exits)."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self._poll_loop(), name="weights-poll")
            tg.create_task(self._fetch_loop(), name="weights-fetch")

    @contextlib.asynccontextmanager
    async def following(self) -> AsyncIterator[WeightSync]:
        """After :meth:`start`: :meth:`run` beside the caller's block, stopped and closed at its end (for tests and
        benchmarks; the generator process owns :meth:`run` in its own TaskGroup)."""
        async with asyncio.TaskGroup() as tg:
            tg.create_task(self.run(), name="weights")
            try:
                yield self
            finally:
                await self.close()

    def stop(self) -> None:
        """Make :meth:`start` give up and :meth:`run` return (an in-flight fetch ends at its next step)."""
        self._stop.set()
        self._wake.set()

    async def _load_first(self) -> bool:
        t0 = time.monotonic()
        deadline = t0 + self.cfg.first_version_timeout_s
        next_note = t0 + self.cfg.wait_log_interval_s
        while self.staged_version < 0:
            if self._stop.is_set():
                return False
            if self.control is not None:
                self.control.check()  # NATS gone for good: exit for the supervisor instead of waiting deaf
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise TimeoutError(
                    f"no usable weight version of {self.where} within {self.cfg.first_version_timeout_s}s "
                    f"(latest {self.wanted_version}, refused {sorted(self.refused)}); is a learner publishing there?"
                )
            if now >= next_note:
                log.info("still waiting for weights of %s (%.0fs so far)", self.where, now - t0)
                next_note = now + self.cfg.wait_log_interval_s
            await self._refresh_or_give_up()
            target = self.wanted_version
            if target >= 0 and target not in self.refused:
                await self._sync_to(target)
                continue
            self._wake.clear()
            await self._wait(self._wake, min(self.cfg.poll_interval_s, max(left, 0.001)))
        if self._stop.is_set():
            return False
        if not await self.engine.wait_applied(self.staged_version, self.cfg.apply_timeout_s):
            raise TimeoutError(
                f"the engine did not apply weights version {self.staged_version} within {self.cfg.apply_timeout_s}s"
            )
        log.info("engine is on weights version %d", self.staged_version)
        return True

    async def _sync_to(self, target: int) -> bool:
        """Fetch, verify and stage ``target``; True when staged. Transient errors are retried here. :meth:`stop`
        cancels it at once (a fetch can wait a minute for a source, ``peer://`` with none up): nothing of it is
        staged then."""
        work = asyncio.ensure_future(self._try_sync_to(target))
        stopped = asyncio.ensure_future(self._stop.wait())
        try:
            done, _ = await asyncio.wait({work, stopped}, return_when=asyncio.FIRST_COMPLETED)
            return work.result() if work in done else False
        finally:
            stopped.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            async with self._progress:
                self._progress.notify_all()

    async def _try_sync_to(self, target: int) -> bool:
        backoff_s = 0.1
        for attempt in range(1, self.cfg.max_retries + 1):
            try:
                fetched = await self._fetch_and_stage(target)
            except VersionUnavailable as exc:
                self.num_unavailable += 1
                self.last_error = str(exc)
                log.warning("weights version %d skipped: %s", target, exc)
                self.refused.add(target)  # it will not come back; a newer one will be announced
                if "pruned" in str(exc) or "is a delta" in str(exc):
                    await self._request_full()  # the chain to it is gone: the next version is full
                await self._refresh_latest()
                return False
            except (CorruptVersion, ValueError) as exc:
                self.num_refused += 1
                self.refused.add(target)
                self.last_error = str(exc)
                log.error("weights version %d refused, keeping version %d: %s", target, self.staged_version, exc)
                await self._request_full()
                return False
            except (*TRANSIENT_ERRORS, WeightsError) as exc:
                self.num_transient_errors += 1
                self.last_error = repr(exc)
                if attempt == self.cfg.max_retries:
                    log.error("weights version %d given up after %d attempts: %r", target, attempt, exc)
                    self.refused.add(target)
                    return False
                log.warning("fetching weights version %d failed (%r); retry in %.1fs", target, exc, backoff_s)
                if await self._wait(self._stop, backoff_s):
                    return False
                backoff_s = min(backoff_s * 2, self.cfg.max_backoff_s)
                continue
            self.staged_version = fetched.version
            # The base of the next delta (the engine only reads these tensors); a GPU version is never a delta's base.
            self._held = fetched if fetched.manifest.ipc is None else None
            self.taken_at[fetched.version] = fetched.manifest.taken_at
            if fetched.manifest.taken_at > 0 and len(self.staged_latencies) < TAKEN_AT_KEPT:
                self.staged_latencies.append(round(time.time() - fetched.manifest.taken_at, 6))
            while len(self.taken_at) > TAKEN_AT_KEPT:
                del self.taken_at[min(self.taken_at)]
            self.bytes_fetched += fetched.bytes_fetched
            # Timings and manifest only: the tensors (a whole version of buffers) belong to the engine now.
            self.last_fetch = dataclasses.replace(fetched, tensors={})
            self.num_staged += 1
            log.debug(
                "staged weights v%d: %.1f MB in %.2fs (%.2f GB/s; waiting for verified bytes %.2fs)",
                fetched.version, fetched.manifest.total_bytes / 1e6, fetched.total_s, fetched.gbps, fetched.transfer_s,
            )  # fmt: skip
            return True
        return False

    async def _fetch_and_stage(self, target: int) -> FetchedVersion:
        """Fetch ``target`` and hand it to the engine (in parts as it arrives where the engine takes them); over the
        GPU path when it is a GPU-held version this process can map."""
        if self.gpu is not None and target <= self.gpu_wanted:
            copier = self.engine.gpu_copier()  # an engine that copies GPU versions itself (vLLM's workers)
            if copier is not None:
                await self.engine.ready()  # its first-use set-up must not run inside the copy's short lease
            try:
                fetched = await self.gpu.fetch(target, copy=copier)
            except IpcUnavailable as exc:
                self._drop_gpu(exc)
                if self.host_wanted <= self.staged_version:
                    raise VersionUnavailable(f"weights version {target} is held on the learner's GPU only") from None
                target = self.host_wanted
            else:
                if copier is not None:
                    self.engine.stage_copied(fetched.version)
                else:
                    self.engine.stage_weights(fetched.tensors, fetched.version)
                return fetched
        streams: list[StagingStream] = []
        try:
            fetched = await self._fetch(target, self._opener(streams))
            if fetched.streamed:
                streams.pop().finish()
            else:
                self.engine.stage_weights(fetched.tensors, fetched.version)
            return fetched
        finally:
            for stream in streams:  # not finished: the fetch failed or was cancelled
                stream.abort()

    async def _fetch(self, target: int, stream: StreamOpener) -> FetchedVersion:
        """``target`` built onto the held version when a chain of deltas leads there; a delta that does not check
        is refused, then built again from its full version (the held copy is not trusted any more)."""
        if self._held is None:
            return await self.reader.fetch(target, stream=stream)
        try:
            return await self.reader.fetch(target, have=self._held, stream=stream)
        except CorruptVersion as exc:
            log.warning("weights version %d did not build bit for bit on the held v%d (%s); refetching it from its "
                        "full version", target, self._held.version, exc)  # fmt: skip
            self._held = None
            return await self.reader.fetch(target, stream=stream)

    def _opener(self, streams: list[StagingStream]) -> StreamOpener:
        """Opens the engine's stream for a full version about to be read (None where the engine takes whole
        versions). ``streams`` holds the open one; :meth:`_fetch_and_stage` finishes it or aborts what is left."""

        def open_stream(manifest: Manifest) -> Sink | None:
            while streams:
                streams.pop().abort()
            if not self.cfg.stream:
                return None
            stream = self.engine.open_stage(manifest.version, manifest.layout())
            if stream is None:
                return None
            streams.append(stream)
            return stream.put

        return open_stream

    async def _request_full(self) -> None:
        self._held = None
        if await self.reader.request_full():
            self.num_full_requests += 1

    async def _refresh_or_give_up(self) -> bool:
        """Read the newest version; a failure is logged and retried by the caller, but ``max_retries`` failures in a
        row (each after the Redis client's own retries) raise, so that a lost server ends the process (no silent
        waiting: its supervisor restarts it). True when the read succeeded."""
        try:
            await self._refresh_latest()
        except TRANSIENT_ERRORS as exc:
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= self.cfg.max_retries:
                raise ConnectionError(f"reading the weights of {self.where} failed {self._failures_in_a_row} times "
                                      f"in a row; last: {exc!r}") from exc  # fmt: skip
            log.warning("reading the latest weight version failed (%d in a row): %r", self._failures_in_a_row, exc)
            return False
        self._failures_in_a_row = 0
        return True

    async def _poll_loop(self) -> None:
        backoff_s = self.cfg.poll_interval_s
        while not await self._wait(self._stop, backoff_s):
            raise_if_cancel_requested()  # a cancel swallowed by redis-py or wait_for must still end this loop
            if await self._refresh_or_give_up():
                backoff_s = self.cfg.poll_interval_s
            else:
                backoff_s = min(backoff_s * 2, max(self.cfg.max_backoff_s, self.cfg.poll_interval_s))

    async def _fetch_loop(self) -> None:
        while not self._stop.is_set():
            await self._wake.wait()
            self._wake.clear()
            if self._stop.is_set():
                return
            target = self.wanted_version
            if target > self.staged_version and target not in self.refused:
                await self._sync_to(target)

    async def wait_staged(self, version: int, timeout_s: float) -> bool:
        """Wait until ``version`` (or newer) was staged, or refused; True when staged (for tests, benches)."""
        async with self._progress:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(
                    self._progress.wait_for(lambda: self.staged_version >= version or version in self.refused),
                    timeout_s,
                )
        return self.staged_version >= version

    async def close(self) -> None:
        """Unsubscribe (after :meth:`run` has returned)."""
        self.stop()
        if self._sub is not None:
            with contextlib.suppress(Exception):  # the connection may be draining already
                await self._sub.unsubscribe()
            self._sub = None
