"""The generator's work: prompts in, scored groups out, several batches generating at once.

Mixed into :class:`~actors.generator.process.Generator`. The work loop reads prompts through the consumer group
(evaluation prompts first) and starts each batch as a task of its own, up to ``generator.batches_in_flight`` at
once (:func:`batches_in_flight`): with vLLM the next batch joins the engine while the last one's longest samples
finish, instead of the engine draining to nothing at the end of every batch. Each batch generates (an environment
task runs one episode of several turns per sample, :mod:`actors.generator.episodes`), scores and pushes one group
record per prompt as soon as that prompt's samples are done (the batch's longest sample holds back no other group;
the groups done by then go together, in one transaction, so 16 groups ending in one step cost a round trip, not 16),
and acks the prompt only after its push; a group whose reward or environment raised goes to the dead letters instead
(:mod:`actors.generator.scoring`). The prompts of every batch in hand are held (touched by the heartbeat, released on
shutdown). A stop takes no new prompts and lets the batches in hand finish (or give up at the abort, after pushing
the groups already done); a batch that raises ends the work loop with its error.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from actors.generator.config import GeneratorConfig
from actors.generator.core_follow import CoreFollow
from actors.generator.engine import Engine, SamplingParams
from actors.generator.episodes import run_group
from actors.generator.metrics import GeneratorMetrics
from actors.generator.scoring import ScoredGroup, Scoring
from actors.generator.weight_sync import WeightSync
from async_rl.process.lifecycle import raise_if_cancel_requested
from async_rl.tasks.base import Task
from async_rl.tasks.envs.base import EnvTask
from async_rl.tasks.mixture import SOURCE_KEY
from async_rl.wire.sampling import Sampling
from async_rl.wire.types import GroupRecord, Sample
from buffer.dead_letters import error_line
from buffer.evals import GREEDY_KEY, EvalQueue
from buffer.prompts import PromptEntry, PromptQueue
from buffer.rollout_writer import RolloutWriter

log = logging.getLogger("actors.generator.process")  # the generator's log, as before the split


def batches_in_flight(cfg: GeneratorConfig) -> int:
    """Batches generating at once: ``generator.batches_in_flight``, or (0) the engine's default: 2 for vLLM, whose
    continuous batching takes a new batch in mid-flight; 1 for the torch engine, whose decode thread runs one
    batch at a time anyway."""
    if cfg.batches_in_flight:
        return cfg.batches_in_flight
    return 2 if cfg.engine == "vllm" else 1


class BusyClock:
    """Seconds during which at least one batch was generating (overlapping batches count once)."""

    def __init__(self) -> None:
        self._active = 0
        self._since = 0.0
        self._done_s = 0.0

    def enter(self) -> None:
        if self._active == 0:
            self._since = time.monotonic()
        self._active += 1

    def leave(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._done_s += time.monotonic() - self._since

    @property
    def seconds(self) -> float:
        """Busy seconds so far, the current stretch included."""
        return self._done_s + (time.monotonic() - self._since if self._active else 0.0)


class Work:
    """The work half of the generator (mixed into :class:`~actors.generator.process.Generator`, which sets these)."""

    cfg: GeneratorConfig
    stop_event: asyncio.Event
    """Set by SIGTERM/SIGINT or a 'stop'/'drain' control message: take no new prompts."""
    resume_event: asyncio.Event
    """Cleared while paused."""
    num_prompts: int
    num_tokens: int
    _busy: BusyClock
    """When the engine was generating (``generate_s``, the busy share heartbeats carry)."""
    version_wait_s: float
    """Seconds batches spent waiting for a prompt's ``min_version`` (synchronous mode), or for a version about to
    arrive (``weight_sync.fresh_wait_s``), since start (summed over batches in flight at once)."""
    _fresh_waited: int
    """The newest version a batch waited for (:meth:`_fresh_weights`)."""
    _redis: aioredis.Redis | None
    _engine: Engine | None
    _sync: WeightSync | CoreFollow | None
    _task: Task | None
    _prompts: PromptQueue | None
    _held: list[PromptEntry]
    """The prompts of every batch in hand (released on shutdown, touched by the heartbeat)."""
    _evals: EvalQueue | None
    """The run's evaluation queue (buffer/evals.py): read before training prompts, scored, never trained on."""
    _held_evals: list[PromptEntry]
    _abort_event: asyncio.Event
    """Set to give up the batches in hand (a stop, or the drain's deadline)."""
    _scoring: Scoring
    """Errors of the task's own code (reward, environment): counted per reason, their groups dead-lettered."""
    _metrics: GeneratorMetrics
    """Prometheus /metrics (a no-op unless prometheus.port is set)."""

    @property
    def generate_s(self) -> float:
        """Seconds during which the engine was generating since start (heartbeats carry it: the busy share)."""
        return self._busy.seconds

    async def _work_loop(self) -> None:
        """Read prompts and keep up to :func:`batches_in_flight` batches generating at once (module docstring);
        returns once stopped (the batches in hand finished or given up) or at ``max_prompts``."""
        assert self._redis is not None and self._engine is not None and self._prompts is not None
        cfg = self.cfg
        prompts = self._prompts
        writer = RolloutWriter(self._redis, cfg.run.names, cfg.rollouts)
        limit = batches_in_flight(cfg)
        running: set[asyncio.Task] = set()
        async with asyncio.TaskGroup() as tg:
            while not self.stop_event.is_set():
                raise_if_cancel_requested()
                if not self.resume_event.is_set():
                    await self.resume_event.wait()
                    continue
                want = self._engine.max_batch_prompts
                if cfg.max_prompts:
                    want = min(want, cfg.max_prompts - self.num_prompts - len(self._held))
                if len(running) >= limit or want <= 0:
                    if not running:
                        log.info("generator %s: max_prompts reached", cfg.generator_id)
                        return
                    await asyncio.wait(running, return_when=asyncio.FIRST_COMPLETED)
                    continue
                assert self._evals is not None
                evals = await self._evals.read(cfg.generator_id, want)  # evaluation first: a round is small and due now
                if evals:
                    self._held_evals = list(evals)
                    await self._evaluate(evals)
                    continue
                entries = await prompts.read(cfg.generator_id, want, block_ms=cfg.read_block_ms)
                if not entries:
                    continue
                self._held.extend(entries)
                batch = tg.create_task(self._process(entries, prompts, writer), name="generator-batch")
                running.add(batch)
                batch.add_done_callback(running.discard)

    async def _process(self, entries: list[PromptEntry], prompts: PromptQueue, writer: RolloutWriter) -> None:
        """Generate, score and push every entry, each group as soon as its samples are done (the engine's
        :meth:`~actors.generator.engine.Engine.generate_each`; those done by then together), acking the prompts right
        after their push. An abort stops the generation, not a push under way."""
        by_params: dict[Sampling, list[PromptEntry]] = defaultdict(list)
        for e in entries:
            by_params[self._sampling(e)].append(e)
        for sp, group in by_params.items():
            params = SamplingParams(n=sp.n, max_new_tokens=sp.max_new_tokens, temperature=sp.temperature,
                                    top_p=sp.top_p, top_k=sp.top_k, mask_special_tokens=sp.mask_special_tokens)  # fmt: skip
            t0 = time.time()
            done: asyncio.Queue[tuple[int, ScoredGroup] | None] = asyncio.Queue()
            gen = asyncio.ensure_future(self._generate_into(group, params, done))
            abort = asyncio.ensure_future(self._abort_event.wait())
            try:
                while (item := await self._next_or_abort(done, abort)) is not None:
                    ready, ended = [item], False
                    while not done.empty():  # the groups that ended with it go in the same round trip
                        more = done.get_nowait()
                        if more is None:
                            ended = True
                            break
                        ready.append(more)
                    await self._push([(group[i], scored) for i, scored in ready], prompts, writer, time.time() - t0)
                    if ended:
                        break
            finally:
                abort.cancel()
                if not gen.done():  # aborted: its outcome no longer matters; held prompts are released by close()
                    gen.cancel()
                    await asyncio.gather(gen, return_exceptions=True)
            if abort.done() and not abort.cancelled():
                return
            gen.result()  # the generation's error, if it raised

    async def _generate_into(self, group: list[PromptEntry], params: SamplingParams,
                             done: asyncio.Queue[tuple[int, ScoredGroup] | None]) -> None:  # fmt: skip
        """:meth:`_generate_each` into ``done``, then None (also when it raised)."""
        try:
            await self._generate_each(group, params, lambda i, scored: done.put_nowait((i, scored)))
        finally:
            done.put_nowait(None)

    @staticmethod
    async def _next_or_abort(done: asyncio.Queue, abort: asyncio.Future) -> Any:
        """The next finished group (None: the generation ended), or None once aborted."""
        if not done.empty():
            return done.get_nowait()
        getter = asyncio.ensure_future(done.get())
        try:
            await asyncio.wait({getter, abort}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            if not getter.done():
                getter.cancel()
        return getter.result() if getter.done() and not getter.cancelled() else None

    async def _push(self, done: list[tuple[PromptEntry, ScoredGroup]], prompts: PromptQueue, writer: RolloutWriter,
                    gen_s: float) -> None:  # fmt: skip
        """Groups to the rollout stream in one transaction and their prompts acked in one more (those the task's code
        raised on, to the dead letters one by one)."""
        good = [(entry, scored) for entry, scored in done if not scored.failed]
        for entry, scored in done:
            if scored.failed:  # the task's code raised on it: the dead letters, with the error, and go on
                await asyncio.shield(self._dead_letter(prompts, entry, scored))
        if good:
            await writer.append_many([self._record(entry, scored.samples, gen_s) for entry, scored in good])
            await asyncio.shield(prompts.ack([entry for entry, _ in good]))
        pushed = {entry.entry_id for entry, _ in done}
        self._held = [h for h in self._held if h.entry_id not in pushed]
        for _, scored in done:
            self.num_prompts += 1
            num_tokens = sum(int(s.response_ids.size) for s in scored.samples)
            self.num_tokens += num_tokens
            self._metrics.generated(1, num_tokens)
            self._scoring.judge(scored)  # every sample of too many groups in a row failed: ScoringFailed

    async def _dead_letter(self, prompts: PromptQueue, entry: PromptEntry, scored: ScoredGroup) -> None:
        assert scored.first_error is not None
        await prompts.dead_letter(entry, scored.dead_letter_reason(), error_line(scored.first_error),
                                  self.cfg.generator_id)  # fmt: skip
        self._metrics.dead_lettered()

    async def _evaluate(self, entries: list[PromptEntry]) -> None:
        """Generate and score evaluation prompts; each result goes to the evaluation queue with the prompt's ack
        (buffer/evals.py), never to the rollout stream."""
        assert self._evals is not None and self._task is not None
        by_params: dict[tuple[Sampling, bool], list[PromptEntry]] = defaultdict(list)
        for e in entries:
            by_params[(self._sampling(e), bool(e.spec.metadata.get(GREEDY_KEY)))].append(e)
        for (sp, greedy), group in by_params.items():
            params = SamplingParams(n=sp.n, max_new_tokens=sp.max_new_tokens, temperature=0.0 if greedy else sp.temperature,
                                    top_p=sp.top_p, top_k=sp.top_k, mask_special_tokens=sp.mask_special_tokens)  # fmt: skip
            gen = asyncio.ensure_future(self._generate(group, params))
            abort = asyncio.ensure_future(self._abort_event.wait())
            done, _ = await asyncio.wait({gen, abort}, return_when=asyncio.FIRST_COMPLETED)
            if gen not in done:
                gen.cancel()
                await asyncio.gather(gen, return_exceptions=True)
                return  # held evaluation prompts are released by close()
            abort.cancel()
            for entry, scored in zip(group, gen.result(), strict=True):  # scored by _generate (episodes too)
                if scored.failed:
                    await asyncio.shield(self._dead_letter(self._evals.prompts, entry, scored))
                    self._held_evals = [h for h in self._held_evals if h.entry_id != entry.entry_id]
                    continue
                result = self._scoring.eval_result(self._task, entry, scored.samples, self.cfg.generator_id)
                await asyncio.shield(self._evals.finish(entry, result))
                self._held_evals = [h for h in self._held_evals if h.entry_id != entry.entry_id]

    def _sampling(self, entry: PromptEntry) -> Sampling:
        """Sampling of a prompt: the learner's (carried in the prompt record), else this generator's own."""
        assert self._task is not None
        sp = entry.spec.sampling or self.cfg.sampling
        return sp if sp.max_new_tokens else dataclasses.replace(sp, max_new_tokens=self._task.max_new_tokens)

    async def _fresh_weights(self) -> None:
        """Before a batch: a newer version announced and on its way is waited for, up to ``weight_sync.fresh_wait_s``
        and once per version (the batch then runs on it, and its swap waits for no decode step)."""
        sync, engine, wait_s = self._sync, self._engine, self.cfg.weight_sync.fresh_wait_s
        assert engine is not None
        if sync is None or wait_s <= 0:
            return
        wanted = sync.wanted_version
        if wanted <= engine.version or wanted <= self._fresh_waited or wanted in sync.refused:
            return
        self._fresh_waited = wanted
        await engine.wait_applied(wanted, wait_s)

    async def _generate(self, group: list[PromptEntry], params: SamplingParams) -> list[ScoredGroup]:
        """The group's scored samples, in the group's order (:meth:`_generate_each`, all of them at the end)."""
        out: dict[int, ScoredGroup] = {}
        await self._generate_each(group, params, out.__setitem__)
        return [out[i] for i in range(len(group))]

    async def _generate_each(self, group: list[PromptEntry], params: SamplingParams,
                             on_done: Callable[[int, ScoredGroup], None]) -> None:  # fmt: skip
        """Each prompt's scored samples to ``on_done(index, scored)`` as soon as they are done; first, in synchronous
        mode, the weight version its prompts ask for (the weight sync task fetches it; an abort cancels the wait
        with the generation). An environment task runs one episode per sample (:mod:`actors.generator.episodes`),
        all of them at once."""
        assert self._engine is not None and self._task is not None
        need = max(e.spec.min_version for e in group)
        t0 = time.monotonic()
        try:
            if self._engine.version < need:
                await self._engine.wait_applied(need)
            await self._fresh_weights()
        finally:
            self.version_wait_s += time.monotonic() - t0
        engine, owners = self._engine, [self._task.task_for(e.spec.metadata) for e in group]  # a mixture's members
        single = [i for i, t in enumerate(owners) if not isinstance(t, EnvTask)]  # the rest run episodes

        def scored(k: int, completions: list[Any]) -> None:
            i = single[k]
            on_done(i, self._scoring.score(owners[i], group[i].spec.metadata, completions))

        async def episodes(i: int) -> None:
            on_done(i, await self._episodes(engine, owners[i], group[i], params))  # type: ignore[arg-type]

        self._busy.enter()
        try:
            async with asyncio.TaskGroup() as tg:
                if single:
                    tg.create_task(engine.generate_each([group[i].spec.prompt_ids for i in single], params, scored))
                for i, t in enumerate(owners):
                    if isinstance(t, EnvTask):
                        tg.create_task(episodes(i))
        finally:
            self._busy.leave()

    async def _episodes(self, engine: Engine, task: EnvTask, entry: PromptEntry, params: SamplingParams) -> ScoredGroup:
        errors: list[BaseException] = []
        samples = await run_group(engine, task, entry.spec.metadata, entry.spec.prompt_ids, params, self.cfg.episode,
                                  on_error=errors.append)  # fmt: skip
        return self._scoring.episodes(samples, errors)

    def _record(self, entry: PromptEntry, samples: list[Sample], gen_s: float) -> GroupRecord:
        spec = entry.spec
        meta: dict[str, Any] = {
            "task": spec.metadata.get("task", ""), SOURCE_KEY: spec.metadata.get(SOURCE_KEY, ""),
            "issued_version": entry.issued_version,
            "issued_at": entry.issued_at, "gen_s": round(gen_s, 4), "reclaimed": entry.reclaimed,
        }  # fmt: skip
        return GroupRecord(
            group_id=spec.prompt_id, prompt_id=spec.prompt_id, generator_id=self.cfg.generator_id,
            created_at=time.time(), prompt_ids=np.asarray(spec.prompt_ids, dtype=np.int32), samples=samples,
            metadata=meta,
        )  # fmt: skip
