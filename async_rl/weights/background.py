"""One rank's weights out of the training loop: snapshot, then encode, check and send in the background.

:meth:`BackgroundPublisher.offer` is called at every step boundary that should publish. It waits only for
:class:`~async_rl.weights.snapshot.Snapshotter` to copy the weights into a free slot of reused host buffers, then
returns; a named task encodes (full, or delta against the last published version), writes the buckets and
commits the manifest (:class:`~async_rl.weights.publisher.WeightPublisher`) while the next steps train.

* **Coalescing.** Two slots: one holds the last published version (the base of the next delta), one the version
  going out. A step boundary that finds a version still going out takes no snapshot: its version is skipped
  (``versions_skipped``) and the first boundary after the publish ends snapshots the newest weights. Version
  numbers may therefore jump; generators always move to the newest complete one.
* **Full versions** go out first, every ``full_every`` versions, and when a generator asked for one
  (:meth:`WeightPublisher.full_wanted`); the others are deltas from the previous published version.
* **Nothing half visible.** The manifest is committed last, by one Lua script (:mod:`.publisher`); a process
  killed mid-publish leaves buckets that only its staging record names, deleted by the next publisher.
* **Errors surface.** A publish that fails is raised by the next :meth:`offer` / :meth:`flush`, so the learner
  fails as it did when it published inline.
* ``background=False``: :meth:`offer` waits for the publish it starts (the same path, no overlap).

Single-rank here (the torch backend); a multi-rank backend calls :meth:`WeightPublisher.write_rank` on each rank
with its pieces and :meth:`WeightPublisher.commit` on rank 0 with the gathered parts.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import torch

from async_rl.weights.manifest import Manifest
from async_rl.weights.publisher import PublishStats, WeightPublisher
from async_rl.weights.snapshot import Piece, Snapshot, Snapshotter

log = logging.getLogger(__name__)

Source = Callable[[], Iterable[Piece | tuple[str, torch.Tensor]]]
"""Called in a worker thread at the step boundary: this rank's pieces (or whole tensors), to be copied at once."""


@dataclass(slots=True)
class PublishRecord:
    """One committed version, as the learner reports it."""

    version: int
    kind: str
    bytes_sent: int
    full_bytes: int
    block_s: float
    """Time the training loop waited for the snapshot."""
    latency_s: float
    """From the start of the snapshot to the manifest committed."""
    stats: PublishStats

    @property
    def delta_ratio(self) -> float:
        return self.bytes_sent / max(self.full_bytes, 1)


