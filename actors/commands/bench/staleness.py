"""``async-rl bench staleness``: how well each off-policy method learns from batches exactly S versions old.

Every run is an in-process simulation (:mod:`actors.learner.simulate`): the learner's own code paths, the
quickstart's model, batch and lr schedule (``quickstart.DEFAULT_LEARNER``), and a batch trained at version v
sampled with the weights of version v - S exactly, so timing noise plays no part. The grid is tasks x methods x
S x seeds, one process per run (``--workers`` at a time, one torch thread each). Methods (``METHODS``):

* ``none``: PPO's clip on π_θ/μ against the behaviour logprobs, no correction (naive PPO);
* ``decoupled_tis``: decoupled PPO (clip on π_θ/π_old, π_old recomputed) with token TIS (cap 2);
* ``token_mask``: decoupled PPO with icepop's token mask (ρ outside [0.5, 2] dropped);
* ``seq_mask``: decoupled PPO with the geometric sequence mask (SkyRL's band [0.99, 1.01]);
* ``m2po``: unclipped IS weights π_θ/μ with the M2 mask (second moment of log ρ <= 0.04, M2PO's τ);
* ``default``: this project's default algorithm config.

The measured figure (``METRICS``) is the quickstart's exact-match rate on copy, the shaped reward on sort. Per cell: ``final_reward``
(mean over the last 10 % of steps, averaged over seeds), ``final_reward_seeds``, ``steps_to_0_9`` (first step
where the 5-step mean reaches 0.9, mean over seeds; null unless every seed got there), the shaped reward, the
log-ratio statistics between the learner and the behaviour policy, and a coarse curve. ``--mixed`` runs the
named methods with responses spanning versions v - S and v, with per-token versions (``per_token``) and with
each sequence treated as its oldest version (``oldest``). The JSON is rewritten as each run ends (a cut-short
run keeps what finished); ``--resume`` skips the runs a JSON already holds.
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import multiprocessing
import os
import platform
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from actors.commands.quickstart import DEFAULT_LEARNER

GRID = (0, 1, 2, 4, 8, 16)
"""Staleness values of the full grid (issue 18)."""
METHODS: dict[str, list[str]] = {
    "none": ["algorithm.loss.type=ppo"],
    "decoupled_tis": ["algorithm.loss.type=regular", "algorithm.correction.tis=token"],
    "token_mask": ["algorithm.loss.type=regular", "algorithm.correction.token_mask=true"],
    "seq_mask": ["algorithm.loss.type=regular", "algorithm.correction.sequence_mask=geometric"],
    "m2po": ["algorithm.loss.type=cispo", "algorithm.loss.cispo_eps_clip_high=100", "algorithm.correction.m2_mask=true",
             "algorithm.correction.anchor=current"],
    "default": [],
    "default_m2": ["algorithm.correction.m2_mask=true", "algorithm.correction.anchor=current"],
    "default_tokmask": ["algorithm.correction.token_mask=true", "algorithm.correction.anchor=current"],
}  # fmt: skip
"""Learner overrides of each method (on top of the quickstart's recipe); ``default_*`` are candidate recipes."""
MAIN_METHODS = ("none", "decoupled_tis", "token_mask", "seq_mask", "m2po", "default")
TASKS: dict[str, list[str]] = {"copy": ["task.name=copy"], "sort": ["task.name=sort"]}
"""``copy``: the quickstart's task; ``sort``: the harder one (the answer needs every digit of the prompt counted)."""
METRICS = {"copy": "reward/exact", "sort": "reward"}
"""The figure of each task: copy's is the quickstart's exact-match rate; sort's exact-match rate is still ~0 after
300 steps (positional credit 0.50 at step 150 where copy's exact-match rate is ~0.45), so its shaped reward."""
TARGET = 0.9
WINDOW = 5
"""steps_to_0_9 is the first step at which the mean of the last WINDOW steps reaches TARGET (as the quickstart)."""
CURVE_EVERY = 10
SIM_KEYS = ("model.", "task.", "batch_groups", "sampling.", "torch.")
"""The quickstart's learner overrides that matter in-process (servers, checkpoints and metrics sinks do not)."""


def _parse(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", type=Path, required=True, help="write the results here (rewritten as runs end)")
    p.add_argument("--plot", type=Path, help="final reward against S, one line per method, one panel per task")
    p.add_argument("--tasks", default="copy,sort", help=f"comma-separated, of {', '.join(TASKS)}")
    p.add_argument("--methods", default=",".join(MAIN_METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--staleness", default=",".join(map(str, GRID)), help="comma-separated S values")
    p.add_argument("--seeds", type=int, default=3, help="seeds 0..N-1 per cell")
    p.add_argument("--steps", type=int, default=300, help="learner steps per run")
    p.add_argument("--workers", type=int, default=1, help="runs in parallel (one process and one thread each)")
    p.add_argument("--mixed", default="", help="methods to also run with responses spanning two versions")
    p.add_argument("--mixed-staleness", default="4,8,16", help="S values of the mixed-version runs")
    p.add_argument("--resume", action="store_true", help="keep the runs --json already holds and skip them")
    p.add_argument("--merge", type=Path, nargs="*", default=[], help="also keep (and skip) the runs of these JSONs")
    p.add_argument("--note", default="", help="a free-text note stored in the JSON (how and where it was run)")
    p.add_argument("--max-runs", type=int, default=-1, help="start at most this many new runs (-1: all)")
    p.add_argument("--time-budget-s", type=float, default=0.0, help="start no run after this many seconds (0: none)")
    p.add_argument("overrides", nargs="*", help="extra learner overrides for every run (dotted key=value)")
    args = p.parse_args(argv)
    args.task_list = _names(p, "--tasks", args.tasks, TASKS)
    args.method_list = _names(p, "--methods", args.methods, METHODS)
    args.mixed_list = _names(p, "--mixed", args.mixed, METHODS) if args.mixed else []
    try:
        args.s_list = [int(x) for x in args.staleness.split(",") if x]  # empty: mixed-version runs only
        args.mixed_s_list = [int(x) for x in args.mixed_staleness.split(",") if x]
    except ValueError:
        p.error("--staleness / --mixed-staleness must be comma-separated integers")
    if any(s < 0 for s in args.s_list + args.mixed_s_list):
        p.error("staleness values must be >= 0")
    if args.seeds < 1 or args.steps < WINDOW or args.workers < 1:
        p.error(f"--seeds and --workers must be >= 1, --steps >= {WINDOW}")
    return args


def _names(p: argparse.ArgumentParser, flag: str, value: str, known: dict[str, Any]) -> list[str]:
    names = [x for x in value.split(",") if x]
    bad = [x for x in names if x not in known]
    if bad or not names:
        p.error(f"{flag}: unknown {bad or value!r}; choose from {', '.join(known)}")
    return names


def run_one(job: dict[str, Any]) -> dict[str, Any]:
    """One simulation (in a worker process): the per-step figures the cells are made of."""
    from actors.learner.simulate import SimConfig, Simulation

    seed = job["seed"]
    recipe = [o for o in DEFAULT_LEARNER if o.startswith(SIM_KEYS)]
    overrides = [*recipe, *TASKS[job["task"]], *METHODS[job["method"]], f"torch.seed={seed}", f"model.seed={seed}",
                 f"task.seed={seed}", *job["overrides"]]  # fmt: skip
    t0 = time.monotonic()
    sim = Simulation(SimConfig(staleness=job["S"], mixed=job["mixed"], seed=seed, threads=1, overrides=overrides))
    rows = []
    try:
        for _ in range(job["steps"]):
            rows.append(sim.step())
    finally:
        sim.close()
    metric = [r.get(METRICS[job["task"]], 0.0) for r in rows]
    tail = max(1, len(rows) // 10)
    reached = next((i + 1 for i in range(WINDOW - 1, len(metric)) if sum(metric[i - WINDOW + 1 : i + 1]) / WINDOW
                    >= TARGET), None)  # fmt: skip
    settled = [r for r in rows if r["version"] >= job["S"]]  # past the first S steps, where v - S < 0
    stats = {
        k: _mean([r[k] for r in rows if k in r])
        for k in ("abs_log_ratio_mean", "abs_log_ratio_p99", "log_ratio_sq_mean", "kept_frac", "clip_ratio", "step_s")
    }
    return {**{k: job[k] for k in ("task", "method", "S", "seed", "mixed")},
            "final_reward": _mean(metric[-tail:]), "final_shaped_reward": _mean([r["reward"] for r in rows[-tail:]]),
            "steps_to_0_9": reached, "abs_log_ratio_max": max(r.get("abs_log_ratio_max", 0.0) for r in rows),
            **stats, "lag_exact": all(r["lag"] == job["S"] and r["behaviour_version"] == r["version"] - job["S"]
                                      for r in settled),
            "token_lag_max": max(r["token_lag_max"] for r in rows),
            "curve": [round(_mean(metric[i : i + CURVE_EVERY]), 4) for i in range(0, len(metric), CURVE_EVERY)],
            "wall_s": round(time.monotonic() - t0, 1)}  # fmt: skip


def _mean(xs: list[float]) -> float:
    xs = [float(x) for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else float("nan")


def _finite(x: float) -> float | None:
    """NaN (a statistic no step reported, e.g. ``kept_frac`` with no correction on) as JSON null."""
    return None if x != x else x


def _cell(runs: list[dict[str, Any]]) -> dict[str, Any]:
    runs = sorted(runs, key=lambda r: r["seed"])
    reached = [r["steps_to_0_9"] for r in runs]
    curves = [r["curve"] for r in runs]
    return {
        "final_reward": round(_mean([r["final_reward"] for r in runs]), 4),
        "final_reward_seeds": [round(r["final_reward"], 4) for r in runs],
        "steps_to_0_9": round(_mean(reached), 1) if all(x is not None for x in reached) else None,
        "steps_to_0_9_seeds": reached,
        "final_shaped_reward": round(_mean([r["final_shaped_reward"] for r in runs]), 4),
        **{k: _finite(round(_mean([r[k] for r in runs]), 5)) for k in
           ("abs_log_ratio_mean", "abs_log_ratio_p99", "log_ratio_sq_mean", "kept_frac", "clip_ratio")},
        "abs_log_ratio_max": round(max(r["abs_log_ratio_max"] for r in runs), 4),
        "lag_exact": all(r["lag_exact"] for r in runs), "token_lag_max": max(r["token_lag_max"] for r in runs),
        "seeds": [r["seed"] for r in runs],
        "curve": [round(_mean([c[i] for c in curves if i < len(c)]), 4) for i in range(max(map(len, curves)))],
    }  # fmt: skip


def assemble(
    runs: list[dict[str, Any]], args: argparse.Namespace, wall_s: float, machine: dict[str, Any] | None = None
) -> dict[str, Any]:
    """The JSON: ``results[task][method][S]`` and ``mixed[task][method][treatment][S]`` cells, plus the raw runs."""
    results: dict[str, Any] = {}
    mixed: dict[str, Any] = {}
    keys = sorted({(r["task"], r["method"], r["mixed"], r["S"]) for r in runs}, key=lambda k: (k[0], k[1], k[2], k[3]))
    for task, method, mode, s in keys:
        cell = _cell([r for r in runs if (r["task"], r["method"], r["mixed"], r["S"]) == (task, method, mode, s)])
        if mode == "off":
            results.setdefault(task, {}).setdefault(method, {})[str(s)] = cell
        else:
            mixed.setdefault(task, {}).setdefault(method, {}).setdefault(mode, {})[str(s)] = cell
    return {
        "benchmark": "staleness", "date": datetime.now(UTC).strftime("%Y-%m-%d"), "metric": {t: METRICS[t] for t in args.task_list},
        "target": TARGET, "grid": args.s_list, "mixed_grid": args.mixed_s_list, "tasks": args.task_list,
        "methods": {m: METHODS[m] for m in dict.fromkeys([*args.method_list, *args.mixed_list])},
        "seeds": args.seeds, "steps": args.steps, "recipe": [o for o in DEFAULT_LEARNER if o.startswith(SIM_KEYS)],
        "overrides": args.overrides, "note": args.note, "machine": machine or _machine(args.workers), "wall_s": round(wall_s, 1),
        "runs_wall_s": round(sum(r["wall_s"] for r in runs), 1),
        "results": results, "mixed": mixed, "runs": runs,
    }  # fmt: skip


def _machine(workers: int) -> dict[str, Any]:
    import torch

    cpu = platform.processor()
    try:
        cpu = next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                   if line.startswith("model name"))  # fmt: skip
    except (OSError, StopIteration):
        pass
    return {"cpu": cpu, "cpus": os.cpu_count(), "workers": workers, "threads_per_run": 1, "torch": torch.__version__,
            "python": platform.python_version(), "platform": platform.platform()}  # fmt: skip


def plot(data: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = list(data["results"])
    panels = tasks + [f"{t} (mixed)" for t in data.get("mixed", {})]
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]  # one colour per method, the same in every panel
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.2), squeeze=False)
    for ax, panel in zip(axes[0], panels, strict=True):
        if panel.endswith("(mixed)"):
            task = panel.split(" ")[0]
            lines = {f"{m}/{mode}": cells for m, modes in data["mixed"][task].items() for mode, cells in modes.items()}
        else:
            lines = data["results"][panel]
        for name, cells in lines.items():
            ss = sorted(cells, key=int)
            xs = [GRID.index(int(s)) if int(s) in GRID else int(s) for s in ss]
            ys = [cells[s]["final_reward"] for s in ss]
            lo = [y - min(cells[s]["final_reward_seeds"]) for s, y in zip(ss, ys, strict=True)]
            hi = [max(cells[s]["final_reward_seeds"]) - y for s, y in zip(ss, ys, strict=True)]
            width = 2.4 if name.split("/")[0] in ("default", "none") else 1.3
            color = colors[list(METHODS).index(name.split("/")[0]) % len(colors)]
            style = "--" if name.endswith("/oldest") else "-"
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, linewidth=width, label=name, color=color,
                        linestyle=style)  # fmt: skip
        ax.set_xticks(range(len(GRID)), [str(s) for s in GRID])
        ax.set_xlabel("staleness S (versions)")
        metric = data["metric"][panel.split(" ")[0]]
        ax.set_ylabel(f"final {metric} (last 10% of {data['steps']} steps)")
        ax.set_ylim(-0.02, 1.02)
        ax.axhline(data["target"], color="gray", linestyle="--", linewidth=0.8)
        ax.set_title(f"{panel}: {len(data['runs'])} runs, seeds {data['seeds']}" if panel == panels[0] else panel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _jobs(args: argparse.Namespace) -> list[dict[str, Any]]:
    """Most telling runs first (a cut-short bench keeps them): S=0 and 8, then 4, 16, 2, 1; tasks in order."""
    order = {s: i for i, s in enumerate((0, 8, 4, 16, 2, 1))}
    base = {"steps": args.steps, "overrides": args.overrides}
    jobs = [
        {"task": t, "method": m, "S": s, "seed": seed, "mixed": "off", **base}
        for t in args.task_list
        for s in args.s_list
        for m in args.method_list
        for seed in range(args.seeds)
    ]
    jobs += [{"task": t, "method": m, "S": s, "seed": seed, "mixed": mode, **base} for t in args.task_list
             for s in args.mixed_s_list for m in args.mixed_list for mode in ("per_token", "oldest")
             for seed in range(args.seeds)]  # fmt: skip
    rank = {t: i for i, t in enumerate(args.task_list)}
    return sorted(jobs, key=lambda j: (j["mixed"] != "off", rank[j["task"]], order.get(j["S"], 99), j["seed"]))


def _key(r: dict[str, Any]) -> tuple:
    return (r["task"], r["method"], r["S"], r["seed"], r["mixed"])


def main(argv: list[str] | None = None, prog: str = "async-rl bench staleness") -> int:
    args = _parse(argv, prog)
    t0 = time.monotonic()
    runs: list[dict[str, Any]] = []
    if args.resume and args.json.exists():
        runs = json.loads(args.json.read_text()).get("runs", [])
    machines = []
    for path in args.merge:
        merged = json.loads(path.read_text())
        runs += merged.get("runs", [])
        machines.append(merged.get("machine"))
    # runs merged from elsewhere, none made here: the machine they were made on
    machine = machines[0] if machines and args.max_runs == 0 else None
    done = {_key(r) for r in runs}
    jobs = [j for j in _jobs(args) if _key(j) not in done]
    if args.max_runs >= 0:
        jobs = jobs[: args.max_runs]
    print(f"{len(jobs)} runs of {args.steps} steps on {args.workers} workers ({len(done)} already done)", flush=True)

    errors: list[dict[str, Any]] = []
    jobs_of: dict[cf.Future, dict[str, Any]] = {}

    def save() -> dict[str, Any]:
        data = assemble(runs, args, time.monotonic() - t0, machine)
        data["errors"] = errors
        args.json.parent.mkdir(parents=True, exist_ok=True)
        tmp = args.json.with_suffix(".tmp")
        tmp.write_text(json.dumps(data, indent=1) + "\n")
        tmp.replace(args.json)
        return data

    ctx = multiprocessing.get_context("spawn")  # a fresh interpreter per worker: no forked torch thread pools
    with cf.ProcessPoolExecutor(args.workers, mp_context=ctx, initializer=_init_worker) as pool:
        pending: set[cf.Future] = set()
        queue = list(jobs)
        while queue or pending:
            while queue and len(pending) < args.workers and not _over(args, t0):
                job = queue.pop(0)
                fut = pool.submit(run_one, job)
                jobs_of[fut] = job
                pending.add(fut)
            if not pending:
                break
            finished, pending = cf.wait(pending, return_when=cf.FIRST_COMPLETED)
            for fut in finished:
                job = jobs_of[fut]
                try:
                    r = fut.result()
                except Exception as exc:  # one broken run is recorded and the grid goes on
                    errors.append({**{k: job[k] for k in ("task", "method", "S", "seed", "mixed")}, "error": repr(exc)})
                    print(f"run failed: {errors[-1]}", file=sys.stderr, flush=True)
                    continue
                runs.append(r)
                print(f"[{time.monotonic() - t0:6.0f}s] {r['task']:<5} {r['method']:<14} {r['mixed']:<9} S={r['S']:<2} "
                      f"seed {r['seed']}: final {r['final_reward']:.3f} to0.9 {r['steps_to_0_9']} "
                      f"|lr| {r['abs_log_ratio_mean']:.3f} ({r['wall_s']:.0f}s)", flush=True)  # fmt: skip
            save()
    data = save()
    if args.plot is not None and data["results"]:
        plot(data, args.plot)
    _summary(data)
    return 1 if errors else 0


def _over(args: argparse.Namespace, t0: float) -> bool:
    return args.time_budget_s > 0 and time.monotonic() - t0 > args.time_budget_s


def _init_worker() -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch

    torch.set_num_threads(1)


def _summary(data: dict[str, Any]) -> None:
    for task, methods in data["results"].items():
        print(f"\n{task}: final {data['metric'][task]} / steps to {data['target']} by S")
        grid = sorted({int(s) for cells in methods.values() for s in cells})
        print(f"  {'method':<16}" + "".join(f"{f'S={s}':>14}" for s in grid))
        for method, cells in methods.items():
            row = [cells.get(str(s)) for s in grid]
            print(f"  {method:<16}" + "".join(f"{c['final_reward']:>8.3f} {str(c['steps_to_0_9']):>5}" if c else
                                               f"{'-':>14}" for c in row))  # fmt: skip


if __name__ == "__main__":
    sys.exit(main())
