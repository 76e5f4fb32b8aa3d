"""The learner process loop: admission-controlled prompts out, staleness-bounded batches in,
one optimizer step per batch, versioned weights published back.

One step:
1. issue prompts up to the admission bound ((S+1-lag)·B groups issued and not yet consumed);
2. read B groups from the rollout stream (duplicates of trained groups are acked and skipped;
   malformed ones, ones the model cannot take (:mod:`buffer.entry_checks`) and ones of prompts not
   in flight go to dead letters), apply the staleness policy (drop-and-count or keep);
3. advantages per group, samples cut into micro-batches by token budget, π_prox / reference
   logprobs when the loss needs them, forward + loss + backward + optimizer step (in a worker
   thread, so the event loop keeps NATS and Redis alive);
4. version += 1; checkpoint every ``checkpoint.every`` steps, and only then ack the rollout
   entries the checkpoint covers, recording their prompts' fate ``trained`` in the same transaction
   (:mod:`buffer.audit`). The checkpoint carries that commit and the steps' metrics rows: a learner
   killed between the checkpoint and the ack (or the metrics write) finishes both on resume; one
   killed earlier re-reads the groups of lost steps and skips those of committed ones. Every group
   is trained exactly once, every committed step has its metrics row, and the counters stay exact;
5. publish weights every ``publish_every`` steps: the step waits only for a snapshot into reused host buffers;
   encoding (deltas), checksums and transfer run in the background while the next steps train, and a step that
   finds a version still going out skips its own (:mod:`actors.learner.publishing`); the last step waits
   for its version to be out; log metrics (wandb, JSONL, console, NATS).

One learner per run: the learner holds the run's lease (:mod:`async_rl.run.lease`, taken by the entry point before
anything is restored or written), renews it in a task beside the steps, and every write that matters carries its
fencing token (prompts, acks and fates, dead letters, weight versions, the learner's state, the checkpoint's
``latest``): once another learner took the run, Redis refuses them and this one stops with :class:`LeaseLost`.

A step the backend fails on does not stop the learner: each group is tried alone (a forward pass)
and the ones that fail go to the dead letters with the error; when none fails alone, the batch is
given back with the error recorded and its entries reach the delivery limit if it keeps failing.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import time
from typing import Any

import numpy as np
import redis.asyncio as aioredis

from actors.learner.backend import TrainingBackend
from actors.learner.batching import make_micro_batches
from actors.learner.checkpoint import CheckpointManager, LearnerState
from actors.learner.config import LearnerConfig
from actors.learner.evaluation import Evaluator, eval_sources
from actors.learner.intake import Intake
from actors.learner.publishing import Publishing, publish_metrics
from actors.learner.samples import build_samples, response_metrics, source_metrics
from actors.learner.samples_table import table_rows
from actors.learner.signals import LearnerSignals
from async_rl.algorithms import make_loss_fn
from async_rl.algorithms.batch import MicroBatch, TrainSample
from async_rl.entry import public_config
from async_rl.metrics.sinks import SAMPLES_KEY, MetricsLogger, read_metrics
from async_rl.model.architecture import STATE_FIELD as ARCH_FIELD
from async_rl.model.architecture import architecture
from async_rl.model.architecture import encode as encode_architecture
from async_rl.process.lifecycle import named_task
from async_rl.process.repeated import RepeatedLine
from async_rl.run.end import announce_run_end, clear_run_end
from async_rl.run.lease import Fence, RunLease, fenced_hset, is_fenced
from async_rl.servers.control import ControlPlane, LearnerProgress, RunEnded
from async_rl.servers.reach import redis_client
from async_rl.tasks import identity
from async_rl.tasks.base import Task
from async_rl.tasks.config import build_task
from async_rl.weights.background import PublishRecord
from buffer.dead_letters import error_line
from buffer.entry_checks import EntryChecker, ModelFacts
from buffer.evals import EvalQueue
from buffer.prompts import PromptQueue
from buffer.rollout_writer import LEARNER_HOLD_FIELD
from buffer.rollouts import RolloutEntry, RolloutReader

log = logging.getLogger(__name__)

# Failed steps in a row that no single group explains (each group passes alone): after this many the fault is
# taken to be the learner's own (a bug, a device error), and it exits for its supervisor instead of burning data.
MAX_UNEXPLAINED_FAILURES = 3


def target_value(metrics: dict[str, Any], name: str) -> float:
    """The step's value of ``learner.target_metric``; ValueError naming what the task reports when it is absent."""
    if name not in metrics:
        known = sorted(k for k in metrics if k == "reward" or k.startswith("reward/"))
        raise ValueError(f"target_metric {name!r} is not reported by this task (it reports {known})")
    return float(metrics[name])


