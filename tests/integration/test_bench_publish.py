"""``async-rl bench publish`` on CPU, a few steps: both paths run against a real Redis, every applied version is
bit-exact, and the JSON has the fields docs/benchmarks records."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

FIELDS = ("model_bytes", "step_s", "publish_block_s", "publish_block_frac", "publish_latency_s",
          "peak_host_bytes_per_rank", "delta_bytes_ratio", "versions_skipped", "apply_exact", "machine")  # fmt: skip


def test_bench_publish_runs_both_paths_exactly(tmp_path: Path) -> None:
    out = tmp_path / "publish.json"
    cmd = [sys.executable, "-m", "actors.commands", "bench", "publish", "--json", str(out), "--steps", "4",
           "--batch-groups", "4"]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert set(FIELDS) <= set(data) and data["apply_exact"] is True
    assert set(data["modes"]) == {"blocking", "background"}
    assert data["modes"]["blocking"]["delta_bytes_ratio"] == 1.0 and 0 < data["delta_bytes_ratio"] <= 1.0
    assert data["modes"]["background"]["versions_applied"] >= 1
