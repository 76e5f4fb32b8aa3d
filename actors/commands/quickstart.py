"""``async-rl quickstart``: the whole system on one machine, no servers, no arguments.

Starts an embedded Redis-compatible server and a NATS server, one learner and N generators
as separate processes (the same ``async-rl learner`` / ``async-rl generator`` commands a user
runs on a cluster), trains a tiny random-init MoE model on a toy task with a verifiable
reward, shows progress live, and ends with a summary, a reward-curve PNG and (``--json``)
the figures of the run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from async_rl.entry import first_sentence

DEFAULT_LEARNER = [
    "model.name=tiny-moe", "task.name=copy", "batch_groups=32", "sampling.n=8", "torch.lr=5e-4",
    "torch.lr_schedule=cosine", "torch.lr_decay_steps=1000", "torch.lr_min_ratio=0.1", "target_metric=reward/exact",
    "torch.device=cpu", "checkpoint.every=10", "metrics.wandb_mode=auto", "staleness.max_staleness=4",
]  # fmt: skip
"""A 250k-parameter Qwen3-MoE-style model copies a 5-digit string; 32 prompts x 8 samples per step; the run stops on
the exact-match rate (``target_metric``, see HEADLINE). Adam lr 5e-4 decayed by a cosine to 5e-5 over 1,000 steps.
A constant lr keeps taking full-size steps once the task is solved, on the noise of the few groups that still
differ, and the near-deterministic policy does not survive them: in-process (scripts/copy_sim.py, staleness 0-2),
8 of 9 runs at a constant 1e-3 fell by 0.34-1.0 from their best exact-match rate, first after 187-636 steps, both
at 5e-4 after ~1,520, and 7 of 7 runs decayed from 1e-3 to 1e-4 stayed within 0.006 of it. The peak is 5e-4, not
1e-3: with real processes 1e-3 failed 2 of 6 quickstarts within 400 steps (one collapsed at step ~270, one froze
half-solved), 5e-4 reached 0.9 in 4 of 4 in 242-251 steps (docs/quickstart/README.md). S=4 since issue 18: with
exactly S-stale batches (``async-rl bench staleness``, 3 seeds) the default loss ends within 0.011 of S=0's exact-match
rate at S=4 and S=8 and reaches 0.9 in 1.07x S=0's steps (docs/benchmarks/staleness-*.json); two quickstarts at S=4
reached 0.9 in 242 and 243 steps (tokens 3.6 versions stale on average). The S=4 collapse near 0.72 seen before was
at the old constant lr 1e-3."""
GENERATOR_ARGS = ["torch.model.name=tiny-moe", "task.name=copy", "torch.num_threads=1", "torch.max_batch_prompts=16"]
"""Batches of half a learner step per generator keep staleness low (a 64-prompt batch spans two learner steps)."""
HEADLINE = "reward/exact"
"""What the quickstart reports and stops on: the exact-match rate, the share of a step's samples that are exactly
the answer (the learner's ``target_metric``). The reward the policy learns from is positional credit (digits in
the right place, plus one for stopping at the right length), 1.0 only for the exact answer."""


@dataclass
class Progress:
    """What the live view shows, fed by NATS events."""

    step: int = 0
    version: int = 0
    reward: float = 0.0
    exact: float = 0.0
    staleness_max: float = 0.0
    samples_per_s: float = 0.0
    dropped_stale: float = 0.0
    rewards: list[tuple[float, int, float]] = field(default_factory=list)
    """(wall time, step, exact-match rate) of each step."""
    heartbeats: dict[str, Any] = field(default_factory=dict)

    def alive(self, within_s: float) -> list[Any]:
        now = time.time()
        return [h for h in self.heartbeats.values() if now - h.sent_at < within_s and h.state != "stopping"]


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    p.add_argument("--generators", type=int, default=2, help="generator processes (default 2)")
    p.add_argument("--target-reward", type=float, default=0.9, help="stop when the exact-match rate (mean of 5 steps) reaches this")
    p.add_argument("--max-minutes", type=float, default=5.0, help="wall-clock limit")
    p.add_argument("--max-steps", type=int, default=400, help="learner step limit")
    p.add_argument("--run-dir", type=Path, default=None, help="run directory (default runs/quickstart-<time>)")
    p.add_argument("--json", type=Path, default=None, help="write the run's figures as JSON here")
    p.add_argument("--png", type=Path, default=None, help="reward-curve PNG (default <run-dir>/reward.png)")
    p.add_argument("--redis-url", default=None, help="use this Redis instead of an embedded one")
    p.add_argument("--nats-url", default=None, help="use this NATS instead of an embedded one")
    p.add_argument("--learner", action="append", default=[], metavar="KEY=VALUE", help="extra learner override")
    p.add_argument("--generator", action="append", default=[], metavar="KEY=VALUE", help="extra generator override")
    p.add_argument("--quiet", action="store_true", help="no live view (for CI logs)")
    p.add_argument("--print-recipe", action="store_true",
                   help="print the commands that run the same thing as separate processes, then exit")
    p.add_argument("--prefix", default="copy-demo", help="run prefix of the --print-recipe commands")
    args = p.parse_args(argv)
    if args.generators < 1:
        p.error("--generators must be >= 1")
    if not 0 < args.target_reward <= 1:
        p.error("--target-reward must be in (0, 1]")
    if args.max_minutes <= 0:
        p.error("--max-minutes must be > 0")
    return args


def _term_with_parent() -> None:  # runs in the child before exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def spawn_role(cmd: list[str], log_path: Path, threads: int) -> subprocess.Popen:
    """Start one role's process (``cmd``) with ``threads`` BLAS/torch threads, its output into ``log_path``.

    In a process group of its own: a Ctrl-C in the terminal reaches only the command that started it, which stops
    its roles in order (they would otherwise stop at once beside the servers they drain through). It gets SIGTERM
    if that command dies without stopping it (``PR_SET_PDEATHSIG``), so nothing outlives a killed quickstart."""
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), PYTHONUNBUFFERED="1",
               TOKENIZERS_PARALLELISM="false")  # fmt: skip
    with log_path.open("wb") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env,
                                process_group=0, preexec_fn=_term_with_parent)  # fmt: skip


def stop_roles(procs: list[subprocess.Popen], timeout_s: float, force: threading.Event | None = None) -> None:
    """SIGTERM every process still running, then SIGKILL what has not exited within ``timeout_s`` in all, or at once
    when ``force`` is set meanwhile (a second Ctrl-C)."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for p in procs:
        while p.poll() is None and time.monotonic() < deadline and not (force is not None and force.is_set()):
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(0.1)
        if p.poll() is None:
            p.kill()
            p.wait()


