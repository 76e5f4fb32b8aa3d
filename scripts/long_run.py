"""The quickstart's recipe left running: learner and generators as processes, one learner kill and restart.

Issue 21's stability check. Starts embedded servers, the learner with the quickstart's settings
(``actors.commands.quickstart.DEFAULT_LEARNER``, no target: it runs to ``--steps``) and generators
with the quickstart's generator settings, SIGKILLs the learner once it has taken ``--restart-at``
steps (between checkpoints: ``checkpoint.every`` is 10), starts a new one on the same run directory,
and waits for ``--steps``. Then it reads ``metrics.jsonl`` and writes a JSON summary (best and final
exact-match rate as a ``--window``-step moving average, the largest fall from the best, grad norm and
IS ratio maxima, where the learner resumed) and a curve PNG.

    python3 scripts/long_run.py --steps 3000 --restart-at 1505 \\
        --json docs/quickstart/long-run.json --png docs/quickstart/long-run.png

Not part of the test suite: 2,000 steps take about an hour on 2 CPU cores.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=2000, help="learner steps in all (default 2000)")
    p.add_argument("--restart-at", type=int, default=1005,
                   help="SIGKILL the learner after this step (0: never); off a multiple of checkpoint.every (10), so "
                        "the steps since the last checkpoint are lost and trained again")
    p.add_argument("--generators", type=int, default=2, help="generator processes (default 2)")
    p.add_argument("--window", type=int, default=20, help="steps of the moving average the figures use")
    p.add_argument("--run-dir", type=Path, default=None, help="default runs/long-run-<time>")
    p.add_argument("--json", type=Path, default=None, help="summary (default <run-dir>/long-run.json)")
    p.add_argument("--png", type=Path, default=None, help="curve (default <run-dir>/long-run.png)")
    p.add_argument("--max-hours", type=float, default=4.0, help="give up after this long")
    p.add_argument("--learner", action="append", default=[], metavar="KEY=VALUE", help="extra learner override")
    args = p.parse_args(argv)
    if not 0 <= args.restart_at < args.steps:
        p.error("--restart-at must be in [0, --steps)")
    return args


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    env = dict(os.environ, OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    return subprocess.Popen(cmd, stdout=log.open("ab"), stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import redis

    from actors.commands.quickstart import DEFAULT_LEARNER, GENERATOR_ARGS
    from async_rl.run.names import Names
    from async_rl.servers.embedded import ensure_servers

    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir: Path = args.run_dir or Path("runs") / f"long-run-{stamp}"
    run_dir.mkdir(parents=True, exist_ok=True)
    prefix = f"long-run-{stamp}-{os.getpid()}"
    servers = ensure_servers(None, None)
    common = [f"run.prefix={prefix}", f"run.redis_url={servers.redis_url}", f"run.nats_url={servers.nats_url}"]
    cli = [sys.executable, "-m", "actors.commands.cli"]
    learner_cmd = [*cli, "learner", *common, f"run.run_dir={run_dir}", *DEFAULT_LEARNER, f"max_steps={args.steps}",
                   "metrics.wandb_mode=disabled", *args.learner]  # fmt: skip
    client = redis.Redis.from_url(servers.redis_url)
    state_key = Names(prefix=prefix).learner_state
    t0 = time.time()
    deadline = t0 + args.max_hours * 3600
    restart: dict[str, Any] = {}
    procs: list[subprocess.Popen] = []
    last_print = 0
    outcome = "time limit"
    try:
        learner = _spawn(learner_cmd, run_dir / "learner.log")
        procs = [_spawn([*cli, "generator", *common, f"generator_id=gen-{i}", *GENERATOR_ARGS],
                        run_dir / f"generator-{i}.log") for i in range(args.generators)]  # fmt: skip
        while time.time() < deadline:
            time.sleep(1.0)
            step = int(client.hget(state_key, "step") or 0)
            if args.restart_at and not restart and step >= args.restart_at:
                learner.send_signal(signal.SIGKILL)
                learner.wait()
                restart = {"killed_at_step": step, "signal": "SIGKILL", "at_s": round(time.time() - t0, 1)}
                print(f"learner SIGKILLed after step {step}; restarting", flush=True)
                learner = _spawn(learner_cmd, run_dir / "learner-2.log")
            elif step >= last_print + 100:
                last_print = step - step % 100
                print(f"step {step} ({time.time() - t0:.0f}s)", flush=True)
            if learner.poll() is not None:
                outcome = "learner finished" if learner.returncode == 0 else f"learner failed ({learner.returncode})"
                break
    finally:
        for p in [learner, *procs]:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
        for p in [learner, *procs]:
            try:
                p.wait(60)
            except subprocess.TimeoutExpired:
                p.kill()
        client.close()
        servers.stop()
    if restart:
        log = (run_dir / "learner-2.log").read_text(errors="replace")
        resumed = [ln for ln in log.splitlines() if "resumed from checkpoint" in ln]
        restart["resumed"] = resumed[0].split("resumed from checkpoint: ")[-1] if resumed else None
    summary = summarize(run_dir, args.window, restart)
    summary.update(outcome=outcome, wall_s=round(time.time() - t0, 1), generators=args.generators,
                   learner_args=[*DEFAULT_LEARNER, f"max_steps={args.steps}", *args.learner],
                   generator_args=GENERATOR_ARGS, run_dir=str(run_dir))  # fmt: skip
    json_path = args.json or run_dir / "long-run.json"
    png_path = args.png or run_dir / "long-run.png"
    summary["png"] = str(png_path)
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(summary, indent=2) + "\n")
    plot(run_dir, png_path, args.window, restart, summary)
    print(json.dumps(summary, indent=2))
    ok = outcome == "learner finished" and summary["max_regression_from_best"] <= 0.05
    return 0 if ok else 1


def _moving_average(x: np.ndarray, window: int) -> np.ndarray:
    if len(x) < window:
        return np.array([x.mean()]) if len(x) else x
    return np.convolve(x, np.ones(window) / window, mode="valid")


def _rows(run_dir: Path) -> list[dict[str, Any]]:
    from async_rl.metrics.sinks import read_metrics

    by_step = {int(r["step"]): r for r in read_metrics(run_dir) if "step" in r}  # one row per committed step
    return [by_step[s] for s in sorted(by_step)]


def summarize(run_dir: Path, window: int, restart: dict[str, Any]) -> dict[str, Any]:
    """Figures of the run from its metrics.jsonl (moving averages over ``window`` steps)."""
    rows = _rows(run_dir)
    window = max(1, min(window, len(rows)))
    exact = np.array([r.get("reward/exact", 0.0) for r in rows])
    ma = _moving_average(exact, window)
    running_best = np.maximum.accumulate(ma)
    first_09 = next((int(rows[i + window - 1]["step"]) for i, v in enumerate(ma) if v >= 0.9), None)
    return {
        "steps": int(rows[-1]["step"]) if rows else 0,
        "steps_logged": len(rows),
        "restart": restart,
        "window": window,
        "exact_first": round(float(ma[0]), 4) if len(ma) else None,
        "exact_best": round(float(ma.max()), 4) if len(ma) else None,
        "exact_final": round(float(ma[-1]), 4) if len(ma) else None,
        "first_step_exact_ge_0.9": first_09,
        "max_regression_from_best": round(float((running_best - ma).max()), 4) if len(ma) else None,
        "exact_min_after_0.9": round(float(ma[first_09 - window + 1:].min()), 4) if first_09 else None,  # noqa: E203
        "reward_final": round(float(_moving_average(np.array([r["reward"] for r in rows]), window)[-1]), 4),
        "grad_norm_max": round(max(r["grad_norm"] for r in rows), 3),
        "is_ratio_max": round(max(r.get("loss/is_ratio_max", 0.0) for r in rows), 2),
        "lr_final": rows[-1].get("loss/lr"),
        "dropped_stale": int(rows[-1].get("buffer/dropped_stale", 0)),
    }


def plot(run_dir: Path, path: Path, window: int, restart: dict[str, Any], summary: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = _rows(run_dir)
    window = max(1, min(window, len(rows)))
    steps = np.array([r["step"] for r in rows])
    exact = np.array([r.get("reward/exact", 0.0) for r in rows])
    reward = np.array([r["reward"] for r in rows])
    fig, ax = plt.subplots(2, 1, figsize=(10, 6), sharex=True, gridspec_kw={"height_ratios": [3, 1.3]})
    ax[0].plot(steps, exact, color="tab:blue", alpha=0.25, linewidth=0.7)
    ax[0].plot(steps[window - 1:], _moving_average(exact, window), color="tab:blue",
               label=f"exact-match rate ({window}-step mean)")  # fmt: skip
    ax[0].plot(steps[window - 1:], _moving_average(reward, window), color="tab:green", linewidth=1,
               label="reward (positional credit)")  # fmt: skip
    ax[0].set_ylim(0, 1.02)
    ax[0].set_ylabel("per step")
    ax[1].plot(steps, [r.get("loss/lr", 0.0) * 1e3 for r in rows], color="tab:purple", label="lr (x1e-3)")
    ax[1].plot(steps, [min(r["grad_norm"], 2.0) for r in rows], color="tab:red", alpha=0.5, linewidth=0.7,
               label="grad norm (capped at 2)")  # fmt: skip
    ax[1].set_xlabel("learner step")
    for a in ax:
        if restart:
            a.axvline(restart["killed_at_step"], color="black", linestyle="--", linewidth=1)
        a.grid(alpha=0.3)
    ax[0].legend(loc="lower right", fontsize=8)
    ax[1].legend(loc="upper right", fontsize=8)
    title = (f"quickstart recipe, {summary['steps']} steps, learner SIGKILLed at step {restart.get('killed_at_step')}:"
             f" best {summary['exact_best']}, final {summary['exact_final']}, "
             f"max fall {summary['max_regression_from_best']}")  # fmt: skip
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