class BackgroundPublisher:
    """Snapshot at the step boundary, publish in the background (see the module docstring)."""

    publisher: WeightPublisher
    snapshotter: Snapshotter
    background: bool
    use_delta: bool
    full_every: int
    versions_skipped: int
    published_version: int
    """Newest committed version (-1: none)."""
    records: list[PublishRecord]
    """Committed versions not yet taken by :meth:`take_records`."""
    peak_host_bytes: int
    """Most host bytes held at once for publishing: snapshot slots, encoded delta payloads, bucket buffers."""
    _base: Snapshot | None
    _inflight: Snapshot | None
    _task: asyncio.Task | None
    _error: BaseException | None
    _since_full: int
    _on_commit: Callable[[PublishRecord], Awaitable[None] | None] | None

    def __init__(
        self, publisher: WeightPublisher, *, on_commit: Callable[[PublishRecord], Awaitable[None] | None] | None = None
    ) -> None:
        cfg = publisher.cfg
        self.publisher = publisher
        self.snapshotter = Snapshotter(num_slots=2)
        self.background = cfg.background
        self.use_delta = cfg.delta and cfg.full_every > 1
        self.full_every = cfg.full_every
        self.versions_skipped = 0
        self.published_version = -1
        self.records = []
        self.peak_host_bytes = 0
        self._base = None
        self._inflight = None
        self._task = None
        self._error = None
        self._since_full = 0
        self._on_commit = on_commit

    @property
    def inflight_version(self) -> int | None:
        return None if self._inflight is None else self._inflight.version

    def _raise_error(self) -> None:
        if self._error is not None:
            exc, self._error = self._error, None
            raise exc

    async def offer(self, version: int, source: Source) -> bool:
        """At a step boundary: snapshot ``source`` as ``version`` and publish it in the background; False (and
        the version counted as skipped) when the previous version is still going out."""
        self._raise_error()
        if self._inflight is not None:
            self.versions_skipped += 1
            return False
        snap = await asyncio.to_thread(lambda: self.snapshotter.take(version, source()))
        self._inflight = snap
        self.peak_host_bytes = max(self.peak_host_bytes, self.snapshotter.host_bytes)
        self._task = asyncio.create_task(self._publish(snap), name=f"weights-publish-v{version}")
        if not self.background:
            await self.wait_idle()
            self._raise_error()
        return True

    async def wait_idle(self) -> None:
        """Wait until no version is going out (a failure stays recorded for :meth:`offer` / :meth:`flush`)."""
        task = self._task
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    async def flush(self, version: int, source: Source) -> None:
        """Make ``version`` the published one (if it is newer): wait for the one going out, then publish it, and
        wait for that too (the end of a run, a resume)."""
        await self.wait_idle()
        self._raise_error()
        if version > self.published_version:
            await self.offer(version, source)
            await self.wait_idle()
            self._raise_error()

    async def _publish(self, snap: Snapshot) -> None:
        pub = self.publisher
        try:
            full = not self.use_delta or self._base is None or self._since_full + 1 >= self.full_every
            if not full and await pub.full_wanted():
                log.info("a generator asked for a full weight version: v%d goes out full", snap.version)
                full = True
            base = None if full or self._base is None else {p.name: p.tensor for p in self._base.pieces}
            part = await pub.write_rank(snap.version, snap.pieces, base=base)
            # Snapshots, encoded delta payloads (raw ones are views of the snapshot) and the two bucket buffers.
            sizes = [b.nbytes for b in part.buckets]
            payload_bytes = sum(sizes) if base is not None else 0
            buffers = min(2, len(sizes)) * max(sizes, default=0)
            self.peak_host_bytes = max(self.peak_host_bytes, self.snapshotter.host_bytes + payload_bytes + buffers)
            assert self._base is not None or base is None
            manifest: Manifest = await pub.commit(
                snap.version, [part], base=-1 if base is None else self._base.version,  # type: ignore[union-attr]
                full_version=pub.newest_full, started_at=snap.taken_at,
                taken_at=time.time() - (time.perf_counter() - snap.taken_at),
            )  # fmt: skip
        except Exception as exc:  # raised by the next offer/flush: the learner fails as with an inline publish
            log.error("publishing weights v%d failed: %r", snap.version, exc)
            self._error = exc
            self.snapshotter.release(snap)
            return
        finally:
            self._inflight = None
        self._since_full = 0 if manifest.kind == "full" else self._since_full + 1
        if self.use_delta:
            self.snapshotter.release(self._base)
            self._base = snap
        else:
            self.snapshotter.release(snap)
        self.published_version = snap.version
        stats = pub.last_stats
        assert stats is not None
        record = PublishRecord(snap.version, manifest.kind, manifest.total_bytes, manifest.full_bytes, snap.copy_s,
                               time.perf_counter() - snap.taken_at, stats)  # fmt: skip
        self.records.append(record)
        if self._on_commit is not None:
            result = self._on_commit(record)
            if result is not None:
                await result

    def take_records(self) -> list[PublishRecord]:
        out, self.records = self.records, []
        return out

    async def aclose(self, timeout_s: float = 60.0) -> None:
        """Let the version going out finish (up to ``timeout_s``), then cancel it."""
        task = self._task
        if task is not None and not task.done():
            try:
                await asyncio.wait_for(asyncio.shield(task), timeout_s)
            except TimeoutError:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            except Exception:  # recorded in _error; nothing more to do at close
                pass