def validate_configs(args: argparse.Namespace) -> str | None:
    """Build the learner's and a generator's configs in-process, so a bad override fails before anything starts."""
    from actors.generator.config import GeneratorConfig
    from actors.learner.config import LearnerConfig
    from async_rl.config.configurable import ConfigError, load_config

    urls = ["run.redis_url=redis://127.0.0.1:1/0", "run.nats_url=nats://127.0.0.1:1"]
    try:
        load_config(LearnerConfig, None, [*urls, *DEFAULT_LEARNER, *args.learner])
        load_config(GeneratorConfig, None, [*urls, "generator_id=gen-0", *GENERATOR_ARGS, *args.generator])
    except ConfigError as exc:
        return str(exc)
    return None


def plot_rewards(points: list[tuple[float, int, float]], path: Path, target: float, title: str,
                 shaped: list[tuple[float, int, float]] | None = None) -> None:  # fmt: skip
    """``points``: (wall time, step, exact-match rate); ``shaped``: the same with the reward, drawn thinner."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 2, figsize=(10, 3.6))
    for series, label, width in ((points, "exact-match rate", 1.6), (shaped or [], "reward", 0.8)):
        if series:
            t, steps, values = zip(*series, strict=True)
            ax[0].plot(steps, values, linewidth=width, label=label)
            ax[1].plot(t, values, linewidth=width, label=label)
    for a, xlabel in ((ax[0], "learner step"), (ax[1], "wall time (s)")):
        a.axhline(target, color="gray", linestyle="--", linewidth=1, label=f"target {target}")
        a.set_xlabel(xlabel)
        a.set_ylabel("per step")
        a.set_ylim(0, 1.02)
        a.grid(alpha=0.3)
    ax[0].legend(loc="upper left")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def recipe(args: argparse.Namespace, prefix: str, redis_url: str, nats_url: str,
           run_dir: Path) -> tuple[list[str], list[list[str]]]:  # fmt: skip
    """The ``async-rl`` arguments of the quickstart's learner and of each generator: what it starts, and what
    ``--print-recipe`` prints for running the same thing as separate processes."""
    common = [f"run.prefix={prefix}", f"run.redis_url={redis_url}", f"run.nats_url={nats_url}"]
    learner = ["learner", *common, f"run.run_dir={run_dir}", *DEFAULT_LEARNER, f"max_steps={args.max_steps}",
               f"target_reward={args.target_reward}", *args.learner]  # fmt: skip
    generators = [["generator", *common, f"generator_id=gen-{i}", *GENERATOR_ARGS, *args.generator]
                  for i in range(args.generators)]  # fmt: skip
    return learner, generators


def print_recipe(args: argparse.Namespace) -> None:
    """The quickstart as separate processes on one box: servers, the learner, the generators (shell commands)."""
    import shlex

    redis_url = args.redis_url or "redis://127.0.0.1:6379/0"
    nats_url = args.nats_url or "nats://127.0.0.1:4222"
    prefix = args.prefix
    learner, generators = recipe(args, prefix, redis_url, nats_url, args.run_dir or Path(f"runs/{prefix}"))
    from urllib.parse import urlsplit

    redis_port, nats_port = urlsplit(redis_url).port or 6379, urlsplit(nats_url).port or 4222
    lines = ["# The quickstart as separate processes (one shell each, or append ' &').",
             "# 1. Servers on the ports of the URLs below, unless a Redis and a NATS already run there (generators",
             "#    need both URLs: they join an existing run and never start servers of their own):",
             f"async-rl serve --no-auth --redis-port {redis_port} --nats-port {nats_port}",
             "# 2. The learner (stops itself at the target reward), then 3. the generators (start/stop any time):",
             # one thread: the learner and two generators share the machine's cores (as the quickstart runs them)
             "OMP_NUM_THREADS=1 " + shlex.join(["async-rl", *learner]),
             *(shlex.join(["async-rl", *g]) for g in generators),
             f"# 4. Watch: async-rl status --prefix {prefix} --redis-url {redis_url} --nats-url {nats_url}"]
    print("\n".join(lines))


def main(argv: list[str] | None = None, prog: str = "async-rl quickstart") -> int:
    args = parse_args(argv, prog)
    if args.print_recipe:
        print_recipe(args)
        return 0
    return asyncio.run(_run(args))


STOP_TIMEOUT_S = 15.0
"""How long the roles may take to stop (the learner commits, generators finish or release their batch) before they are
killed; a second Ctrl-C kills them at once."""
COLUMNS = ("step", "version", "exact\nmatch", "reward", "max\nstale", "stale\ndrops", "gens\nalive",
           "learner\nsamples/s", "gens\ntok/s")  # fmt: skip
"""The table's headers: short, on two lines, so that the table fits 80 columns (tests/unit/test_quickstart.py)."""