class Learner(Intake):
    """The learner process (see the module docstring); its intake (prompts out, batches in) is :class:`Intake`'s."""

    backend: TrainingBackend
    reward_history: list[float]
    _redis: aioredis.Redis | None
    _publishing: Publishing | None
    """Snapshots the weights and hands each version to the GPU slots or the host transport."""
    _metrics: MetricsLogger | None
    _evals: Evaluator | None
    """Evaluation rounds on held-out prompts (None while learner.eval.interval_versions is 0)."""
    _checkpoints: CheckpointManager
    _last_ckpt_s: float | None
    """Seconds the checkpoint written during this step took (None: none written), for the step's one line."""
    _last_publish_s: float | None
    _checker: EntryChecker | None
    _pending_rows: list[tuple[int, dict[str, Any]]]
    _unexplained_failures: int
    _lease: RunLease | None
    _fence: Fence | None
    """What every write that matters carries (None: a learner without a lease, e.g. in tests of the loop alone)."""

    def __init__(self, cfg: LearnerConfig, backend: TrainingBackend, *, task: Task | None = None,
                 lease: RunLease | None = None) -> None:  # fmt: skip
        """``task``: ``cfg.task`` built already (the entry point builds it to check the config); else built here.
        ``lease``: the run's lease, taken already (the entry point takes it before anything is restored)."""
        self.cfg = cfg
        self.backend = backend
        self._lease = lease
        self._fence = lease.fence if lease is not None else None
        self.state = LearnerState()
        self.stop_event = asyncio.Event()
        self.reward_history = []
        self._redis = None
        self._control = None
        self._signals = LearnerSignals(cfg)  # /metrics and the scaling signal
        self._publishing = None
        self._prompts = None
        self._reader = None
        self._metrics = None
        self._task = task if task is not None else build_task(cfg.task)
        self._evals = None
        self._checkpoints = CheckpointManager(cfg.run.run_dir / "checkpoints", keep=cfg.checkpoint.keep)
        self._last_ckpt_s = self._last_publish_s = None
        self._checker = None
        self._unacked = []  # (entry id, prompt id, step) of trained steps not yet committed
        self._pending_rows = []  # (step, metrics row) of those steps, written with their commit
        self._unexplained_failures = 0
        self._max_staleness_seen = 0
        self._shown_first_prompt = False
        self._dropped_line = RepeatedLine(log, "dropped {n} groups over the staleness bound "
                                               f"staleness.max_staleness={cfg.staleness.max_staleness}")  # fmt: skip

    def install_signal_handlers(self) -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.request_stop)

    def request_stop(self) -> None:
        if not self.stop_event.is_set():
            log.info("learner stopping after the step in progress")
        self.stop_event.set()

    # ------------------------------------------------------------------ lifecycle
    async def setup(self, stack: contextlib.AsyncExitStack) -> None:
        """Restore, connect and publish the first version; every resource is entered in ``stack`` as it opens."""
        cfg, names = self.cfg, self.cfg.run.names
        assert cfg.run.redis_url and cfg.run.nats_url, "URLs are resolved by the entry point"
        if cfg.checkpoint.resume:
            restored = await asyncio.to_thread(self._checkpoints.load, self.backend)
            if restored is not None:
                self.state = restored
                self.reward_history = list(restored.extra.get("reward_history", []))
                log.info("resumed from checkpoint: step %d, version %d, %d groups trained",
                         restored.step, restored.version, len(restored.seen_group_ids))  # fmt: skip
        self._redis = redis_client(cfg.run.redis_url)  # bounded retries, then the error (async_rl.servers.reach)
        stack.push_async_callback(self._redis.aclose)
        self._control = await ControlPlane(cfg.run.nats_url, name="learner", cfg=cfg.control).connect()
        stack.push_async_callback(self._control.close)
        stack.callback(self._signals.close)
        await self._signals.start(self._redis, self._control)
        self._publishing = Publishing(cfg, self.backend, on_commit=self._on_published, fence=self._fence)
        await self._publishing.open(stack, self._redis, self._control)
        self._prompts = PromptQueue(self._redis, names, cfg.prompts, fence=self._fence)
        self._checker = EntryChecker(await asyncio.to_thread(_model_facts, cfg), num_samples=cfg.sampling.n)
        self._reader = RolloutReader(self._redis, names, cfg.rollouts, checker=self._checker, check_issued=True,
                                     fence=self._fence)  # fmt: skip
        issued = (await self._prompts.audit.counters())["issued"]
        # Prompts issued after the checkpoint are in the stream already: never issue an index twice.
        self.state.prompts_issued = max(self.state.prompts_issued, issued)
        self._metrics = MetricsLogger(cfg.metrics, cfg.run.run_dir, config=public_config(cfg),
                                      name=cfg.run.prefix)  # fmt: skip
        stack.callback(self._metrics.close)
        await self._finish_restored_commit()
        await clear_run_end(self._redis, names)  # this learner carries the run on: an earlier end no longer applies
        await fenced_hset(self._redis, self._fence, names.learner_state, {
            "version": self.state.version, "step": self.state.step, "started_at": time.time(),
            "backend": cfg.backend, "model": cfg.model.name,
            ARCH_FIELD: encode_architecture(await asyncio.to_thread(architecture, cfg.model.name)),
            identity.STATE_FIELD: identity.encode(await asyncio.to_thread(identity.task_facts, cfg.task)),
            LEARNER_HOLD_FIELD: cfg.checkpoint.every * cfg.batch_groups,
        })  # fmt: skip
        self._last_publish_s = await self._publishing.start(self.state)  # restored weights numbered and out
        self._checker.max_version = max(self.state.version, self.state.published_version)
        if cfg.eval.interval_versions:
            self._evals = Evaluator(cfg.eval, self._task, EvalQueue(self._redis, names, cfg.prompts, fence=self._fence),
                                    self.state, cfg.sampling, eval_sources(cfg.eval, cfg.task))  # fmt: skip
            await self._evals.maybe_issue(self.state.version)

    async def run(self) -> LearnerState:
        """Set up, then steps until stopped or done; on every path the resources close in reverse order of opening
        (an AsyncExitStack), a failed setup included. Beside them, in one TaskGroup, the run's lease is renewed; when
        another learner took the run the steps stop with :class:`~async_rl.run.lease.LeaseLost`."""
        try:
            async with asyncio.TaskGroup() as tg:
                keeper = None
                if self._lease is not None:
                    keeper = tg.create_task(named_task("run lease", self._lease.keep()), name="run-lease")
                try:
                    async with contextlib.AsyncExitStack() as stack:
                        await self.setup(stack)
                        await self._loop()
                finally:
                    if keeper is not None:
                        keeper.cancel()
        except BaseExceptionGroup as group:  # one failure (the usual case) is raised as itself, for the entry point
            if len(group.exceptions) == 1:
                raise group.exceptions[0]  # noqa: B904 (the group is its context)
            raise
        return self.state

    async def _loop(self) -> None:
        try:
            while not self.stop_event.is_set() and not self._done():
                t0 = time.monotonic()
                entries = await self._collect_batch()
                if not entries:
                    continue
                self._signals.batch_ready(waited_s=time.monotonic() - t0)
                await self._step(entries)
            if self._publishing is not None:  # the last trained version goes out before the learner leaves
                await self._publish(wait=True)
            if self._unacked:  # the last steps since a checkpoint: commit them before leaving
                await self._commit()
            if not self.stop_event.is_set():  # max_steps or target_reward: the run is over, everywhere
                await self._end_run()
        except Exception as exc:
            # Dying with entries in hand: they are delivered again to the next learner, and the delivery limit
            # sends them to the dead letters with this error if it keeps happening.
            if self._reader is not None and self._reader.in_flight and not is_fenced(exc):
                with contextlib.suppress(Exception):
                    await self._reader.record_error(self._reader.in_flight, error_line(exc))
            raise

    async def _end_run(self) -> None:
        """Announce the end of the run (async_rl.run.end): its generators drain and exit."""
        assert self._redis is not None
        cfg, step = self.cfg, self.state.step
        reason = "max_steps" if cfg.max_steps and step >= cfg.max_steps else "target_reward"
        await announce_run_end(self._redis, self._control, cfg.run.names,
                               RunEnded(step=step, version=self.state.version, reason=reason), fence=self._fence)  # fmt: skip
        log.info("run %s ended (%s) at step %d, version %d", cfg.run.prefix, reason, step, self.state.version)

    def _done(self) -> bool:
        cfg = self.cfg
        if cfg.max_steps and self.state.step >= cfg.max_steps:
            log.info("max_steps %d reached", cfg.max_steps)
            return True
        window = self.state.extra.get("target_history", [])[-cfg.target_window :]
        if cfg.target_reward and len(window) == cfg.target_window and np.mean(window) >= cfg.target_reward:
            log.info("target %s %.3f reached (mean of last %d steps %.3f)", cfg.target_metric, cfg.target_reward,
                     cfg.target_window, float(np.mean(window)))  # fmt: skip
            return True
        return False

    # ------------------------------------------------------------------ data
    # ------------------------------------------------------------------ training
    async def _step(self, entries: list[RolloutEntry]) -> None:
        cfg = self.cfg
        t0 = time.monotonic()
        groups = [e.record for e in entries]
        version_before = self.state.version
        try:
            samples, adv_metrics, rewards = build_samples(groups, cfg)
            result, num_mb = await asyncio.to_thread(self._train, samples)
        except Exception as exc:  # retry boundary: a batch the backend fails on must not stop training
            await self._on_step_error(entries, exc)
            return
        self._unexplained_failures = 0
        if result.metrics.get("step_skipped"):  # the backend contract: no update, the step still counts
            log.warning("step %d: non-finite gradient norm (%s); the optimizer step was skipped",
                        self.state.step + 1, result.grad_norm)  # fmt: skip
        self.state.step += 1
        self.state.version += 1
        step = self.state.step
        train_s = time.monotonic() - t0
        self.state.seen_group_ids.update(g.group_id for g in groups)
        self._unacked += [(e.entry_id, e.record.prompt_id, step) for e in entries]
        reward_mean = float(np.mean(rewards)) if rewards else 0.0
        self.reward_history.append(reward_mean)
        self.state.extra["reward_history"] = self.reward_history[-10_000:]
        num_tokens = sum(int(s.input_ids.size) for s in samples)
        counters = await self._counters()
        publishing = step % cfg.publish_every == 0
        assert self._publishing is not None
        if publishing:  # snapshot now; the last step of the run waits for its version to be out
            last = bool(cfg.max_steps) and step >= cfg.max_steps
            await self._publish(wait=last)
        committed = self._publishing.take_records()
        evaluated: dict[str, float] = {}
        if self._evals is not None:  # a round due at this version goes out; the newest complete one is reported
            await self._evals.maybe_issue(self.state.version, min_version=self._offered_version())
            evaluated = await self._evals.collect()
        metrics: dict[str, Any] = {
            **{f"loss/{k}": v for k, v in result.metrics.items()},
            **{f"adv/{k}": v for k, v in adv_metrics.items()},
            "reward": reward_mean, "grad_norm": result.grad_norm, "version": self.state.version,
            "step_s": time.monotonic() - t0, "train_s": train_s, "micro_batches": num_mb,
            "samples": len(samples), "groups": len(groups), "tokens": num_tokens,
            # samples whose recorded expert routes the backend replays (0 for dense models or replay_routes off)
            "routes_replayed_frac": sum(s.routes is not None for s in samples) / max(len(samples), 1),
            "samples_per_s": len(samples) / max(train_s, 1e-9), "tokens_per_s": num_tokens / max(train_s, 1e-9),
            "staleness_group_max": max((version_before - g.min_version for g in groups), default=0),
            "max_staleness_seen": self._max_staleness_seen,
            # The newest version handed to the publisher (visible now or soon); weights/visible_version: committed.
            "published_version": self._offered_version(),
            "weights/visible_version": self.state.published_version,
            "weights/versions_skipped": self._publishing.versions_skipped,
            "weights/publish_block_s": self._last_publish_s or 0.0,
            **publish_metrics(committed), **response_metrics(groups),
            **{f"buffer/{k}": v for k, v in counters.items()},
            **self._signals.fleet_metrics(),
            **source_metrics(groups),
            **evaluated,
        }  # fmt: skip
        # Every component any sample reports (a sample without one counts 0: e.g. an episode that never opened).
        for key in dict.fromkeys(k for g in groups for s in g.samples for k in s.reward_info):
            metrics[f"reward/{key}"] = float(np.mean([s.reward_info.get(key, 0.0) for g in groups for s in g.samples]))
        if cfg.samples_table.due(step):  # written with the step's row, at its commit (exactly once)
            metrics[SAMPLES_KEY] = table_rows(groups, self._task, cfg.algorithm, version=self.state.version,
                                              num_samples=cfg.samples_table.num_samples)  # fmt: skip
        if cfg.target_reward:  # the early-stopping window, kept in the checkpoint like the reward history
            self.state.extra["target_history"] = [*self.state.extra.get("target_history", [])[-cfg.target_window:],
                                                  target_value(metrics, cfg.target_metric)]  # fmt: skip
        self._pending_rows.append((step, metrics))
        if step % cfg.checkpoint.every == 0:
            await self._commit()
        assert self._control is not None and self._redis is not None
        await fenced_hset(self._redis, self._fence, self.cfg.run.names.learner_state, {
            "version": self.state.version, "step": self.state.step, "published_version": self.state.published_version,
            "versions_skipped": self._publishing.versions_skipped,
            **{k.removeprefix("weights/"): round(v, 6) for k, v in publish_metrics(committed).items()},
            **({"eval": json.dumps(evaluated)} if evaluated else {}),  # the newest round, for async-rl status
        })  # fmt: skip
        scalars = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and np.isfinite(v)}
        with contextlib.suppress(Exception):  # progress events are informational
            await self._control.publish(self.cfg.run.names.learner_subject,
                                        LearnerProgress(step=self.state.step, version=self.state.version,
                                                        metrics=scalars))  # fmt: skip
        await self._signals.stepped(step, metrics, [version_before - g.min_version for g in groups])
        done = "".join(f" {what} {s:.2f}s" for what, s in (("checkpoint", self._last_ckpt_s),
                                                           ("publish", self._last_publish_s)) if s is not None)  # fmt: skip
        self._last_ckpt_s = self._last_publish_s = None
        log.info("step %d v%d reward %.3f loss %.4f staleness<=%d groups %d tokens %d gens %d %.2fs (train %.2fs%s)",
                 self.state.step, self.state.version, reward_mean, result.metrics.get("loss", float("nan")),
                 metrics["staleness_group_max"], len(groups), num_tokens, int(metrics["generators/alive"]),
                 time.monotonic() - t0, train_s, done)  # fmt: skip

    async def _on_step_error(self, entries: list[RolloutEntry], exc: Exception) -> None:
        """Find the groups a failed step choked on (each alone, forward only); dead-letter them, give back the rest."""
        assert self._reader is not None
        line = error_line(exc)
        log.error("step %d failed on %d groups (%s); trying each group alone", self.state.step + 1, len(entries), line)
        culprits = await asyncio.to_thread(self._probe, entries)
        for e, err in culprits:
            await self._reader.quarantine([e], f"the {self.backend.name} backend failed on this group: {err}", err)
        bad = {e.entry_id for e, _ in culprits}
        rest = [e for e in entries if e.entry_id not in bad]
        await self._reader.retry(rest, line)
        if culprits:
            return
        self._unexplained_failures += 1
        if self._unexplained_failures >= MAX_UNEXPLAINED_FAILURES:
            raise RuntimeError(f"{self._unexplained_failures} steps in a row failed with every group passing alone; "
                               f"last error: {line}") from exc  # fmt: skip

    def _probe(self, entries: list[RolloutEntry]) -> list[tuple[RolloutEntry, str]]:
        """Worker thread: a no-grad forward of each group alone; the groups that fail, with their error line."""
        cfg, backend = self.cfg, self.backend
        failed = []
        for e in entries:
            try:
                samples, _, _ = build_samples([e.record], cfg)
                for mb in make_micro_batches(samples, cfg.batching):
                    backend.forward_logprobs(mb, replay_routes=cfg.replay_routes)
            except Exception as exc:  # the point: find what fails
                failed.append((e, error_line(exc)))
        return failed

    def _train(self, samples: list[TrainSample]) -> tuple[Any, int]:
        """Worker thread: micro-batches, extra logprobs the loss needs, one optimizer step."""
        cfg, backend = self.cfg, self.backend
        mbs: list[MicroBatch] = make_micro_batches(samples, cfg.batching)
        if cfg.algorithm.needs_proximal_logprobs:
            for mb in mbs:
                mb.proximal_logprobs = backend.forward_logprobs(mb, replay_routes=cfg.replay_routes).logprobs
        if cfg.algorithm.needs_reference_logprobs:
            for mb in mbs:
                mb.reference_logprobs = backend.forward_logprobs(mb, replay_routes=False, reference=True).logprobs
        loss_fn = make_loss_fn(cfg.algorithm, learner_version=self.state.version)
        result = backend.train_step(mbs, loss_fn, replay_routes=cfg.replay_routes,
                                    with_entropy=cfg.algorithm.needs_entropy or cfg.entropy_metric)  # fmt: skip
        return result, len(mbs)

    async def _commit(self) -> None:
        """Checkpoint, then ack the rollout entries of every step the checkpoint covers (their prompts: ``trained``),
        then write those steps' metrics rows. The checkpoint carries both, so a learner killed after it finishes
        them on resume (:meth:`_finish_restored_commit`)."""
        assert self._reader is not None and self._metrics is not None
        self.state.extra["commit"] = [list(u) for u in self._unacked]
        self.state.extra["metrics_rows"] = [[step, row] for step, row in self._pending_rows]
        t0 = time.monotonic()
        assert self._redis is not None
        if self._fence is not None:  # files are not in Redis: the token is checked before writing and before `latest`
            await self._fence.check(self._redis)
        path = await asyncio.to_thread(self._checkpoints.write, self.backend, self.state)
        if self._fence is not None:
            await self._fence.check(self._redis)
        await asyncio.to_thread(self._checkpoints.point_latest, path)
        self._last_ckpt_s = time.monotonic() - t0  # the step's line says it (one line per step)
        log.debug("checkpoint of step %d written in %.2fs; committing %d groups", self.state.step, self._last_ckpt_s,
                  len(self._unacked))  # fmt: skip
        if self._unacked:
            await self._reader.ack([eid for eid, _, _ in self._unacked],
                                   fates=[(pid, f"step {step}") for _, pid, step in self._unacked])  # fmt: skip
            self._unacked = []
        for step, row in self._pending_rows:
            self._metrics.log(step, row)
        self._pending_rows = []

    async def _finish_restored_commit(self) -> None:
        """Resume: ack what the restored checkpoint committed (a no-op for what was acked before the kill) and write
        the metrics rows of its steps that ``metrics.jsonl`` lacks."""
        assert self._reader is not None and self._metrics is not None
        commit = self.state.extra.get("commit") or []
        if commit:
            n = await self._reader.ack([eid for eid, _, _ in commit],
                                       fates=[(pid, f"step {step}") for _, pid, step in commit])  # fmt: skip
            if n:
                log.info("finished the commit of the restored checkpoint: %d entries acked", n)
        rows = self.state.extra.get("metrics_rows") or []
        logged = {int(r["step"]) for r in read_metrics(self.cfg.run.run_dir) if "step" in r}
        for step, row in rows:
            if int(step) not in logged:
                self._metrics.log(int(step), row)
                log.info("wrote the metrics row of committed step %d (lost with the previous learner)", step)

    def _offered_version(self) -> int:
        """The newest version handed to the publisher (snapshotted; committed or going out)."""
        assert self._publishing is not None
        return self._publishing.offered_version(self.state.published_version)

    async def _publish(self, *, wait: bool) -> None:
        """Hand the trained version to the publisher (``wait``: until it is out), its samples admitted first."""
        assert self._publishing is not None
        self._admit_version(self.state.version)
        self._last_publish_s = await self._publishing.publish(self.state.version, wait=wait)

    def _admit_version(self, version: int) -> None:
        """``version`` goes to the publisher now: samples of it may arrive as soon as its commit is visible, which can
        be before :meth:`_on_published` runs here (the commit's last awaits are still going), so they are admitted
        from now on."""
        if self._checker is not None:
            self._checker.max_version = max(self._checker.max_version or 0, version)

    def _on_published(self, record: PublishRecord) -> None:
        """A version is visible: tokens of it may arrive from now on."""
        self.state.published_version = max(self.state.published_version, record.version)
        self._admit_version(record.version)
        # The first version at start-up gets a line of its own; later ones are in their step's line.
        log.log(logging.INFO if self.state.step == 0 else logging.DEBUG,
                "published weights v%d (%s, %.2f of %.2f MB) %.3fs after its snapshot", record.version, record.kind,
                record.bytes_sent / 1e6, record.full_bytes / 1e6, record.latency_s)  # fmt: skip

    async def _counters(self) -> dict[str, int]:
        assert self._redis is not None and self._prompts is not None
        names = self.cfg.run.names
        raw: dict[bytes, bytes] = await self._redis.hgetall(names.rollout_counters)  # type: ignore[assignment]
        audit = {f"audit_{k}": v for k, v in (await self._prompts.audit.counters()).items()}
        backlog = int(await self._redis.xlen(names.rollouts_stream))
        return {**{k.decode(): int(v) for k, v in raw.items()}, **audit, "backlog": backlog}


def _model_facts(cfg: LearnerConfig) -> ModelFacts:
    """What every rollout entry is checked against: the learner's own model config."""
    from async_rl.model.presets import load_model_config

    return ModelFacts.from_hf_config(load_model_config(cfg.model.name))
