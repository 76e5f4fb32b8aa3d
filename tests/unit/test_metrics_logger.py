"""Metrics sinks: a restarted learner logs into the same wandb run (offline here: no network), JSONL beside it."""

from __future__ import annotations

import logging
import time
from pathlib import Path

import pytest

from async_rl.metrics.sinks import WANDB_ID_FILE, MetricsConfig, MetricsLogger, read_metrics


def test_a_restart_resumes_the_same_wandb_run_and_says_how_to_sync(tmp_path: Path,
                                                                    caplog: pytest.LogCaptureFixture) -> None:  # fmt: skip
    pytest.importorskip("wandb")
    cfg = MetricsConfig(wandb_mode="offline")
    ids = []
    for step0 in (1, 3):  # the learner, then the same learner restarted on the same run directory
        with caplog.at_level(logging.INFO, logger="async_rl.metrics.sinks"):
            m = MetricsLogger(cfg, tmp_path, config={"lr": 1e-3}, name="t")
            assert m.wandb_mode == "offline" and m._run is not None
            ids.append(m._run.id)
            m.log(step0, {"reward": 0.5})
            m.log(step0 + 1, {"reward": 0.6})
            m.close()
        time.sleep(1.05)  # wandb names its directory by the start's second: the restart gets a second directory
    assert ids[0] == ids[1] == (tmp_path / WANDB_ID_FILE).read_text().strip()
    runs = sorted((tmp_path / "wandb").glob(f"offline-run-*-{ids[0]}"))
    assert runs, sorted(p.name for p in (tmp_path / "wandb").iterdir())
    assert len(runs) == 2  # the hint names both, oldest first (it named only the last before)
    hints = [r.getMessage() for r in caplog.records if "wandb sync" in r.getMessage()]
    assert hints[-1].endswith(f"`wandb sync {' '.join(str(r) for r in runs)}`"), (hints, runs)
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4]
