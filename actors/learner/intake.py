"""The learner's intake: prompts issued under admission control, and batches collected within the staleness bound.

:class:`Intake` is the half of :class:`~actors.learner.loop.Learner` that feeds generators and reads their groups:
prompts go out up to the admission bound ((S+1-lag)·B groups issued and not yet consumed, counted from the audit's
open set), and a batch is B groups read from the rollout stream with duplicates acked and skipped and the staleness
policy applied (drop-and-count or keep); a learner starved of rollouts says so, and what it waits for.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time

from actors.learner.checkpoint import LearnerState
from actors.learner.config import LearnerConfig
from actors.learner.signals import LearnerSignals
from async_rl.process.repeated import RepeatedLine
from async_rl.servers.control import ControlPlane
from async_rl.tasks.base import Task
from buffer.prompts import PromptQueue
from buffer.rollouts import RolloutEntry, RolloutReader
from buffer.staleness import StalenessPolicy

log = logging.getLogger("actors.learner.loop")  # the learner's log, as before the split

CONSUMER = "learner"
"""Consumer name of the learner in the rollout group: a restarted learner picks up its own pending entries."""


class Intake:
    """Issuing prompts and collecting batches (mixed into :class:`~actors.learner.loop.Learner`, which sets these)."""

    cfg: LearnerConfig
    state: LearnerState
    stop_event: asyncio.Event
    _control: ControlPlane | None
    _signals: LearnerSignals
    _prompts: PromptQueue | None
    _reader: RolloutReader | None
    _task: Task
    _unacked: list[tuple[str, str, int]]
    _max_staleness_seen: int
    _dropped_line: RepeatedLine
    """"dropped N groups over the staleness bound": once, then a summary every 30 s, never one line per batch."""
    _shown_first_prompt: bool
    """The first prompt this process issued has been logged, as the model reads it (chat template and all)."""

    async def _feed_prompts(self) -> int:
        """Issue prompts up to the admission bound; returns how many were issued."""
        assert self._prompts is not None
        cfg = self.cfg
        assert self._reader is not None
        # Held: groups read and not finished. Asynchronous, the batch being collected counts (its prompts are done
        # with); synchronous, only trained steps waiting for their checkpoint, so the next batch's prompts go out
        # once this step is trained, stamped with the version they will be trained at.
        held = len(self._unacked) if cfg.staleness.sync else len(self._reader.in_flight)
        room = await self._prompts.capacity(cfg.staleness.max_staleness - cfg.admission_lag_versions, cfg.batch_groups,
                                            held=held)  # fmt: skip
        if room <= 0:
            return 0
        sampling = dataclasses.replace(cfg.sampling,
                                       max_new_tokens=cfg.sampling.max_new_tokens or self._task.max_new_tokens)  # fmt: skip
        start = self.state.prompts_issued
        specs = []
        min_version = self.state.version if cfg.staleness.sync else -1  # sync: sampled with this version only
        for i in range(start, start + room):
            spec = self._task.prompt(i)
            specs.append(dataclasses.replace(spec, sampling=sampling, min_version=min_version))
        await self._prompts.issue(specs, self.state.version)
        if not self._shown_first_prompt:
            self._shown_first_prompt = True
            first = specs[0]
            log.info("first prompt %s, as the model reads it (%d tokens): %r", first.prompt_id, len(first.prompt_ids),
                     self._task.prompt_text(first.prompt_ids))  # fmt: skip
        self.state.prompts_issued = start + room
        return room

    async def _collect_batch(self) -> list[RolloutEntry]:
        """B groups within the staleness bound (fewer only when stopping)."""
        assert self._reader is not None and self._prompts is not None
        cfg = self.cfg
        policy = StalenessPolicy(cfg.staleness)
        batch: list[RolloutEntry] = []
        taken: set[str] = set()
        taken_prompts: set[str] = set()
        seen = _Union(self.state.seen_group_ids, taken)
        since = time.monotonic()
        next_note = since + cfg.starved_log_interval_s
        while len(batch) < cfg.batch_groups and not self.stop_event.is_set():
            assert self._control is not None
            self._control.check()  # NATS gone for good: exit for the supervisor rather than train deaf
            await self._feed_prompts()
            entries = await self._reader.read(CONSUMER, cfg.batch_groups - len(batch), cfg.read_block_ms, seen=seen)
            if not entries:
                if time.monotonic() >= next_note:  # starved: say so, and what for, instead of silence
                    await self._note_starved(len(batch), time.monotonic() - since)
                    next_note = time.monotonic() + cfg.starved_log_interval_s
                continue
            fresh = []
            for e in entries:  # two deliveries of one group (or two groups of one prompt) inside a batch
                if e.record.group_id in taken or e.record.prompt_id in taken_prompts:
                    await self._reader.ack_dropped([e], counter="duplicates")
                else:
                    taken.add(e.record.group_id)
                    taken_prompts.add(e.record.prompt_id)
                    fresh.append(e)
            selection = policy.select(fresh, self.state.version)
            if selection.drop:
                v = self.state.version
                await self._reader.ack_dropped(selection.drop, fates=[
                    (e.record.prompt_id, f"lag {v - e.record.min_version}") for e in selection.drop])  # fmt: skip
                self._dropped_line.add(len(selection.drop))
            over = int(selection.metrics.get("num_over_bound", 0)) - len(selection.drop)
            if over > 0:
                await self._reader.count("kept_stale", over)
            self._max_staleness_seen = max(self._max_staleness_seen, int(selection.metrics.get("staleness_max", 0)))
            batch += selection.keep
        if self.stop_event.is_set() and batch:
            # Not trained: leave them pending for the next learner (they are reclaimed by name on restart).
            log.info("stopping with %d groups read but not trained; they stay pending", len(batch))
            return []
        return batch

    async def _note_starved(self, have: int, waited_s: float) -> None:
        assert self._prompts is not None
        counters = await self._prompts.audit.counters()
        alive = self._signals.generators_alive()
        await self._signals.report_lost()
        self._dropped_line.flush()
        log.info("waiting for rollouts for %.0fs: %d of %d groups of step %d in hand; %d prompts issued and not yet "
                 "returned; %d generators alive (async-rl status --prefix %s shows them)", waited_s, have,
                 self.cfg.batch_groups, self.state.step + 1, counters["in_flight"], alive,
                 self.cfg.run.prefix)  # fmt: skip


class _Union:
    """Membership in either of two sets, without copying the (large) set of trained group ids."""

    __slots__ = ("a", "b")

    def __init__(self, a: set[str], b: set[str]) -> None:
        self.a, self.b = a, b

    def __contains__(self, item: object) -> bool:
        return item in self.a or item in self.b
