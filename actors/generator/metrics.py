"""A generator's Prometheus metrics (``prometheus.port``, off by default; :mod:`async_rl.metrics.prometheus`).

Counters move with the work (prompts acked, tokens generated, heartbeats sent); gauges are refreshed on every
heartbeat from the same numbers the heartbeat carries, plus the weight sync's last fetch time and the engine's
last swap pause. Series carry the ``run`` prefix and the ``generator`` id as labels.
"""

from __future__ import annotations

from actors.generator.config import GeneratorConfig
from actors.generator.core_follow import CoreFollow
from actors.generator.engine import Engine
from actors.generator.weight_sync import WeightSync
from async_rl.metrics.prometheus import Exporter, Metric
from async_rl.servers.control import Heartbeat

GENERATOR_METRICS: dict[str, Metric] = {
    "async_rl_generator_prompts_total": Metric("counter", "Prompts turned into a pushed group and acked."),
    "async_rl_generator_tokens_total": Metric("counter", "Response tokens generated."),
    "async_rl_generator_heartbeats_total": Metric("counter", "Heartbeats sent on NATS."),
    "async_rl_generator_tokens_per_second": Metric("gauge", "Tokens per second over the last heartbeat interval."),
    "async_rl_generator_version": Metric("gauge", "Weight version in use."),
    "async_rl_generator_in_flight_prompts": Metric("gauge", "Prompts held (being generated)."),
    "async_rl_generator_weight_failures": Metric("gauge", "Weight versions refused or vanished since start."),
    "async_rl_generator_weight_fetch_seconds": Metric(
        "histogram", "Time to fetch, verify and stage one weight version (generation goes on meanwhile).",
        buckets=(0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)),  # fmt: skip
    "async_rl_generator_weight_swap_pause_seconds": Metric("gauge", "Time generation stood still for the last swap."),
    "async_rl_generator_scoring_errors_total": Metric(
        "counter", "Samples whose reward or environment raised, by reason (where, the exception, its line).",
        labels=("reason",)),  # fmt: skip
    "async_rl_generator_dead_lettered_groups_total": Metric(
        "counter", "Groups sent to the dead letters because scoring raised on some of their samples."),
}


class GeneratorMetrics:
    """The exporter of one generator and the bookkeeping of what it has observed."""

    exporter: Exporter
    _fetch_seen: int
    """Version whose fetch time was observed last (each staged version is observed once)."""

    def __init__(self, cfg: GeneratorConfig) -> None:
        labels = {"run": cfg.run.prefix, "generator": cfg.generator_id}
        self.exporter = Exporter(cfg.prometheus, GENERATOR_METRICS, labels)
        self._fetch_seen = -1

    def start(self) -> None:
        self.exporter.start()

    def generated(self, num_prompts: int, num_tokens: int) -> None:
        self.exporter.inc("async_rl_generator_prompts_total", num_prompts)
        self.exporter.inc("async_rl_generator_tokens_total", num_tokens)

    def scoring_error(self, reason: str) -> None:
        self.exporter.inc("async_rl_generator_scoring_errors_total", reason=reason)

    def dead_lettered(self) -> None:
        self.exporter.inc("async_rl_generator_dead_lettered_groups_total")

    def beat(self, hb: Heartbeat, sync: WeightSync | CoreFollow | None, engine: Engine | None) -> None:
        e = self.exporter
        if not e.enabled:
            return
        e.inc("async_rl_generator_heartbeats_total")
        e.set("async_rl_generator_tokens_per_second", hb.tokens_per_s)
        e.set("async_rl_generator_version", hb.version)
        e.set("async_rl_generator_in_flight_prompts", hb.in_flight)
        e.set("async_rl_generator_weight_failures", hb.weight_failures)
        if sync is not None and sync.last_fetch is not None and sync.last_fetch.version != self._fetch_seen:
            self._fetch_seen = sync.last_fetch.version
            e.observe("async_rl_generator_weight_fetch_seconds", sync.last_fetch.total_s)
        if engine is not None:
            e.set("async_rl_generator_weight_swap_pause_seconds", engine.last_swap_pause_s)

    def close(self) -> None:
        self.exporter.close()