def plural(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def progress_table(progress: Progress, generators: int, elapsed_s: float) -> Any:
    """The live view, and the table the quickstart ends with: the last step's figures."""
    from rich.table import Table

    alive = progress.alive(within_s=10.0)
    t = Table(title=f"tiny MoE learns to copy 5 digits ({elapsed_s:.0f}s)")
    for col in COLUMNS:
        t.add_column(col, justify="right")
    t.add_row(str(progress.step), str(progress.version), f"{progress.exact:.3f}", f"{progress.reward:.3f}",
              f"{progress.staleness_max:.0f}", f"{progress.dropped_stale:.0f}", f"{len(alive)}/{generators}",
              f"{progress.samples_per_s:.0f}", f"{sum(h.tokens_per_s for h in alive):.0f}")  # fmt: skip
    return t


async def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from async_rl.process.lifecycle import StartupError
    from async_rl.run.names import Names
    from async_rl.servers.control import ControlPlane, Heartbeat, LearnerProgress, Message
    from async_rl.servers.embedded import ensure_servers

    console = Console(stderr=True)
    # Our own handlers, from the start: a shell starts a background job with SIGINT ignored, and Python then installs
    # no KeyboardInterrupt of its own, so a SIGINT to this PID alone went unheard; the roles are in their own process
    # groups (spawn_role) and hear of a Ctrl-C from us.
    interrupted, force = asyncio.Event(), threading.Event()

    def on_signal() -> None:
        if interrupted.is_set():  # a second Ctrl-C while the roles stop: cut their wait short (SIGKILL)
            force.set()
        interrupted.set()

    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)
    error = validate_configs(args)
    if error:
        console.print(f"[bold red]async-rl quickstart: config error:[/] {error}")
        return 2
    stamp = time.strftime("%Y%m%d-%H%M%S")
    run_dir: Path = args.run_dir or Path("runs") / f"quickstart-{stamp}"
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        console.print(f"async-rl quickstart: cannot create the run directory {run_dir}: {exc.strerror or exc} "
                      "(--run-dir picks another)", highlight=False)  # fmt: skip
        return 2
    prefix = f"quickstart-{stamp}-{os.getpid()}"
    names = Names(prefix=prefix)
    t_start = time.time()
    try:
        servers = ensure_servers(args.redis_url, args.nats_url)
    except (StartupError, RuntimeError) as exc:
        console.print(f"async-rl quickstart: {exc}", highlight=False)
        return 1
    console.print(f"[bold]async-rl quickstart[/] run dir {run_dir}  redis {servers.redis_url}  nats {servers.nats_url}")
    cli = [sys.executable, "-m", "actors.commands.cli"]
    learner_args, generator_args = recipe(args, prefix, servers.redis_url, servers.nats_url, run_dir)
    progress = Progress()
    procs: list[subprocess.Popen] = []
    outcome = "time limit"
    plane = None
    try:
        plane = await ControlPlane(servers.nats_url, name="quickstart").connect()

        async def on_event(msg: Message) -> None:
            if isinstance(msg, Heartbeat):
                progress.heartbeats[msg.generator_id] = msg
            elif isinstance(msg, LearnerProgress):
                m = msg.metrics
                progress.step, progress.version = msg.step, msg.version
                progress.reward = m.get("reward", 0.0)
                progress.exact = m.get(HEADLINE, 0.0)
                progress.staleness_max = max(progress.staleness_max, m.get("staleness_group_max", 0.0))
                progress.samples_per_s = m.get("samples", 0.0) / max(m.get("step_s", 1.0), 1e-9)
                progress.dropped_stale = m.get("buffer/dropped_stale", 0.0)
                progress.rewards.append((time.time() - t_start, msg.step, progress.exact))

        await plane.subscribe(names.heartbeat_subject, on_event, kinds=(Heartbeat,))
        await plane.subscribe(names.learner_subject, on_event, kinds=(LearnerProgress,))
        procs.append(spawn_role([*cli, *learner_args], run_dir / "learner.log", threads=1))
        for i, gen_args in enumerate(generator_args):
            procs.append(spawn_role([*cli, *gen_args], run_dir / f"generator-{i}.log", threads=1))
        outcome = await _watch(args, procs, progress, t_start, interrupted, console, Live)
    finally:
        await asyncio.to_thread(stop_roles, procs, STOP_TIMEOUT_S, force)
        if plane is not None:
            await plane.close()
        servers.stop()
    wall_s = time.time() - t_start
    if outcome == "interrupted":
        console.print(f"async-rl quickstart: interrupted after {wall_s:.0f}s at step {progress.step} (exact-match "
                      f"rate {progress.exact:.3f}); the learner, {plural(len(procs) - 1, 'generator')} and the servers "
                      f"stopped; logs in {run_dir}", highlight=False, soft_wrap=True)  # fmt: skip
        return 130
    return report(args, progress, run_dir, t_start, wall_s, outcome)


