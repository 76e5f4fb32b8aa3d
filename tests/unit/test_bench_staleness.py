"""``async-rl bench staleness`` end to end on a tiny grid: the JSON's shape, the exact lag, the mixed variant."""

from __future__ import annotations

import json
from pathlib import Path

from actors.commands.bench import staleness


def test_tiny_grid_json_shape_and_exact_lag(tmp_path: Path) -> None:
    out, png = tmp_path / "st.json", tmp_path / "st.png"
    argv = [
        "--json",
        str(out),
        "--plot",
        str(png),
        "--tasks",
        "copy",
        "--methods",
        "none,default",
        "--staleness",
        "0,2",
        "--seeds",
        "1",
        "--steps",
        "5",
        "--workers",
        "1",
        "--mixed",
        "default",
        "--mixed-staleness",
        "2",
    ]
    assert staleness.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["grid"] == [0, 2] and data["seeds"] == 1 and data["steps"] == 5 and data["metric"] == {"copy": "reward/exact"}
    assert data["machine"]["cpus"] and data["machine"]["torch"]
    assert set(data["results"]) == {"copy"} and set(data["results"]["copy"]) == {"none", "default"}
    for method in ("none", "default"):
        cells = data["results"]["copy"][method]
        assert set(cells) == {"0", "2"}
        for s, cell in cells.items():
            assert len(cell["final_reward_seeds"]) == 1 and 0.0 <= cell["final_reward"] <= 1.0
            assert cell["steps_to_0_9"] is None or cell["steps_to_0_9"] >= 5
            assert cell["lag_exact"] and cell["token_lag_max"] == int(s)
        # on-policy, the learner's logprobs are the sampler's; stale, they differ
        assert cells["0"]["abs_log_ratio_max"] < 1e-3 < cells["2"]["abs_log_ratio_mean"]
    mixed = data["mixed"]["copy"]["default"]
    assert set(mixed) == {"per_token", "oldest"}
    # versions v - 2 and v in one response: the oldest token is 2 behind; treating all as oldest moves μ off
    assert mixed["per_token"]["2"]["token_lag_max"] == 2
    assert mixed["oldest"]["2"]["abs_log_ratio_mean"] > mixed["per_token"]["2"]["abs_log_ratio_mean"]
    assert len(data["runs"]) == 6 and png.stat().st_size > 0
    # --resume keeps the runs and starts none
    assert staleness.main([*argv, "--resume"]) == 0
    assert len(json.loads(out.read_text())["runs"]) == 6
