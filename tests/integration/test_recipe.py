"""The README's "several processes on one box" recipe: the commands ``async-rl quickstart --print-recipe`` prints
are run as printed (the learner, two generators; against this test's servers and prefix) and the reward rises."""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from actors.commands.quickstart import main as quickstart_main
from async_rl.metrics.sinks import read_metrics
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet

pytestmark = pytest.mark.slow

STEPS = 80
RISE = 0.1  # the recipe's peak lr is 5e-4 since issue 21: four quickstarts rose 0.16-0.23 over their first 80 steps

def test_the_printed_recipe_learns(servers: ServerSet, names: Names, tmp_path: Path, capsys) -> None:
    run_dir = tmp_path / "run"
    assert quickstart_main(["--print-recipe", "--prefix", names.prefix, "--redis-url", servers.redis_url,
                            "--nats-url", servers.nats_url, "--run-dir", str(run_dir), "--max-steps", str(STEPS),
                            "--learner", "metrics.wandb_mode=disabled"]) == 0  # fmt: skip
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln and not ln.startswith("#")]
    commands = [shlex.split(ln) for ln in lines if " learner " in ln or " generator " in ln]
    assert [c[c.index("async-rl") + 1] for c in commands] == ["learner", "generator", "generator"], lines
    procs: list[subprocess.Popen] = []
    try:
        for i, cmd in enumerate(commands):
            env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
            at = cmd.index("async-rl")
            env.update(kv.split("=", 1) for kv in cmd[:at])  # the OMP_NUM_THREADS=1 the recipe sets
            log = (tmp_path / f"p{i}.log").open("wb")
            procs.append(subprocess.Popen([sys.executable, "-m", "actors.commands", *cmd[at + 1:]], stdout=log,
                                          stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env))  # fmt: skip
        deadline = time.monotonic() + 600
        rows: list[dict] = []
        while time.monotonic() < deadline and procs[0].poll() is None:
            rows = read_metrics(run_dir) if run_dir.is_dir() else []
            if len(rows) >= STEPS:
                break
            time.sleep(1.0)
        rows = read_metrics(run_dir)
        logs = "\n".join(f"--- p{i}\n" + (tmp_path / f"p{i}.log").read_text()[-2000:] for i in range(len(procs)))
        assert len(rows) >= STEPS, logs
        first = sum(r["reward"] for r in rows[:5]) / 5
        last = sum(r["reward"] for r in rows[-5:]) / 5
        print("\nrecipe rewards:", [round(r["reward"], 3) for r in rows])
        assert last > first + RISE, (first, last, [round(r["reward"], 3) for r in rows])
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
        for p in procs:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