async def _watch(args: argparse.Namespace, procs: list[subprocess.Popen], progress: Progress, t_start: float,
                 interrupted: asyncio.Event, console: Any, live_cls: Any) -> str:  # fmt: skip
    """Show the live view until the learner ends, every generator left, the time limit or an interrupt; the
    outcome in words."""
    deadline = t_start + args.max_minutes * 60
    learner = procs[0]
    last_print = 0.0
    # Transient: the live view (on stderr) goes away at the end, and the final table is printed to stdout.
    with live_cls(progress_table(progress, args.generators, 0), console=console, refresh_per_second=2,
                  transient=True, auto_refresh=not args.quiet) as live:  # fmt: skip
        while True:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(interrupted.wait(), 0.5)
            if interrupted.is_set():
                return "interrupted"
            table = progress_table(progress, args.generators, time.time() - t_start)
            live.update(table)
            if args.quiet and time.time() - last_print > 15:
                last_print = time.time()
                console.print(table)
            if learner.poll() is not None:
                return "learner finished" if learner.returncode == 0 else f"learner failed ({learner.returncode})"
            if any(p.poll() is not None for p in procs[1:]) and not progress.alive(10.0):
                return "all generators exited"
            if time.time() > deadline:
                return "time limit"


def report(args: argparse.Namespace, progress: Progress, run_dir: Path, t_start: float, wall_s: float,
           outcome: str) -> int:  # fmt: skip
    """The end of a run: the curve (PNG), the table and one line saying whether the target was reached, then the
    figures as JSON on a line of their own (``| tail -1`` gives them), all on stdout; 0 when reached."""
    from rich.console import Console

    from async_rl.metrics.sinks import read_metrics

    history = read_metrics(run_dir)
    rows = [r for r in history if "reward" in r]
    # When each step was taken (its live event); metrics rows are written in batches, at checkpoints.
    seen_at = {step: t for t, step, _ in progress.rewards}
    rows = [{**r, "time": seen_at.get(r["step"], r["time"] - t_start)} for r in rows]
    shaped = [(r["time"], r["step"], r["reward"]) for r in rows]
    if rows:
        progress.rewards = [(r["time"], r["step"], r.get(HEADLINE, 0.0)) for r in rows]
    png = args.png or run_dir / "reward.png"
    plot_rewards(progress.rewards, png, args.target_reward, f"quickstart: {args.generators} generators, tiny MoE, copy",
                 shaped=shaped)  # fmt: skip
    last = [r for _, _, r in progress.rewards[-5:]]
    last_shaped = [r for _, _, r in shaped[-5:]]
    # The learner stops once the mean of the last 5 steps reaches the target: the first step that completes it.
    window = [r for _, _, r in progress.rewards]
    reached = next((i for i in range(4, len(window)) if sum(window[i - 4 : i + 1]) / 5 >= args.target_reward), None)
    summary = {
        "exact_first": progress.rewards[0][2] if progress.rewards else None,
        "exact_last": sum(last) / len(last) if last else None,
        "reward_first": shaped[0][2] if shaped else None,
        "reward_last": sum(last_shaped) / len(last_shaped) if last_shaped else None,
        "headline": f"{HEADLINE}: the exact-match rate, mean of the last 5 steps",
        "steps": progress.rewards[-1][1] if progress.rewards else 0,
        "generators": args.generators,
        "wall_s": round(wall_s, 1),
        "time_to_target_s": round(progress.rewards[reached][0], 1) if reached is not None else None,
        "dropped_stale": int(history[-1].get("buffer/dropped_stale", 0)) if history else 0,
        "max_staleness_seen": int(max((r.get("max_staleness_seen", 0) for r in history), default=0)),
        "target_reward": args.target_reward,
        "target_metric": HEADLINE,
        "outcome": outcome,
        "run_dir": str(run_dir),
        "reward_png": str(png),
    }
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(summary, indent=2))
    ok = summary["exact_last"] is not None and summary["exact_last"] >= args.target_reward
    out = Console(width=80, soft_wrap=False)  # stdout; at most 80 columns wherever it goes
    out.print(progress_table(progress, args.generators, wall_s))
    out.print(f"{'reached' if ok else 'did not reach'} exact-match rate {args.target_reward} in {wall_s:.0f}s "
              f"({outcome}); curve: {png}", highlight=False, soft_wrap=True)  # fmt: skip
    print(json.dumps(summary), flush=True)  # one line, whatever the terminal's width
    return 0 if ok else 1
