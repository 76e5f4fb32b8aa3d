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

**Encoded elsewhere.** :meth:`BackgroundPublisher.offer_encoded` takes a version that something else encodes
(:class:`~async_rl.weights.gpu.encoder.GpuEncoder`, on the learner's GPU, from a GPU slot): the same coalescing, full
versions and commit, with the delta's base kept by the encoder; :attr:`BackgroundPublisher.link_bytes_per_s` (the
transport's measured rate) tells it whether a delta pays.

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
from typing import TYPE_CHECKING

import torch

from async_rl.weights.manifest import GPU_CHECKSUM, Manifest
from async_rl.weights.publisher import PublishStats, RankPart, WeightPublisher
from async_rl.weights.snapshot import Piece, Snapshot, Snapshotter

if TYPE_CHECKING:
    from async_rl.weights.gpu.encoder import EncodedVersion

log = logging.getLogger(__name__)

Source = Callable[[], Iterable[Piece | tuple[str, torch.Tensor]]]
"""Called in a worker thread at the step boundary: this rank's pieces (or whole tensors), to be copied at once."""
Encode = Callable[[bool, int, "float | None"], "EncodedVersion"]
"""Called in a worker thread: (full wanted, the base version a delta may use, the link's bytes/s or None) -> the
version encoded (:meth:`~async_rl.weights.gpu.encoder.GpuEncoder.encode`)."""
LINK_RATE_WEIGHT = 0.5
"""Weight of the newest version's put rate in :attr:`BackgroundPublisher.link_bytes_per_s` (a moving average)."""


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
    """The snapshot of the last published version (the base of the next delta on the host path)."""
    _base_version: int
    """The version the next delta may apply to (-1: none; on the encoded path the encoder holds its bytes)."""
    _inflight: int | None
    """The version going out."""
    _put_rate: float | None
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
        self._base_version = -1
        self._inflight = None
        self._put_rate = None
        self._task = None
        self._error = None
        self._since_full = 0
        self._on_commit = on_commit

    @property
    def inflight_version(self) -> int | None:
        return self._inflight

    @property
    def link_bytes_per_s(self) -> float | None:
        """The rate versions leave at: ``publisher.link_gbps`` when set, else the transport's own measure of its link
        where it has one, else its puts' (a moving average) where those cross the link; None: not measured yet."""
        if self.publisher.cfg.link_gbps:
            return self.publisher.cfg.link_gbps * 1e9 / 8
        transport = self.publisher.transport
        return transport.link_bytes_per_s() or (self._put_rate if transport.puts_cross_link else None)

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
        self._inflight = version
        self.peak_host_bytes = max(self.peak_host_bytes, self.snapshotter.host_bytes)
        await self._start(self._publish(snap), version)
        return True

    async def offer_encoded(self, version: int, encode: Encode) -> bool:
        """:meth:`offer` for a version encoded elsewhere: returns once ``encode`` (run in a worker thread) has put its
        buckets in host memory; False (skipped) when the previous version is still going out."""
        self._raise_error()
        if self._inflight is not None:
            self.versions_skipped += 1
            return False
        self._inflight = version
        try:
            full = await self._full_now(version)
            t0, taken_at = time.perf_counter(), time.time()
            encoded = await asyncio.to_thread(encode, full, self._base_version, self.link_bytes_per_s)
        except BaseException:
            self._inflight = None
            raise
        if encoded.kind == "delta" and encoded.base != self._base_version:
            self._inflight = None
            raise RuntimeError(f"weights v{version}: encoded against v{encoded.base}, not v{self._base_version}")
        await self._start(self._publish_encoded(encoded, t0, taken_at), version)
        return True

    async def _start(self, publish: Awaitable[None], version: int) -> None:
        self._task = asyncio.create_task(publish, name=f"weights-publish-v{version}")  # type: ignore[arg-type]
        if not self.background:
            await self.wait_idle()
            self._raise_error()

    async def _full_now(self, version: int) -> bool:
        """Whether ``version`` goes out full: the first, every ``full_every``, or asked for by a generator."""
        if not self.use_delta or self._base_version < 0 or self._since_full + 1 >= self.full_every:
            return True
        if await self.publisher.full_wanted():
            log.info("a generator asked for a full weight version: v%d goes out full", version)
            return True
        return False

    async def wait_idle(self) -> None:
        """Wait until no version is going out (a failure stays recorded for :meth:`offer` / :meth:`flush`)."""
        task = self._task
        if task is not None:
            with contextlib.suppress(Exception):
                await asyncio.shield(task)

    async def flush(self, version: int, source: Source | None = None, *, encode: Encode | None = None) -> None:
        """Make ``version`` the published one (if it is newer): wait for the one going out, then publish it (from
        ``source``, or ``encode``d elsewhere), and wait for that too (the end of a run, a resume)."""
        await self.wait_idle()
        self._raise_error()
        if version > self.published_version:
            if encode is not None:
                await self.offer_encoded(version, encode)
            else:
                assert source is not None, "flush needs a source or an encoder"
                await self.offer(version, source)
            await self.wait_idle()
            self._raise_error()

    async def _publish(self, snap: Snapshot) -> None:
        pub = self.publisher
        try:
            full = await self._full_now(snap.version) or self._base is None
            base = None if full or self._base is None else {p.name: p.tensor for p in self._base.pieces}
            part = await pub.write_rank(snap.version, snap.pieces, base=base)
            # Snapshots, encoded delta payloads (raw ones are views of the snapshot) and the two bucket buffers.
            sizes = [b.nbytes for b in part.buckets]
            payload_bytes = sum(sizes) if base is not None else 0
            buffers = min(2, len(sizes)) * max(sizes, default=0)
            self.peak_host_bytes = max(self.peak_host_bytes, self.snapshotter.host_bytes + payload_bytes + buffers)
            manifest = await self._commit(snap.version, part, -1 if base is None else self._base_version,
                                          snap.taken_at, time.time() - (time.perf_counter() - snap.taken_at))  # fmt: skip
        except Exception as exc:  # raised by the next offer/flush: the learner fails as with an inline publish
            self._failed(snap.version, exc)
            self.snapshotter.release(snap)
            return
        finally:
            self._inflight = None
        if self.use_delta:
            self.snapshotter.release(self._base)
            self._base = snap
        else:
            self.snapshotter.release(snap)
        await self._committed(manifest, snap.copy_s, snap.taken_at)

    async def _publish_encoded(self, encoded: EncodedVersion, t0: float, taken_at: float) -> None:
        try:
            part = await self.publisher.write_encoded(encoded.version, encoded.tensors, encoded.buckets, encoded.sums,
                                                      encode_s=encoded.encode_s)  # fmt: skip
            manifest = await self._commit(encoded.version, part, encoded.base, t0, taken_at, checksum=GPU_CHECKSUM)
        except Exception as exc:
            self._failed(encoded.version, exc)
            return
        finally:
            self._inflight = None
        self.snapshotter.release(self._base)  # the host path's base, if it had one: the encoder holds this one's
        self._base = None
        await self._committed(manifest, encoded.encode_s, t0)

    async def _commit(self, version: int, part: RankPart, base: int, started_at: float, taken_at: float,
                      checksum: str | None = None) -> Manifest:  # fmt: skip
        if part.put_s > 0 and part.buckets:
            rate = sum(b.nbytes for b in part.buckets) / part.put_s
            self._put_rate = rate if self._put_rate is None else LINK_RATE_WEIGHT * rate + (1 - LINK_RATE_WEIGHT) * self._put_rate
        return await self.publisher.commit(version, [part], base=base, full_version=self.publisher.newest_full,
                                           started_at=started_at, taken_at=taken_at, checksum=checksum)  # fmt: skip

    def _failed(self, version: int, exc: Exception) -> None:
        log.error("publishing weights v%d failed: %r", version, exc)
        self._error = exc

    async def _committed(self, manifest: Manifest, block_s: float, started_at: float) -> None:
        self._since_full = 0 if manifest.kind == "full" else self._since_full + 1
        self._base_version = manifest.version if self.use_delta else -1
        self.published_version = manifest.version
        stats = self.publisher.last_stats
        assert stats is not None
        record = PublishRecord(manifest.version, manifest.kind, manifest.total_bytes, manifest.full_bytes, block_s,
                               time.perf_counter() - started_at, stats)  # fmt: skip
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
