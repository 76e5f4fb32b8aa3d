"""``async-rl bench async``: asynchronous against synchronous RL, end to end, with real processes.

The quickstart's task, model and recipe, run to an exact-match rate of ``--target`` (mean of 5 steps) once
synchronously and once per staleness bound S, one after the other on the same machine, each with fresh embedded
servers, one learner and ``--generators`` generators (``async-rl bench loop`` runs each):

* ``sync``: ``staleness.sync=true`` with S = 0. Every prompt carries the learner's version and generators sample it
  only with that version: nothing is stale, nothing is thrown away, and nothing overlaps (the generators wait while
  the learner trains and publishes; the learner waits while they generate). The synchronous baseline of the
  papers, on the same processes.
* ``async[S]``: the default recipe with admission bound S (the generators run up to S versions ahead).

JSON: ``sync`` and ``async[S]`` (S as a string key), each with ``wall_to_0_9_s`` (from process start to the step
that completes the 5-step window, or null), ``first_step_s`` (from process start to the learner's first step),
``train_to_0_9_s`` (from the first step to the target: the wall time of training, without the start-up every run
shares), ``steps_to_0_9``, ``learner_tokens_per_s``, ``generator_tokens_per_s``, ``learner_idle_frac`` (time waiting
for rollouts), ``generator_idle_frac`` (time not generating), plus ``best_async_vs_sync`` (the smallest asynchronous
training wall time over the synchronous one; < 1 is faster), ``best_async_vs_sync_from_start`` (the same from process
start) and ``machine``. Each run's full ``bench loop`` summary is kept under ``runs``.

Why the headline leaves the start-up out: it is the same work in every mode (processes start, Megatron and vLLM
build, the first batch is generated) and says nothing of synchronous against asynchronous training; a run of a few
minutes after two minutes of vLLM and Megatron start-up would otherwise measure mostly the start-up. Both are kept.
(The 11-24 JSONs hold the from-start ratio as ``best_async_vs_sync``; their ``runs`` give the other.)

    async-rl bench async --json docs/benchmarks/async-cpu.json                       # this CPU machine
    async-rl bench async --json out.json --device cuda --generators 2                # a GPU machine
    async-rl bench async --json out.json --device cuda --backend megatron --learner-nproc 2 \
        --learner megatron.expert_parallel=2 --generator-engine vllm --generator-devices cuda:2,cuda:3  # one node
"""

from __future__ import annotations

import argparse
import asyncio
import json
from pathlib import Path
from typing import Any

from async_rl.entry import first_sentence

FIELDS = {"wall_to_0_9_s": "wall_to_target_s", "steps_to_0_9": "steps_to_target",
          **{k: k for k in ("learner_tokens_per_s", "generator_tokens_per_s", "learner_idle_frac", "generator_idle_frac",
                            "tokens_by_staleness")}}  # fmt: skip
"""This bench's field -> the ``bench loop`` summary field it is (the target is the 0.9 of the issue's names)."""
OWN_KEYS = ("model.name", "task.name", "torch.device", "metrics.wandb_mode", "staleness.max_staleness", "torch.lr",
            "target_metric", "target_reward", "checkpoint.every", "batch_groups", "sampling.n")  # fmt: skip
"""Learner keys ``bench loop`` (or this bench) sets itself: the quickstart's values for them are not passed on."""


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    p.add_argument("--json", type=Path, required=True)
    p.add_argument("--plot", type=Path, default=None, help="exact-match rate against wall time, one line per run")
    p.add_argument("--plot-only", action="store_true", help="redraw --plot from an existing --json and exit")
    p.add_argument("--staleness", default="2,4,8", help="comma-separated S of the asynchronous runs")
    p.add_argument("--generators", type=int, default=2)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    p.add_argument("--target", type=float, default=0.9, help="exact-match rate to reach (mean of 5 steps)")
    p.add_argument("--max-steps", type=int, default=600, help="per run")
    p.add_argument("--max-minutes", type=float, default=8.0, help="per run")
    p.add_argument("--run-dir", type=Path, default=Path("runs/bench-async"))
    p.add_argument("--learner", action="append", default=[], metavar="KEY=VALUE", help="extra learner override (all runs)")
    p.add_argument("--reuse", type=Path, default=None,
                   help="an earlier JSON of this bench on the same setup: its runs are kept, only the others run "
                        "(a long bench split over several calls)")  # fmt: skip
    node = p.add_argument_group("the node (bench loop's options, the same for every run)")
    node.add_argument("--model", default=None, help="bench loop's --model (default: its own)")
    node.add_argument("--backend", choices=("torch", "megatron"), default="torch")
    node.add_argument("--learner-nproc", type=int, default=1, help="learner ranks (> 1: torchrun, backend megatron)")
    node.add_argument("--generator-engine", choices=("torch", "vllm"), default="torch")
    node.add_argument("--generator-devices", default="", help="comma-separated device of each generator in turn")
    node.add_argument("--generator", action="append", default=[], metavar="KEY=VALUE",
                      help="extra generator override (all runs)")
    args = p.parse_args(argv)
    try:
        args.staleness = sorted({int(s) for s in args.staleness.split(",")})
    except ValueError:
        p.error(f"--staleness must be comma-separated integers, got {args.staleness!r}")
    if not args.staleness or min(args.staleness) < 1:
        p.error("--staleness values must be >= 1 (S = 0 is the synchronous run)")
    if not 0 < args.target <= 1:
        p.error("--target must be in (0, 1]")
    if args.learner_nproc < 1 or (args.learner_nproc > 1 and args.backend != "megatron"):
        p.error("--learner-nproc must be >= 1, and > 1 needs --backend megatron")
    return args


