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

