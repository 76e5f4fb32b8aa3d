"""``async-rl bench loop`` end to end on CPU with real processes, in synchronous mode (``staleness.sync``):
every trained token comes from the learner's current version, no group is dropped, and the summary JSON has the
fields the GPU runs are recorded with (scripts/gpu/e2e.sh)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIELDS = ("steps", "steps_per_s", "step_interval_s", "train_s", "learner_tokens_per_s", "generator_tokens_per_s",
          "generator_fetch_s", "learner_idle_frac", "generator_idle_frac", "reward_curve", "tokens_by_staleness",
          "peak_memory_gib", "tracebacks", "machine")  # fmt: skip


def test_synchronous_loop_trains_only_on_the_current_version(tmp_path: Path) -> None:
    out = tmp_path / "loop.json"
    cmd = [sys.executable, "-m", "actors.commands", "bench", "loop", "--json", str(out), "--steps", "6",
           "--warmup-steps", "1", "--max-minutes", "4", "--run-dir", str(tmp_path / "run"),
           "--learner", "staleness.max_staleness=0", "--learner", "staleness.sync=true",
           "--learner", "admission_lag_versions=0"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads(out.read_text())
    assert set(FIELDS) <= set(summary)
    assert summary["steps"] >= 6 and summary["tracebacks"] == [] and summary["outcome"] == "learner finished"
    hist = summary["tokens_by_staleness"]
    assert hist["0"] > 0 and sum(hist.values()) == hist["0"], hist  # nothing trained was sampled by an older version
    assert "dropped" not in (tmp_path / "run" / "learner.log").read_text()  # and nothing was sampled in vain
    assert [row[0] for row in summary["reward_curve"]] == list(range(1, summary["steps"] + 1))
