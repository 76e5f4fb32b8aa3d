"""A run of a two-task mixture with an evaluation suite of its two sources (real processes, real servers): every step
reports its rewards per source, every round per source mean@n, pass@k and maj@k, in metrics.jsonl and in wandb
(offline); then ``async-rl eval`` on the exported checkpoint of a round's version, and on the run directory at that
version, gives the round's numbers (same prompts, greedy)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from actors.commands.evaluate import main as eval_main
from actors.commands.export import main as export_main
from tests.integration.procs import Procs

STEPS = 4
MIX = ('task.mix=[{"name": "copy", "min_digits": 3, "max_digits": 3}, '
       '{"name": "reverse", "min_digits": 3, "max_digits": 3, "weight": 2}]')  # fmt: skip
SOURCES = ("copy", "reverse")
SCORES = ("reward", "exact", "length_ok", "mean@2", "pass@1", "pass@2", "maj@1", "maj@2")


def test_a_mixture_is_reported_per_source_and_async_rl_eval_gives_the_rounds_numbers(
    procs: Procs, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Synchronous: a round issued at version v is sampled with v alone (its prompts go out before the next batch's,
    # and the learner trains no further before that batch comes back).
    procs.learner(f"max_steps={STEPS}", "batch_groups=4", "sampling.n=4", "staleness.sync=true",
                  "staleness.max_staleness=0", "admission_lag_versions=0", "checkpoint.keep=10", "eval.interval_versions=2", "eval.num_prompts=4", "eval.n=2", "eval.k=[1,2]",
                  "metrics.wandb_mode=offline", "publisher.background=false", MIX)  # fmt: skip
    procs.generator("gen-0", MIX)
    procs.wait_for(f"{STEPS} learner steps", lambda: procs.procs["learner"].poll() is not None, timeout_s=240)
    assert procs.procs["learner"].returncode == 0, procs.tails()
    rows = procs.metrics()
    assert len(rows) == STEPS, procs.tails()
    for r in rows:  # each step's groups, per source
        assert sum(r.get(f"train/{s}/groups", 0) for s in SOURCES) == 4, r
        for s in SOURCES:
            if f"train/{s}/groups" in r:
                assert 0.0 <= r[f"train/{s}/reward/exact"] <= r[f"train/{s}/reward"] <= 1.0
    assert all(any(f"train/{s}/reward" in r for r in rows) for s in SOURCES)
    evaluated = [r for r in rows if "eval/copy/version" in r]
    assert evaluated and [r["eval/copy/version"] for r in evaluated] == sorted({r["eval/copy/version"] for r in evaluated})
    for r in evaluated:
        for s in SOURCES:
            got = {k: r[f"eval/{s}/{k}"] for k in (*SCORES, "num_prompts", "version", "weights_version_min")}
            assert got["num_prompts"] == 4 and got["version"] == r["eval/copy/version"], got
            # Greedy: both samples of a prompt are one answer, so pass@2 is pass@1 and the vote is that answer's.
            assert got["pass@2"] == got["pass@1"] and got["maj@1"] == got["maj@2"] == pytest.approx(got["mean@2"])
            assert got["reward"] == pytest.approx(got["mean@2"]) and got["pass@1"] == pytest.approx(got["exact"])
    files = sorted((procs.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, procs.tails()
    data = files[-1].read_bytes()
    assert b"eval/reverse/pass@2" in data and b"eval/copy/maj@1" in data and b"train/reverse/reward" in data

    # The round of a trained version, sampled with that version alone.
    [row] = [r for r in evaluated if r["eval/copy/version"] == 2]
    assert all(row[f"eval/{s}/weights_version_min"] == row[f"eval/{s}/weights_version_max"] == 2 for s in SOURCES)
    want = {k: v for k, v in row.items() if k.startswith("eval/") and "weights_version" not in k}
    hf, out = tmp_path / "hf-v2", tmp_path / "eval.json"
    assert export_main([str(procs.run_dir), str(hf), "--step", "2"]) == 0  # synchronous, every step: step 2 is v2
    capsys.readouterr()
    assert eval_main([str(hf), "--out", str(out)]) == 0
    printed = capsys.readouterr().out
    report = json.loads(out.read_text())
    got = {k: v for k, v in report["metrics"].items() if "weights_version" not in k}
    assert got == pytest.approx(want, rel=1e-12, abs=1e-12) and set(got) == set(want), (got, want)
    assert report["version"] == 2 and report["sources"] == list(SOURCES) and report["num_failed"] == 0
    assert "pass@2" in printed.splitlines()[0] and printed.splitlines()[1].startswith("copy ")
    # The run directory at that version: the same (exported on the fly), written beside the run.
    assert eval_main([str(procs.run_dir), "--version", "2"]) == 0
    again = json.loads((procs.run_dir / "eval-v2.json").read_text())["metrics"]
    assert {k: v for k, v in again.items() if "weights_version" not in k} == pytest.approx(want, rel=1e-12, abs=1e-12)
    capsys.readouterr()
    assert eval_main([str(procs.run_dir), "--version", "99"]) == 1
    assert "--version 99: no checkpoint of that version" in capsys.readouterr().err
