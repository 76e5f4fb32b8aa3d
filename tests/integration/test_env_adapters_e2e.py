"""Environments of other systems run through their adapters with a real learner and generator process: a
skyrl-gym ``BaseTextEnv`` and a verifiers ``MultiTurnEnv``, each written against its own package's API
(tests/integration/adapted_envs.py), train for a few steps and report their episodes in the learner's metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.integration.procs import Procs
from tests.unit.test_env_adapters import write_rows

pytestmark = pytest.mark.slow

STEPS = 3


def _run(procs: Procs, task: list[str]) -> list[dict]:
    procs.learner(f"max_steps={STEPS}", "batch_groups=4", *task)
    procs.generator("gen-0", *task, "episode.max_turns=4", "episode.max_tokens=32")
    procs.wait_for(f"{STEPS} learner steps", lambda: procs.procs["learner"].poll() is not None, timeout_s=240)
    assert procs.procs["learner"].returncode == 0, procs.tails()
    rows = procs.metrics()
    assert len(rows) == STEPS, procs.tails()
    for r in rows:  # every episode ran its two turns to the environment's own end
        assert r["reward/episode/end_done"] == 1.0 and r["reward/episode/turns"] == 2.0, r
        assert r["loss/loss_tokens_count"] < r["tokens"] - r["samples"] * 2  # its replies stayed out of the loss
    return rows


def test_skyrl_gym_env_runs_through_its_adapter(procs: Procs, tmp_path: Path) -> None:
    pytest.importorskip("skyrl_gym")
    rows_path = write_rows(tmp_path / "rows.jsonl", n=8)
    rows = _run(procs, ["task.name=skyrl_gym", f"task.jsonl_path={rows_path}", "task.max_new_tokens=3",
                        "task.env.id=tests.integration.adapted_envs:DigitLookupEnv"])  # fmt: skip
    assert all(r["reward/env/steps"] == 2.0 and 0.0 <= r["reward/env/called"] <= 1.0 for r in rows)


def test_verifiers_env_runs_through_its_adapter(procs: Procs) -> None:
    pytest.importorskip("verifiers")
    rows = _run(procs, ["task.name=verifiers", "task.max_new_tokens=3", "task.env.args.num_rows=8",
                        "task.env.id=tests.integration.verifiers_env:load_environment"])  # fmt: skip
    assert all(0.0 <= r["reward/env/called"] <= 1.0 and "reward/env/correct" in r for r in rows)
