"""Metrics sinks: wandb (online when a key is configured, offline otherwise, never a prompt)
and a JSONL file beside the run, so every run keeps its numbers even without wandb.

A step's row may carry samples as text under :data:`SAMPLES_KEY` (a list of dicts, the learner's samples table): they
go to ``<run_dir>/samples.jsonl``, one line per sample with its step, and to wandb as the table ``samples_table``,
never into ``metrics.jsonl``."""

from __future__ import annotations

import json
import logging
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

log = logging.getLogger(__name__)


@dataclass(kw_only=True, slots=True)
class MetricsConfig:
    """Where metrics go."""

    wandb_mode: Literal["auto", "online", "offline", "disabled"] = "auto"
    """auto: online when WANDB_API_KEY (or a wandb login) is present, offline otherwise."""
    wandb_project: str = "async-rl"
    """wandb project name."""
    wandb_entity: str | None = None
    """wandb entity (team or user); None for the default."""
    run_name: str | None = None
    """Run name shown in wandb (default: the run prefix)."""
    jsonl: bool = True
    """Also append every logged step to <run_dir>/metrics.jsonl."""


METRICS_FILE = "metrics.jsonl"
"""Name of the per-step metrics file :class:`MetricsLogger` appends to in the run directory."""
SAMPLES_KEY = "samples_table"
"""Key of a row's samples (a list of dicts), and the name of their wandb table (``samples`` is the row's count)."""
SAMPLES_FILE = "samples.jsonl"
"""Where :class:`MetricsLogger` appends the samples of the rows that carry them, one line per sample."""


def read_metrics(run_dir: Path, file: str = METRICS_FILE) -> list[dict[str, Any]]:
    """The rows :class:`MetricsLogger` wrote under ``run_dir`` (a line cut short by a crash is skipped); ``file``
    :data:`SAMPLES_FILE`: its samples."""
    path = run_dir / file
    if not path.is_file():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def _wandb_logged_in() -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    netrc = Path.home() / ".netrc"
    try:
        return netrc.is_file() and "api.wandb.ai" in netrc.read_text()
    except OSError:
        return False


def resolve_wandb_mode(mode: str) -> str:
    if mode != "auto":
        return mode
    return "online" if _wandb_logged_in() else "offline"


WANDB_ID_FILE = "wandb-run-id"
"""File in the run directory holding the wandb run id, so that every restart of the run logs into the same run."""


def _wandb_run_id(run_dir: Path) -> str:
    path = run_dir / WANDB_ID_FILE
    if path.is_file() and (existing := path.read_text().strip()):
        return existing
    run_id = uuid.uuid4().hex[:12]
    path.write_text(run_id + "\n")
    return run_id


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def offline_run_dirs(wandb_dir: Path, run_id: str) -> list[Path]:
    """Every offline directory of wandb run ``run_id`` under ``wandb_dir``, oldest first: wandb writes a new
    ``offline-run-<time>-<id>`` on each start, a resumed learner included, and ``wandb sync`` takes them all, in
    order, into the one run."""
    return sorted(wandb_dir.glob(f"offline-run-*-{run_id}"))


class MetricsLogger:
    """Logs step metrics to wandb and a JSONL file."""

    cfg: MetricsConfig
    run_dir: Path
    _run: Any
    _jsonl: Any
    _samples: Any
    """``samples.jsonl``, opened at the first row that carries samples."""
    wandb_mode: str
    """The mode wandb runs in ('online', 'offline'), or 'disabled'."""

    def __init__(self, cfg: MetricsConfig, run_dir: Path, *, config: dict[str, Any], name: str) -> None:
        self.cfg = cfg
        self.run_dir = run_dir
        self._run = None
        self._jsonl = None
        self._samples = None
        self.wandb_mode = "disabled"
        run_dir.mkdir(parents=True, exist_ok=True)
        if cfg.jsonl:
            self._jsonl = (run_dir / METRICS_FILE).open("a", buffering=1)
        mode = resolve_wandb_mode(cfg.wandb_mode)
        if mode != "disabled":
            os.environ.setdefault("WANDB_SILENT", "true")
            os.environ.setdefault("WANDB_CONSOLE", "off")
            try:
                import wandb

                # One wandb run per run directory: a restarted learner resumes it (same id, steps continue).
                run_id = _wandb_run_id(run_dir)
                self._run = wandb.init(
                    project=cfg.wandb_project, entity=cfg.wandb_entity, name=cfg.run_name or name, dir=str(run_dir),
                    mode=mode, config=config, id=run_id, resume="allow",  # type: ignore[arg-type]
                    settings=wandb.Settings(console="off", silent=True),
                )  # fmt: skip
                self.wandb_mode = mode
                log.info("wandb run %s id %s (%s mode)", cfg.run_name or name, run_id, mode)
            except Exception as exc:  # a metrics sink must never take training down
                log.warning("wandb disabled: %s", exc)
                self._run = None

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        samples = metrics.get(SAMPLES_KEY)
        if isinstance(samples, list) and samples:
            self._log_samples(step, samples)
        clean: dict[str, Any] = {}
        for k, v in metrics.items():
            if _finite(v):
                clean[k] = v
            elif isinstance(v, dict):  # histograms as {bucket: count}
                clean[k] = v
        if self._jsonl is not None:
            self._jsonl.write(json.dumps({"step": step, "time": time.time(), **clean}) + "\n")
        if self._run is not None:
            flat = {k: v for k, v in clean.items() if not isinstance(v, dict)}
            for k, v in clean.items():
                if isinstance(v, dict) and v:
                    try:
                        import wandb

                        values = [float(b) for b, c in v.items() for _ in range(int(c))]
                        flat[k] = wandb.Histogram(values) if values else None
                    except Exception:  # noqa: S112 - histogram is best effort
                        continue
            self._run.log(flat, step=step)

    def _log_samples(self, step: int, samples: list[dict[str, Any]]) -> None:
        """A row's samples: one line each in ``samples.jsonl`` (with ``jsonl``), and a wandb table of them (the
        columns are the first sample's keys; dict values shown as JSON)."""
        if self.cfg.jsonl:
            if self._samples is None:
                self._samples = (self.run_dir / SAMPLES_FILE).open("a", buffering=1)
            self._samples.write("".join(json.dumps({"step": step, **s}) + "\n" for s in samples))
        if self._run is not None:
            try:
                import wandb

                columns: list[str | int] = ["step", *samples[0]]
                data = [[step, *(json.dumps(v) if isinstance(v, (dict, list)) else v for v in
                                 (s.get(str(c)) for c in columns[1:]))] for s in samples]  # fmt: skip
                self._run.log({SAMPLES_KEY: wandb.Table(columns=columns, data=data)}, step=step)
            except Exception as exc:  # a metrics sink must never take training down
                log.warning("wandb samples table of step %d not logged: %r", step, exc)

    def close(self) -> None:
        if self._jsonl is not None:
            self._jsonl.close()
            self._jsonl = None
        if self._samples is not None:
            self._samples.close()
            self._samples = None
        if self._run is not None:
            run_dir = getattr(self._run, "dir", "") or ""
            try:
                self._run.finish()
            except Exception as exc:  # pragma: no cover
                log.warning("wandb finish failed: %s", exc)
            if self.wandb_mode == "offline" and run_dir:  # .../wandb/offline-run-<time>-<id>/files
                log.info("wandb ran offline: upload with `wandb sync %s`", " ".join(
                    str(p) for p in offline_run_dirs(Path(run_dir).parent.parent, self._run.id)))  # fmt: skip
            self._run = None