def recipe() -> tuple[str, list[str]]:
    """The quickstart's learning rate and its other recipe keys (schedule, ...), minus those the benches set."""
    from actors.commands.quickstart import DEFAULT_LEARNER

    lr = next(kv.split("=", 1)[1] for kv in DEFAULT_LEARNER if kv.startswith("torch.lr="))
    return lr, [kv for kv in DEFAULT_LEARNER if kv.split("=", 1)[0] not in OWN_KEYS]


def loop_argv(args: argparse.Namespace, name: str, staleness: list[str]) -> list[str]:
    lr, extra = recipe()
    argv = ["--json", str(args.run_dir / f"{name}.json"), "--run-dir", str(args.run_dir / name), "--steps",
            str(args.max_steps), "--target", str(args.target), "--generators", str(args.generators), "--device",
            args.device, "--lr", lr, "--max-minutes", str(args.max_minutes), "--warmup-steps", "3"]  # fmt: skip
    argv += ["--backend", args.backend, "--learner-nproc", str(args.learner_nproc), "--generator-engine",
             args.generator_engine]  # fmt: skip
    if args.model:
        argv += ["--model", args.model]
    if args.generator_devices:
        argv += ["--generator-devices", args.generator_devices]
    for kv in [*extra, *staleness, *args.learner]:
        argv += ["--learner", kv]
    for kv in args.generator:
        argv += ["--generator", kv]
    return argv


def pick(summary: dict[str, Any]) -> dict[str, Any]:
    """This bench's fields of one run's ``bench loop`` summary, the start-up and the training wall time with them."""
    out = {ours: summary.get(theirs) for ours, theirs in FIELDS.items()}
    curve = summary.get("reward_curve") or []
    first = curve[0][1] if curve else None
    wall = out["wall_to_0_9_s"]
    out["first_step_s"] = first
    out["train_to_0_9_s"] = round(wall - first, 2) if wall is not None and first is not None else None
    return out


def best_ratio(sync: dict[str, Any], asyncs: dict[str, dict[str, Any]], field: str) -> float | None:
    """The smallest asynchronous ``field`` over the synchronous one (None when a side never reached the target)."""
    walls = [a[field] for a in asyncs.values() if a[field] is not None]
    return min(walls) / sync[field] if walls and sync[field] else None


def ratios(sync: dict[str, Any] | None, asyncs: dict[str, dict[str, Any]]) -> dict[str, float | None]:
    """``best_async_vs_sync`` (training wall time) and ``best_async_vs_sync_from_start`` of picked runs (:func:`pick`);
    both None without a synchronous run."""
    return {f"best_async_vs_sync{tail}": best_ratio(sync, asyncs, field) if sync is not None else None
            for tail, field in (("", "train_to_0_9_s"), ("_from_start", "wall_to_0_9_s"))}  # fmt: skip


def main(argv: list[str] | None = None, prog: str = "async-rl bench async") -> int:
    from actors.commands.bench import loop
    from actors.commands.bench.report import emit

    args = parse_args(argv, prog)
    if args.plot_only:
        if args.plot is None:
            raise SystemExit(f"{prog}: --plot-only needs --plot")
        plot(json.loads(args.json.read_text()), args.plot)
        return 0
    runs: dict[str, dict[str, Any]] = reused(args, prog) if args.reuse else {}
    plans = [("sync", ["staleness.max_staleness=0", "staleness.sync=true", "admission_lag_versions=0"])]
    plans += [(f"async-{s}", [f"staleness.max_staleness={s}"]) for s in args.staleness]
    runs = {name: runs[name] for name, _ in plans if name in runs}
    for name, staleness in plans:
        if name in runs:
            print(f"== {name}: kept from {args.reuse}", flush=True)
            continue
        largs = loop.parse_args(loop_argv(args, name, staleness), prog=f"{prog} ({name})")
        print(f"== {name}: {' '.join(staleness)}", flush=True)
        r = asyncio.run(loop.run_loop(largs))
        if r["outcome"] != loop.INTERRUPTED:  # an interrupted run is not kept: a later --reuse runs it again
            runs[name] = r
            print(f"   wall to {args.target}: {r.get('wall_to_target_s')} s from start, {pick(r)['train_to_0_9_s']} s "
                  f"from the first step, in {r.get('steps_to_target')} steps; idle learner {r.get('learner_idle_frac')} "
                  f"generators {r.get('generator_idle_frac')}; tracebacks {len(r['tracebacks'])}", flush=True)  # fmt: skip
        if runs:
            write_partial(args, runs)
        if r.get("signalled"):  # SIGTERM/SIGINT during the run or as it ended: no other run starts
            print(f"   {name}: {r['outcome']}, then stopped by a signal; the runs done are in {args.json}", flush=True)
            return 1
    out = summary(args, runs)
    emit(out, args.json, print_skip=("runs",))
    if args.plot:
        plot(out, args.plot)
    best = out["best_async_vs_sync"]
    return 0 if best is not None and not any(r["tracebacks"] for r in runs.values()) else 1


