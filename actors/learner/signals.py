"""What the learner tells the outside after each step, besides wandb: ``/metrics`` and the scaling signal.

* **Prometheus** (``prometheus.port``, off by default; :mod:`async_rl.metrics.prometheus`): steps, versions, a histogram of
  group staleness, tokens/s, the rollout backlog, dead letters and prompt fates, the wait share, generators
  alive and the suggested number of generators.
* **Scaling signal** (:mod:`async_rl.metrics.scaling`): the share of time the learner waited for rollouts, the backlog and
  a suggested number of generators, sent as a :class:`~async_rl.servers.control.ScalingSignal` on ``scaling_subject`` and
  kept under ``names.scaling_state`` in Redis (``async-rl status`` shows it). Generators alive are counted from
  their heartbeats on NATS.

* **The fleet** (from the same heartbeats): a generator's arrival, departure (its last heartbeat says
  'stopping') and loss (no heartbeat for ``scaling.heartbeat_timeout_s``) are logged once each; every heartbeat is
  kept under ``names.generators`` in Redis, so ``async-rl status`` shows departed and lost generators with the
  prompts they left pending; per-step figures (alive, tokens/s per generator and together, swap pause, fetch time)
  go into the step's metrics row (wandb, JSONL).

All of it is informational: a failure here is logged and never stops training.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ResponseError

from actors.learner.config import LearnerConfig
from async_rl.metrics.prometheus import Exporter, Metric
from async_rl.metrics.scaling import StarvationWindow, suggest
from async_rl.servers.control import ControlPlane, Heartbeat, JoinRefused, Message, ScalingSignal, encode
from buffer.prompts import PromptQueueConfig

log = logging.getLogger(__name__)

LEARNER_METRICS: dict[str, Metric] = {
    "async_rl_learner_steps_total": Metric("counter", "Optimizer steps taken by this learner process."),
    "async_rl_learner_step": Metric("gauge", "Optimizer steps of the run (restored from checkpoints)."),
    "async_rl_learner_version": Metric("gauge", "Weight version after the last step."),
    "async_rl_learner_published_version": Metric("gauge", "Newest weight version published."),
    "async_rl_learner_group_staleness_versions": Metric(
        "histogram", "Learner version minus a trained group's oldest token version.",
        buckets=(0, 1, 2, 3, 4, 6, 8, 12, 16, 32)),  # fmt: skip
    "async_rl_learner_tokens_total": Metric("counter", "Tokens (prompt + response) trained on."),
    "async_rl_learner_tokens_per_second": Metric("gauge", "Tokens per second of the last step's training."),
    "async_rl_learner_step_seconds": Metric("gauge", "Wall time of the last step (training, commit, publish)."),
    "async_rl_learner_reward": Metric("gauge", "Mean reward of the last step's samples."),
    "async_rl_learner_wait_share": Metric("gauge", "Share of time spent waiting for rollouts (scaling window)."),
    "async_rl_learner_rollout_backlog_groups": Metric("gauge", "Groups appended and not yet read by the learner."),
    "async_rl_learner_generators_alive": Metric("gauge", "Generators with a recent heartbeat."),
    "async_rl_learner_suggested_generators": Metric("gauge", "Generators the scaling policy suggests."),
    "async_rl_learner_dead_letters": Metric("gauge", "Rollout entries sent to the dead letters (run total)."),
    "async_rl_learner_prompts_dropped_stale": Metric("gauge", "Prompts whose group was dropped over the bound."),
    "async_rl_learner_prompts_in_flight": Metric("gauge", "Prompts issued and not yet finished."),
}


class LearnerSignals:
    """Prometheus metrics and the scaling signal of one learner (see the module docstring)."""

    cfg: LearnerConfig
    exporter: Exporter
    window: StarvationWindow
    last: ScalingSignal | None
    _redis: aioredis.Redis | None
    _control: ControlPlane | None
    _beats: dict[str, Heartbeat]
    _lost: set[str]
    """Generators already reported lost (reported again only after they come back)."""
    _newly_lost: list[Heartbeat]
    """Last heartbeats of generators found lost and not yet reported (:meth:`report_lost`)."""
    _batch_ready_at: float
    _waited_s: float

    def __init__(self, cfg: LearnerConfig) -> None:
        self.cfg = cfg
        self.exporter = Exporter(cfg.prometheus, LEARNER_METRICS, {"run": cfg.run.prefix})
        self.window = StarvationWindow(cfg.scaling.window_steps)
        self.last = None
        self._redis = None
        self._control = None
        self._beats = {}
        self._lost = set()
        self._newly_lost = []
        self._batch_ready_at = time.monotonic()
        self._waited_s = 0.0

    async def start(self, redis: aioredis.Redis, control: ControlPlane) -> None:
        self._redis, self._control = redis, control
        self.exporter.start()
        await control.subscribe(self.cfg.run.names.heartbeat_subject, self._on_heartbeat,
                                kinds=(Heartbeat, JoinRefused))  # fmt: skip

    async def _on_heartbeat(self, msg: Message) -> None:
        if isinstance(msg, JoinRefused):  # the generator exits with the same line; the run's own log says it too
            log.error("generator %s (%s pid %d) refused to join: %s", msg.generator_id, msg.host, msg.pid, msg.reason)
            return
        assert isinstance(msg, Heartbeat)
        gid, before = msg.generator_id, self._beats.get(msg.generator_id)
        self._beats[gid] = msg
        if msg.state == "stopping":
            log.info("generator %s left (%s pid %d)", gid, msg.host, msg.pid)
        elif before is None or before.state == "stopping" or gid in self._lost:
            log.info("generator %s %s (%s pid %d, %s engine, weights v%d)", gid,
                     "is back" if gid in self._lost else "joined", msg.host, msg.pid, msg.engine, msg.version)  # fmt: skip
            self._lost.discard(gid)
        if self._redis is not None:
            try:  # the registry async-rl status reads: departed and lost generators stay visible there
                await self._redis.hset(self.cfg.run.names.generators, gid, encode(msg))
            except Exception as exc:  # informational
                log.debug("generator registry update failed: %r", exc)

    def generators_alive(self) -> int:
        now = time.time()
        timeout_s = self.cfg.scaling.heartbeat_timeout_s
        for gid in [g for g, h in self._beats.items() if now - h.sent_at > 10 * timeout_s]:
            del self._beats[gid]  # long gone: forget them
            self._lost.discard(gid)
        for gid, h in self._beats.items():
            if h.state != "stopping" and now - h.sent_at >= timeout_s and gid not in self._lost:
                self._lost.add(gid)
                self._newly_lost.append(h)  # reported by report_lost, with what it left pending
        return sum(1 for h in self._beats.values() if now - h.sent_at < timeout_s and h.state != "stopping")

    async def report_lost(self) -> None:
        """One line per generator found lost since the last call: how long it has been silent, the prompts it left
        pending in the consumer group (not what its last heartbeat held: a batch may have been read since) and when
        other generators reclaim them (after its ``prompts.reclaim_idle_ms`` of idleness)."""
        lost, self._newly_lost = self._newly_lost, []
        for h in lost:
            pending, reclaim_s = await self._pending_of(h)
            left = ("it left no prompt pending" if not pending else
                    f"it left {pending} prompt{'s' if pending > 1 else ''} pending, which other generators reclaim "
                    f"{'now' if reclaim_s <= 0 else f'in {reclaim_s:.0f}s'} (prompts.reclaim_idle_ms="
                    f"{h.reclaim_idle_ms or PromptQueueConfig().reclaim_idle_ms})")  # fmt: skip
            log.warning("generator %s (%s pid %d) lost: no heartbeat for %.0fs; %s", h.generator_id, h.host, h.pid,
                        time.time() - h.sent_at, left)  # fmt: skip

    async def _pending_of(self, h: Heartbeat) -> tuple[int, float]:
        """Prompts ``h``'s generator holds pending, and the seconds until the last of them may be reclaimed."""
        if self._redis is None:
            return h.in_flight, 0.0
        names = self.cfg.run.names
        try:
            rows = await self._redis.xpending_range(names.prompts_stream, names.prompts_group, min="-", max="+",
                                                    count=10_000, consumername=h.generator_id)  # fmt: skip
        except ResponseError:  # no stream or group yet
            return 0, 0.0
        if not rows:
            return 0, 0.0
        reclaim_ms = h.reclaim_idle_ms or PromptQueueConfig().reclaim_idle_ms
        newest_idle_ms = min(int(r["time_since_delivered"]) for r in rows)
        return len(rows), (reclaim_ms - newest_idle_ms) / 1000

    def fleet_metrics(self) -> dict[str, float]:
        """Figures of the generators for the step's metrics row: alive, tokens/s (each and together), the largest
        swap pause and fetch time among the live ones; and ``learner/wait_s``, how long this batch kept the learner
        waiting for rollouts (its idle time)."""
        now, timeout_s = time.time(), self.cfg.scaling.heartbeat_timeout_s
        live = [h for h in self._beats.values() if now - h.sent_at < timeout_s and h.state != "stopping"]
        out = {"generators/alive": float(len(live)), "generators/lost": float(len(self._lost)),
               "generators/tokens_per_s": float(sum(h.tokens_per_s for h in live)),
               "generators/swap_pause_ms_max": max((h.swap_pause_ms for h in live), default=0.0),
               "generators/fetch_s_max": max((h.fetch_s for h in live), default=0.0),
               "learner/wait_s": self._waited_s}  # fmt: skip
        for h in live:
            out[f"generators/{h.generator_id}/tokens_per_s"] = float(h.tokens_per_s)
        return out

    def batch_ready(self, waited_s: float) -> None:
        """The learner has its batch after waiting ``waited_s`` for it; training starts now."""
        self._waited_s = waited_s
        self._batch_ready_at = time.monotonic()

    async def stepped(self, step: int, metrics: dict[str, Any], staleness: list[int]) -> None:
        """After a step (its metrics row, each trained group's staleness): update /metrics, send the signal."""
        trained_s = time.monotonic() - self._batch_ready_at
        try:
            backlog = await self._backlog_groups()
            self.window.add(self._waited_s, trained_s, backlog / self.cfg.batch_groups)
            self.last = self._signal(step, backlog)
            await self.report_lost()
            self._export(metrics, staleness, self.last)
            await self._send(self.last)
        except Exception as exc:  # informational: never stop training over it
            log.warning("scaling signal / metrics of step %d failed: %r", step, exc)

    async def _backlog_groups(self) -> int:
        """Entries of the rollout stream not yet delivered to the learner's group (its lag); the stream's length
        minus what the group holds pending when the server does not report the lag."""
        assert self._redis is not None
        names = self.cfg.run.names
        try:
            groups = await self._redis.xinfo_groups(names.rollouts_stream)
        except ResponseError:  # no stream yet
            return 0
        for g in groups:
            name = g.get("name")
            if (name.decode() if isinstance(name, bytes) else name) != names.rollouts_group:
                continue
            if g.get("lag") is not None:
                return int(g["lag"])
            return max(int(await self._redis.xlen(names.rollouts_stream)) - int(g.get("pending", 0)), 0)
        return int(await self._redis.xlen(names.rollouts_stream))

    def _signal(self, step: int, backlog: int) -> ScalingSignal:
        cfg = self.cfg
        n = self.generators_alive()
        share, low = self.window.wait_share, self.window.min_backlog_batches
        s = suggest(cfg.scaling, generators=n, wait_share=share, min_backlog_batches=low)
        return ScalingSignal(step=step, wait_share=round(share, 4), backlog_groups=backlog,
                             backlog_batches=round(backlog / cfg.batch_groups, 3), generators=n,
                             suggested_generators=s.generators, decision=s.decision, reason=s.reason)  # fmt: skip

    def _export(self, metrics: dict[str, Any], staleness: list[int], sig: ScalingSignal) -> None:
        e = self.exporter
        if not e.enabled:
            return
        e.inc("async_rl_learner_steps_total")
        e.set("async_rl_learner_step", sig.step)
        e.set("async_rl_learner_version", float(metrics["version"]))
        e.set("async_rl_learner_published_version", float(metrics["published_version"]))
        for lag in staleness:
            e.observe("async_rl_learner_group_staleness_versions", lag)
        e.inc("async_rl_learner_tokens_total", float(metrics["tokens"]))
        e.set("async_rl_learner_tokens_per_second", float(metrics["tokens_per_s"]))
        e.set("async_rl_learner_step_seconds", float(metrics["step_s"]))
        e.set("async_rl_learner_reward", float(metrics["reward"]))
        e.set("async_rl_learner_wait_share", sig.wait_share)
        e.set("async_rl_learner_rollout_backlog_groups", sig.backlog_groups)
        e.set("async_rl_learner_generators_alive", sig.generators)
        e.set("async_rl_learner_suggested_generators", sig.suggested_generators)
        e.set("async_rl_learner_dead_letters", float(metrics.get("buffer/dead_letters", 0)))
        e.set("async_rl_learner_prompts_dropped_stale", float(metrics.get("buffer/audit_dropped_stale", 0)))
        e.set("async_rl_learner_prompts_in_flight", float(metrics.get("buffer/audit_in_flight", 0)))

    async def _send(self, sig: ScalingSignal) -> None:
        assert self._redis is not None and self._control is not None
        names = self.cfg.run.names
        await self._redis.set(names.scaling_state, encode(sig))
        await self._control.publish(names.scaling_subject, sig)

    def close(self) -> None:
        self.exporter.close()
