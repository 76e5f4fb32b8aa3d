"""``async-rl bench loop`` end to end on CPU with real processes, in synchronous mode (``staleness.sync``):
every trained token comes from the learner's current version, no group is dropped, and the summary JSON has the
fields the GPU runs are recorded with (scripts/gpu/e2e.sh)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path

from actors.commands.bench.loop import INTERRUPTED
from tests.integration.procs import children_of, is_alive

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
    assert summary["signalled"] is False
    hist = summary["tokens_by_staleness"]
    assert hist["0"] > 0 and sum(hist.values()) == hist["0"], hist  # nothing trained was sampled by an older version
    assert "dropped" not in (tmp_path / "run" / "learner.log").read_text()  # and nothing was sampled in vain
    assert [row[0] for row in summary["reward_curve"]] == list(range(1, summary["steps"] + 1))


def test_sigterm_stops_the_roles_and_writes_what_was_measured(tmp_path: Path) -> None:
    """A device call's time limit ends ``bench loop`` with SIGTERM (``timeout``): its learner, generators and servers
    stop with it (left running on a GPU machine, they would share the GPUs with the next call's measurement), and
    the summary of the steps done so far is written, its ``outcome`` saying why the run ended."""
    out, run = tmp_path / "loop.json", tmp_path / "run"
    cmd = [sys.executable, "-m", "actors.commands", "bench", "loop", "--json", str(out), "--steps", "500",
           "--warmup-steps", "1", "--max-minutes", "4", "--run-dir", str(run)]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 180
        metrics = run / "metrics.jsonl"
        while not (metrics.is_file() and metrics.read_text().count("\n") >= 2):
            assert proc.poll() is None, proc.communicate()[0][-3000:]
            assert time.monotonic() < deadline, "no learner step within 180 s"
            time.sleep(0.5)
        children = children_of(proc.pid)
        assert len(children) >= 2  # the learner and the generator (and the servers, where embedded)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, output[-3000:]  # stopped before its steps: not a finished benchmark
    summary = json.loads(out.read_text())
    assert summary["outcome"] == INTERRUPTED and summary["signalled"] and summary["steps"] >= 1, summary["outcome"]
    assert summary["tracebacks"] == []
    assert not [pid for pid in children if is_alive(pid)], "a role outlived the bench"