def summary(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """The bench's JSON from the runs done so far (a run not done yet is missing, and the ratios it needs null)."""
    sync = pick(runs["sync"]) if "sync" in runs else None
    asyncs = {str(s): pick(runs[f"async-{s}"]) for s in args.staleness if f"async-{s}" in runs}
    mine = setup(args)
    first = next(iter(runs.values()))
    return {"bench": "async", "machine": first["machine"], **mine, "model": first.get("model"), "setup": mine,
            "recipe": recipe()[1], "sync": sync, "async": asyncs, **ratios(sync, asyncs), "runs": runs}  # fmt: skip


def write_partial(args: argparse.Namespace, runs: dict[str, dict[str, Any]]) -> None:
    """The JSON after each run, for ``--reuse``: a call cut short (a device's time limit) keeps the runs it finished."""
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(summary(args, runs), indent=2) + "\n")


SETUP = ("device", "generators", "model", "backend", "learner_nproc", "generator_engine", "generator_devices", "target")
"""What an earlier JSON's runs must share with this call to be kept (``--reuse``)."""


def setup(args: argparse.Namespace) -> dict[str, Any]:
    return {"device": args.device, "generators": args.generators, "model": args.model, "backend": args.backend,
            "learner_nproc": args.learner_nproc, "generator_engine": args.generator_engine,
            "generator_devices": args.generator_devices or args.device, "target": args.target}  # fmt: skip


def reused(args: argparse.Namespace, prog: str) -> dict[str, dict[str, Any]]:
    """The runs of ``--reuse``'s JSON, refused in one line when it was measured on another setup."""
    try:
        data = json.loads(args.reuse.read_text())
    except (OSError, ValueError) as exc:
        raise SystemExit(f"{prog}: --reuse {args.reuse}: {exc}") from None
    mine, theirs = setup(args), data.get("setup") or {}
    differ = [k for k in SETUP if theirs.get(k) != mine[k]]
    if data.get("bench") != "async" or differ:
        what = ", ".join(f"{k} {theirs.get(k)!r} there, {mine[k]!r} here" for k in differ) or "not a bench async JSON"
        raise SystemExit(f"{prog}: --reuse {args.reuse} was measured on another setup ({what})")
    return dict(data.get("runs") or {})


def plot(data: dict[str, Any], path: Path) -> None:
    """Exact-match rate (5-step mean) against wall time from the learner's first step, one line per run, the target
    dashed; each run's start-up (process start to that step) in its label."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    for name, run in data["runs"].items():
        curve = run.get("reward_curve") or []
        if not curve:
            continue
        t = [row[1] - curve[0][1] for row in curve]
        exact = [row[3] for row in curve]
        smooth = [sum(exact[max(0, i - 4) : i + 1]) / len(exact[max(0, i - 4) : i + 1]) for i in range(len(exact))]
        mine = pick(run)
        train = mine["train_to_0_9_s"]
        label = f"{name}: {train:.0f} s" if train is not None else f"{name}: not reached"
        label += f" (start-up {mine['first_step_s']:.0f} s)"
        ax.plot(t, smooth, lw=2.2 if name == "sync" else 1.5, ls="--" if name == "sync" else "-", label=label)
    ax.axhline(data["target"], color="grey", lw=0.8, ls=":")
    ax.set_xlabel("wall time from the learner's first step (s)")
    ax.set_ylabel("exact-match rate (5-step mean)")
    runs = {name: pick(run) for name, run in data["runs"].items()}  # from the runs: an 11-24 JSON's ratio is the other
    both = ratios(runs.get("sync"), {name: run for name, run in runs.items() if name != "sync"})
    best, start = both["best_async_vs_sync"], both["best_async_vs_sync_from_start"]
    ratio = f"best async / sync = {best:.2f}" if best is not None else "no async run reached the target"
    ratio += f" ({start:.2f} from process start)" if start is not None else ""
    ax.set_title(f"sync vs async to {data['target']}: {data['machine']}\n{ratio}", fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
