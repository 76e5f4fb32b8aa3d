"""Prometheus ``/metrics`` of one process (learner or generator), off by default.

``prometheus.port=9400`` (any process) serves the text exposition format on ``http://host:9400/metrics`` from a
daemon thread of ``prometheus_client``, which is imported only then: with the port at 0 every method here is a
no-op and nothing is imported. Each process declares its metrics once, as a table of :class:`Metric` (name, kind,
help); the loops then set, increment or observe them by name. Every series carries the run prefix as the ``run``
label (and a generator's id as ``generator``), so one Prometheus scrapes many runs and generators apart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Literal

from async_rl.process.lifecycle import StartupError

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class PrometheusConfig:
    """Where the process serves ``/metrics``."""

    port: int = 0
    """TCP port of the /metrics endpoint (0: off)."""
    host: str = "0.0.0.0"
    """Address to listen on ('0.0.0.0': every interface, for a scraper on another host)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"prometheus.port must be in [0, 65535], got {self.port}")
        if not self.host:
            raise ValueError("prometheus.host must not be empty")


@dataclass(frozen=True, slots=True)
class Metric:
    """One metric a process exports: ``counter`` (only goes up), ``gauge`` or ``histogram``."""

    kind: Literal["counter", "gauge", "histogram"]
    help: str
    buckets: tuple[float, ...] = field(default=())
    """Histogram bucket upper bounds (prometheus_client's defaults when empty)."""
    labels: tuple[str, ...] = ()
    """Labels of its own beside the process's (``reason``), given with each :meth:`Exporter.inc`; keep their values
    few (a reason, not a message)."""


class Exporter:
    """The metrics of one process and their HTTP endpoint (see the module docstring)."""

    cfg: PrometheusConfig
    specs: dict[str, Metric]
    labels: dict[str, str]
    port: int
    """The port actually listened on (0 while off)."""
    _metrics: dict[str, Any]
    _server: Any
    _thread: Any

    def __init__(self, cfg: PrometheusConfig, specs: dict[str, Metric], labels: dict[str, str]) -> None:
        self.cfg = cfg
        self.specs = specs
        self.labels = labels
        self.port = 0
        self._metrics = {}
        self._server = None
        self._thread = None

    @property
    def enabled(self) -> bool:
        return self.cfg.port > 0

    def start(self) -> Exporter:
        """Create the metrics and listen (a port in use raises :class:`StartupError` naming it)."""
        if not self.enabled:
            return self
        import prometheus_client as pc

        registry = pc.CollectorRegistry(auto_describe=True)
        for name, spec in self.specs.items():
            names = (*self.labels, *spec.labels)
            if spec.kind == "counter":
                m: Any = pc.Counter(name, spec.help, names, registry=registry)
            elif spec.kind == "gauge":
                m = pc.Gauge(name, spec.help, names, registry=registry)
            else:
                buckets = spec.buckets or pc.Histogram.DEFAULT_BUCKETS
                m = pc.Histogram(name, spec.help, names, registry=registry, buckets=buckets)
            # With labels of its own the metric is labelled at each inc; else once, here.
            self._metrics[name] = m.labels(**self.labels) if names and not spec.labels else m
        try:
            self._server, self._thread = pc.start_http_server(self.cfg.port, addr=self.cfg.host, registry=registry)
        except OSError as exc:
            raise StartupError(f"cannot serve /metrics on {self.cfg.host}:{self.cfg.port}: {exc}") from exc
        self.port = int(self._server.server_port)
        log.info("serving Prometheus metrics on http://%s:%d/metrics", self.cfg.host, self.port)
        return self

    def set(self, name: str, value: float) -> None:
        if self._metrics:
            self._metrics[name].set(value)

    def inc(self, name: str, amount: float = 1.0, **labels: str) -> None:
        """``labels``: the metric's own (:attr:`Metric.labels`), e.g. ``reason=...``."""
        if self._metrics and amount > 0:
            m = self._metrics[name]
            (m.labels(**self.labels, **labels) if self.specs[name].labels else m).inc(amount)

    def observe(self, name: str, value: float) -> None:
        if self._metrics:
            self._metrics[name].observe(value)

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None
        self._metrics = {}
