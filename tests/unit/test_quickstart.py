"""The quickstart's argument and config checks (the full run is exercised by tests/integration/test_e2e.py)."""

from __future__ import annotations

import pytest

from actors.commands.quickstart import main, parse_args, plot_rewards


def test_bad_override_fails_before_anything_starts(capsys) -> None:
    assert main(["--learner", "batch_groups=0", "--quiet"]) == 2
    assert "config error: batch_groups must be >= 1" in capsys.readouterr().err  # the key as the user gives it
    assert main(["--generator", "nonsense.key=1", "--quiet"]) == 2
    assert "unknown config key" in capsys.readouterr().err


def test_bad_arguments_are_refused() -> None:
    for argv in (["--generators", "0"], ["--target-reward", "1.5"], ["--max-minutes", "0"]):
        with pytest.raises(SystemExit):
            parse_args(argv, "async-rl quickstart")


def test_reward_plot_is_written(tmp_path) -> None:
    path = tmp_path / "curve.png"
    plot_rewards([(1.0, 1, 0.1), (2.0, 2, 0.5), (3.0, 3, 0.95)], path, 0.9, "test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    plot_rewards([(1.0, 1, 0.0), (2.0, 2, 0.9)], path, 0.9, "test", shaped=[(1.0, 1, 0.3), (2.0, 2, 0.98)])
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_recipe_reports_and_stops_on_the_exact_match_rate() -> None:
    from actors.commands.quickstart import DEFAULT_LEARNER, HEADLINE

    assert HEADLINE == "reward/exact" and f"target_metric={HEADLINE}" in DEFAULT_LEARNER
    assert "torch.lr_schedule=cosine" in DEFAULT_LEARNER  # a constant lr collapses once solved (issue 21)



def test_the_table_fits_80_columns_and_the_figures_are_one_line(tmp_path, capsys) -> None:  # type: ignore[no-untyped-def]
    import argparse
    import io
    import json

    from rich.console import Console

    from actors.commands.quickstart import COLUMNS, Progress, progress_table, report
    from async_rl.metrics.sinks import METRICS_FILE

    progress = Progress(step=400, version=400, reward=0.981, exact=0.912, staleness_max=4, samples_per_s=1234,
                        dropped_stale=123, rewards=[(1.0, 1, 0.1), (2.0, 2, 0.95)])  # fmt: skip
    buf = io.StringIO()
    Console(file=buf, width=200).print(progress_table(progress, 16, 1234.0))
    lines = buf.getvalue().splitlines()
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    for header in COLUMNS:  # whole, not cut to "samp…"
        assert all(part in buf.getvalue() for part in header.split("\n")), header
    assert "…" not in buf.getvalue()

    (tmp_path / METRICS_FILE).write_text("".join(json.dumps({"step": s, "time": 0.0, "reward": 0.5 + s / 10,
                                                             "reward/exact": 0.9 + s / 100}) + "\n"
                                                 for s in range(1, 6)))  # fmt: skip
    args = argparse.Namespace(png=None, json=tmp_path / "figures.json", target_reward=0.9, generators=2)
    assert report(args, progress, tmp_path, 0.0, 12.0, "learner finished") == 0
    out, err = capsys.readouterr()
    assert err == ""  # the table, the verdict and the figures all on stdout
    lines = out.splitlines()
    assert max(len(line) for line in lines[:-2]) <= 80 and "version" in out  # the table (the verdict names a path)
    assert lines[-2].startswith("reached exact-match rate 0.9 in 12s (learner finished)")
    figures = json.loads(lines[-1])  # the JSON: its own last line
    assert figures == json.loads(args.json.read_text()) and figures["steps"] == 5 and figures["outcome"]
