"""A reasoning-gym dataset trained by the quickstart's processes (a learner, a generator; real servers): the prompts
are the dataset's questions in a byte-level tokenizer's ids, and the dataset's own scorer's reward reaches the
learner's metrics."""

from __future__ import annotations

from pathlib import Path

import pytest

from async_rl.models import save_pretrained_dir
from tests.integration.procs import Procs

pytest.importorskip("reasoning_gym")

STEPS = 4


def rg_args(model_dir: Path) -> list[str]:
    """What the learner and the generators of a reasoning-gym run share: the task, read with the model's tokenizer."""
    return ["task.name=reasoning_gym", "task.dataset=basic_arithmetic", f"task.tokenizer={model_dir}",
            "task.dataset_config.min_terms=2", "task.dataset_config.max_terms=2", "task.dataset_config.min_digits=1",
            "task.dataset_config.max_digits=1",
            "task.max_new_tokens=6"]  # fmt: skip


def test_reasoning_gym_task_trains_with_its_scorer(procs: Procs, tmp_path: Path) -> None:
    model_dir = save_pretrained_dir(tmp_path / "model", preset="tiny-moe", tokenizer="bytes")
    procs.learner(f"max_steps={STEPS}", "batch_groups=4", "sampling.n=4", f"model.name={model_dir}",
                  *rg_args(model_dir))  # fmt: skip
    procs.generator("gen-0", f"torch.model.name={model_dir}", *rg_args(model_dir))
    procs.wait_for(f"{STEPS} learner steps", lambda: procs.procs["learner"].poll() is not None, timeout_s=300)
    assert procs.procs["learner"].returncode == 0, procs.tails()
    rows = procs.metrics()
    assert len(rows) == STEPS, procs.tails()
    for r in rows:
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["reward/correct"] <= r["reward"] + 1e-9, r
