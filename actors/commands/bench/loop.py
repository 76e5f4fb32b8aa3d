"""``async-rl bench loop``: the whole loop with real processes, N steps, one summary JSON.

Embedded Valkey and NATS servers, one learner (``--learner-nproc`` > 1 runs it under torchrun: Megatron
TP/PP/EP over the ranks), N torch-engine generators, the copy task; it stops after ``--steps`` learner
steps or ``--max-minutes``. What it measures comes from the processes themselves: every learner step's
metrics (the ``LearnerProgress`` events on NATS, one per step, all scalar metrics), every generator
heartbeat (weight fetch time, swap pause, tokens/s), and the logs, which stay in the run directory. SIGTERM or
SIGINT (a device call's time limit, Ctrl-C) stops the run: its roles stop, and the summary of what it measured until
then is written, ``outcome`` saying so (exit status 1); ``signalled`` is true when a signal came at any time, also
while the roles were stopping after the run had ended on its own.

    async-rl bench loop --json out.json                                  # CPU: the quickstart's model
    async-rl bench loop --json out.json --model moe-107m --device cuda --backend megatron --steps 40

Summary fields: ``steps``, ``wall_s``, ``steps_per_s`` (after ``--warmup-steps``), ``step_interval_s`` and
``train_s`` (medians), ``publish_block_s`` / ``publish_block_frac`` (the loop's wait on publishing, when the
learner reports it; else ``non_train_frac``: the share of each step interval not spent training),
``learner_tokens_per_s``, ``generator_tokens_per_s``, ``routes_replayed_frac`` (the least share of a step's
samples trained with their recorded expert routes replayed), ``generator_fetch_s``, ``swap_pause_ms`` (median over swaps),
``version_to_applied_s`` (seconds from the learner's snapshot of a version to a generator's swap to it: p50, p95,
per generator; ``version_to_staged_s`` likewise to its hand-over to the engine, and ``standby_load_s`` and
``swap_wait_s`` for the rest: the engine's copy into its standby weights, then the wait for a step boundary),
``gpu_publish_latency_s`` (snapshot to visible in GPU buffers), ``publish_latency_s``, ``delta_bytes_ratio`` and
``host_encode_s`` (the host transport's versions: snapshot to visible, bytes sent / full, encoding and checksums, on
the GPU or the CPU), ``learner_idle_frac`` (time waiting
for rollouts), ``generator_idle_frac`` (time not generating, from the
heartbeats' ``generate_s``), ``generator_loop_lag_ms`` (p50 and max over the heartbeats of each one's largest
event-loop lateness since the previous: every RPC reply and swap of a generator waits that much more); the
generators' rates, idle share and lateness are of the heartbeats between the first steady step and the last (after
it the learner saves its checkpoint, a minute of moe-5b, and generators with no prompts left counted as idle),
``reward_curve`` ([step, seconds, reward, exact match]), ``tokens_by_staleness``,
``peak_memory_gib`` (the learner's, GPU), ``learner_tokens_per_s_per_gpu`` and ``generator_tokens_per_s_per_gpu``
(each side's tokens/s over its GPUs: the learner's ranks, the generators' distinct devices; on CUDA),
``generator_gpus_per_learner_gpu`` (the split those rates and idle fractions point to: :func:`split`),
``tracebacks`` (lines in any process log; a clean run has none), ``exit_lines`` (each role's one line on why it
stopped, where it said one: a learner that exits 1 without a traceback names its cause there); with
``--target``, ``wall_to_target_s`` and ``steps_to_target``.

``moe-107m`` is the GPU benchmark model of the publishing and Megatron issues (a preset: every process builds
the same seeded weights): Qwen3-MoE, 8 layers, hidden 512, 32 experts top-4, 107M parameters, 214 MB in bf16.
``moe-1.6b`` is the weight path's: 16 layers, hidden 1024, 64 experts top-8, 1.65B parameters, 3.3 GB in bf16
(``--generator-devices cuda:0,cuda:1`` puts one generator beside the learner and one on the second GPU).
``moe-5b`` is the node's (``scripts/gpu/node.sh``): 24 layers, hidden 2048, 64 experts top-8, 5.06B parameters, 10.1 GB
in bf16; its training state does not fit one GPU, so its learner runs with ``--learner-nproc 2`` (EP=2) on GPUs 0-1
and its vLLM generators on the others (``--generator-devices cuda:2,cuda:3``). Learner rank r runs on GPU r.
``--generator-engine vllm`` runs vLLM generators instead (each sees only its GPU); the summary names the engine
(``generator_engine``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import signal
import statistics
import sys
import time
from pathlib import Path
from typing import Any

from async_rl.entry import first_sentence

MODELS = ("tiny-moe", "small-moe", "moe-107m", "moe-1.6b", "moe-5b")
"""Presets (``async_rl/model/presets.py``); any other value: a model directory."""
LEARNER_DEFAULTS = ["task.name=copy", "batch_groups=32", "sampling.n=8", "checkpoint.every=10",
                    "metrics.wandb_mode=disabled", "staleness.max_staleness=2"]  # fmt: skip
"""The quickstart's batch (32 prompts x 8 samples) and staleness bound; wandb off (a benchmark, not a run)."""
TARGET_METRIC = "reward/exact"
TARGET_WINDOW = 5
"""``--target`` is reached when the mean of the exact-match rate over this many steps reaches it (as the learner's
early stop and the quickstart count it)."""


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    p.add_argument("--json", type=Path, required=True, help="write the summary here")
    p.add_argument("--steps", type=int, default=30, help="learner steps (default 30)")
    p.add_argument("--warmup-steps", type=int, default=3, help="steps left out of the rates (start-up, compilation)")
    p.add_argument("--generators", type=int, default=2)
    p.add_argument("--learner-nproc", type=int, default=1, help="learner ranks (> 1: torchrun, backend megatron)")
    p.add_argument("--backend", choices=("torch", "megatron"), default="torch")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="learner and generators")
    p.add_argument("--model", default="tiny-moe", help=f"one of {', '.join(MODELS)}, or a model directory")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--target", type=float, default=0.0,
                   help="stop once reward/exact (mean of 5 steps) reaches this; reports wall_to_target_s (0: off)")
    p.add_argument("--max-minutes", type=float, default=9.0, help="wall-clock limit")
    p.add_argument("--run-dir", type=Path, default=None,
                   help="a new directory (one holding a run is refused: a benchmark starts fresh); default runs/bench-loop-<time>")
    p.add_argument("--learner", action="append", default=[], metavar="KEY=VALUE", help="extra learner override")
    p.add_argument("--generator", action="append", default=[], metavar="KEY=VALUE", help="extra generator override")
    p.add_argument("--generator-engine", choices=("torch", "vllm"), default="torch",
                   help="the generators' engine (vllm: GPU only; each on the GPU --generator-devices gives it)")
    p.add_argument("--generator-devices", default="",
                   help="comma-separated torch.device of each generator in turn (e.g. cuda:0,cuda:1); default --device")
    args = p.parse_args(argv)
    if args.generator_engine == "vllm" and args.device != "cuda":
        p.error("--generator-engine vllm needs --device cuda (vLLM's CPU build is for tests, not benchmarks)")
    if args.steps < 1 or args.generators < 1 or args.learner_nproc < 1:
        p.error("--steps, --generators and --learner-nproc must be >= 1")
    if args.learner_nproc > 1 and args.backend != "megatron":
        p.error("--learner-nproc > 1 needs --backend megatron")
    if args.model not in MODELS and not Path(args.model, "config.json").is_file():
        p.error(f"--model must be one of {', '.join(MODELS)} or a model directory with a config.json: {args.model!r}")
    if args.generator_engine == "vllm":
        wrong = [d for d in generator_devices(args) if not (d == "cuda" or d.startswith("cuda:") and d[5:].isdigit())]
        if wrong:
            p.error(f"--generator-devices: each a cuda:N for vLLM generators, got {wrong[0]!r}")
        num_gpus = _cuda_device_count()
        beyond = [d for d in generator_devices(args) if d.startswith("cuda:") and int(d[5:]) >= num_gpus]
        if beyond:
            p.error(f"--generator-devices names {beyond[0]}, but {num_gpus} GPUs are visible")
    return args


def commands(args: argparse.Namespace, model: str, prefix: str, redis_url: str, nats_url: str,
             run_dir: Path) -> tuple[list[str], list[list[str]]]:  # fmt: skip
    """The learner's and each generator's command lines (``python -m actors.commands``: no console script)."""
    common = [f"run.prefix={prefix}", f"run.redis_url={redis_url}", f"run.nats_url={nats_url}"]
    learner = [*common, f"run.run_dir={run_dir}", *LEARNER_DEFAULTS, f"model.name={model}", f"backend={args.backend}",
               f"max_steps={args.steps}"]  # fmt: skip
    if args.target:
        learner += [f"target_reward={args.target}", f"target_metric={TARGET_METRIC}", f"target_window={TARGET_WINDOW}"]
    if args.backend == "torch":
        learner += [f"torch.device={args.device}", f"torch.lr={args.lr}",
                    f"torch.dtype={'bfloat16' if args.device == 'cuda' else 'float32'}"]  # fmt: skip
    else:
        learner += [f"megatron.lr={args.lr}"]
    learner += args.learner
    if args.learner_nproc > 1:
        launcher = [shutil.which("torchrun") or "torchrun", "--standalone", "--nproc-per-node", str(args.learner_nproc)]
        learner_cmd = [*launcher, "-m", "actors.commands", "learner", *learner]
    else:
        learner_cmd = [sys.executable, "-m", "actors.commands", "learner", *learner]
    gens = []
    num_gpus = _cuda_device_count() if args.generator_engine == "vllm" else 0
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    for i, device in enumerate(generator_devices(args)):
        launch = [sys.executable, "-m", "actors.commands", "generator"]
        if args.generator_engine == "vllm":
            g = [*common, f"generator_id=gen-{i}", "task.name=copy", "engine=vllm", f"vllm.model.name={model}",
                 "vllm.model.dtype=bfloat16", *args.generator]  # fmt: skip
            if device.startswith("cuda:"):  # vLLM runs on the first visible GPU; the others stay visible for IPC
                launch = ["env", f"CUDA_VISIBLE_DEVICES={gpu_first(int(device[5:]), num_gpus, visible)}", *launch]
            gens.append([*launch, *g])
            continue
        g = [*common, f"generator_id=gen-{i}", "task.name=copy", f"torch.model.name={model}",
             f"torch.device={device}", *args.generator]  # fmt: skip
        if args.device == "cpu":
            g.append("torch.num_threads=1")
        gens.append([*launch, *g])
    return learner_cmd, gens


def generator_devices(args: argparse.Namespace) -> list[str]:
    """Each generator's device in turn: ``--generator-devices`` round-robin, else ``--device``."""
    devices = [d for d in args.generator_devices.split(",") if d] or [args.device]
    return [devices[i % len(devices)] for i in range(args.generators)]


def gpu_first(index: int, num_gpus: int, visible: str | None = None) -> str:
    """``CUDA_VISIBLE_DEVICES`` with GPU ``index`` first and every other of ``num_gpus`` after it (so a vLLM generator
    runs on ``index`` and can still map the learner's weight buffers on the others over CUDA IPC: learner rank r
    is on GPU r, ``torchrun`` giving each rank its ``LOCAL_RANK`` with every GPU visible). ``visible``: this
    process's own ``CUDA_VISIBLE_DEVICES``, when set: ``index`` counts in it, as torch and the learner's ranks do."""
    ids = [v.strip() for v in visible.split(",") if v.strip()][:num_gpus] if visible else []
    ids = ids or [str(i) for i in range(num_gpus)]
    return ",".join([ids[index], *(d for j, d in enumerate(ids) if j != index)])


def _cuda_device_count() -> int:
    import torch

    return torch.cuda.device_count()


def per_gpu_rates(summary: dict[str, Any], args: argparse.Namespace) -> dict[str, float | None]:
    """Each side's tokens/s per GPU: the learner's over its ranks (one GPU each), the generators' over the distinct
    GPUs they run on (a generator with ``vllm.tensor_parallel_size=N`` counts N); None on the CPU."""
    if args.device != "cuda":
        return {"learner_tokens_per_s_per_gpu": None, "generator_tokens_per_s_per_gpu": None}
    tp = next((int(o.split("=", 1)[1]) for o in reversed(args.generator)
               if o.startswith("vllm.tensor_parallel_size=")), 1)  # fmt: skip
    num_generator_gpus = len(set(generator_devices(args))) * tp
    learner, generator = summary.get("learner_tokens_per_s"), summary.get("generator_tokens_per_s")
    return {"learner_tokens_per_s_per_gpu": learner / args.learner_nproc if learner is not None else None,
            "generator_tokens_per_s_per_gpu": generator / num_generator_gpus if generator is not None else None}  # fmt: skip


def split(summary: dict[str, Any]) -> float | None:
    """Generator GPUs one learner GPU keeps busy: each side's busy rate a GPU (its tokens/s over the share of the time
    it was not idle), the learner's over the generators' (docs/gpus.md, "the split"). The learner counts whole
    sequences and the generators their responses: with long prompts, scale it by the responses' share. None without
    both sides' rates, or where a side was idle all along."""
    learner, generator = summary.get("learner_tokens_per_s_per_gpu"), summary.get("generator_tokens_per_s_per_gpu")
    learner_idle, generator_idle = summary.get("learner_idle_frac"), summary.get("generator_idle_frac")
    if not learner or not generator or learner_idle is None or generator_idle is None:
        return None
    if learner_idle >= 1.0 or generator_idle >= 1.0:
        return None
    return (learner / (1.0 - learner_idle)) / (generator / (1.0 - generator_idle))


def summarize(events: list[tuple[float, int, dict[str, float]]], beats: list[Any], warmup: int, t0: float,
              target: float = 0.0) -> dict[str, Any]:  # fmt: skip
    """The summary fields (module docstring) from the learner's step events and the generators' heartbeats;
    ``t0``: when the processes were started (``wall_to_target_s`` counts from there)."""
    events = sorted(events, key=lambda e: e[1])
    steady = [e for e in events if e[1] > warmup]
    med = statistics.median

    def col(key: str, rows: list[tuple[float, int, dict[str, float]]] = steady) -> list[float]:
        return [m[key] for _, _, m in rows if key in m]

    out: dict[str, Any] = {"steps": events[-1][1] if events else 0}
    if len(steady) >= 2:
        span = steady[-1][0] - steady[0][0]
        intervals = [b[0] - a[0] for a, b in zip(steady, steady[1:], strict=False)]
        out["steps_per_s"] = (len(steady) - 1) / span if span > 0 else None
        out["step_interval_s"] = med(intervals)
    train = col("train_s")
    out["train_s"] = med(train) if train else None
    block = col("weights/publish_block_s")
    interval = out.get("step_interval_s")
    if block:
        out["publish_block_s"] = med(block)
        out["publish_block_frac"] = med(block) / interval if interval else None
    for key, name in (("weights/delta_ratio", "delta_bytes_ratio"), ("weights/publish_latency_s", "publish_latency_s"),
                      ("weights/gpu_publish_latency_s", "gpu_publish_latency_s"), ("weights/gpu_wait_s", "gpu_wait_s"),
                      ("weights/gpu_commit_s", "gpu_commit_s"), ("weights/encode_s", "host_encode_s")):
        out[name] = med(col(key)) if col(key) else None
    skipped = col("weights/versions_skipped", events)
    out["versions_skipped"] = int(max(skipped)) if skipped else None
    if interval and train:
        out["non_train_frac"] = max(0.0, 1.0 - med(train) / interval)
    tokens = col("tokens")
    if len(steady) >= 2 and tokens:
        span = steady[-1][0] - steady[0][0]
        out["learner_tokens_per_s"] = sum(tokens[1:]) / span if span > 0 else None
    out["learner_train_tokens_per_s"] = med(col("tokens_per_s")) if col("tokens_per_s") else None
    routed = col("routes_replayed_frac")
    out["routes_replayed_frac"] = min(routed) if routed else None
    for key in ("loss/mem_peak_gib",):
        vals = col(key, events)
        out["peak_memory_gib"] = max(vals) if vals else None
    out["reward_curve"] = [[s, round(t - t0, 2), round(m.get("reward", 0.0), 4), round(m.get(TARGET_METRIC, 0.0), 4)]
                           for t, s, m in events]  # fmt: skip
    if target:
        exact = [m.get(TARGET_METRIC, 0.0) for _, _, m in events]
        hit = next((i for i in range(TARGET_WINDOW - 1, len(exact))
                    if statistics.fmean(exact[i - TARGET_WINDOW + 1 : i + 1]) >= target), None)  # fmt: skip
        out["wall_to_target_s"] = round(events[hit][0] - t0, 2) if hit is not None else None
        out["steps_to_target"] = events[hit][1] if hit is not None else None
    if len(steady) >= 2 and col("learner/wait_s"):
        span = steady[-1][0] - steady[0][0]
        out["learner_idle_frac"] = min(1.0, sum(col("learner/wait_s")[1:]) / span) if span > 0 else None
    busy = []
    start, end = (steady[0][0], steady[-1][0]) if steady else (None, None)
    during = [b for b in beats if start is None or start <= b.sent_at <= end]  # type: ignore[operator]
    for gen in sorted({b.generator_id for b in during}):
        mine = [b for b in during if b.generator_id == gen]
        if len(mine) >= 2 and mine[-1].sent_at > mine[0].sent_at:
            busy.append((mine[-1].generate_s - mine[0].generate_s) / (mine[-1].sent_at - mine[0].sent_at))
    out["generator_idle_frac"] = 1.0 - min(1.0, statistics.fmean(busy)) if busy else None
    hist: dict[str, float] = {}
    for _, _, m in events:
        for k, v in m.items():
            if k.startswith("loss/staleness_hist_") and k.endswith("_count"):
                label = k.removeprefix("loss/staleness_hist_").removesuffix("_count")
                hist[label] = hist.get(label, 0.0) + v
    out["tokens_by_staleness"] = {k: int(v) for k, v in sorted(hist.items(), key=lambda kv: (len(kv[0]), kv[0]))}
    live = [b for b in beats if b.version >= 0]
    fetch = [b.fetch_s for b in live if b.fetch_s > 0]
    pause = [p for b in live for p in b.swap_pauses_ms]  # every swap's, where the engine reports each
    pause = pause or [b.swap_pause_ms for b in live if b.swap_pause_ms > 0]  # else the last one at each beat
    out["generator_fetch_s"] = med(fetch) if fetch else None
    out["swap_pause_ms"] = med(pause) if pause else None
    latest = {b.generator_id: b for b in live}
    steady_beats = [b for b in beats if start is None or b.sent_at >= start]
    out["generator_tokens_per_s"] = generator_rate([b for b in during if b.version >= 0] or live)
    out["version_to_applied_s"] = version_to_applied(steady_beats)
    out["version_to_staged_s"] = _latencies(steady_beats, "staged_latency_s")
    out["standby_load_s"] = _latencies(steady_beats, "standby_load_s")
    out["swap_wait_s"] = _latencies(steady_beats, "swap_wait_s")
    lags = [b.loop_lag_ms for b in during if b.version >= 0]
    out["generator_loop_lag_ms"] = {"p50": _quantile(lags, 0.5), "max": max(lags)} if lags else None
    out["generators_seen"] = sorted(latest)
    return out


def generator_rate(beats: list[Any]) -> float | None:
    """The generators' tokens/s together: each one's mean over its heartbeats, the beats with no tokens included.
    A beat's rate covers the interval since the one before, and tokens arrive a batch at a time: the median of the
    beats that saw some (as before) counted only the intervals a batch ended in: 1.4-2.5x the tokens vLLM logged on
    four H100s."""
    per: dict[str, list[float]] = {}
    for b in beats:
        per.setdefault(b.generator_id, []).append(b.tokens_per_s)
    rates = [statistics.fmean(r) for r in per.values()]
    return sum(rates) if rates and any(rates) else None


def _quantile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def version_to_applied(beats: list[Any]) -> dict[str, Any] | None:
    """Seconds from the learner's snapshot of a version to a generator's swap to it (the heartbeats' per-version
    ``applied_latency_s``): p50 and p95 over all generators, and per generator."""
    return _latencies(beats, "applied_latency_s")


def _latencies(beats: list[Any], field: str) -> dict[str, Any] | None:
    per: dict[str, list[float]] = {}
    for b in beats:
        per.setdefault(b.generator_id, []).extend(getattr(b, field, []))
    every = [x for xs in per.values() for x in xs]
    if not every:
        return None

    def stats(xs: list[float]) -> dict[str, float]:
        return {"p50": round(_quantile(xs, 0.5), 4), "p95": round(_quantile(xs, 0.95), 4), "n": len(xs)}

    return {**stats(every), "per_generator": {g: stats(xs) for g, xs in sorted(per.items()) if xs}}


def tracebacks(run_dir: Path) -> list[str]:
    """First line of each traceback in the run's process logs."""
    found = []
    for log_path in sorted(run_dir.glob("*.log")):
        lines = log_path.read_text(errors="replace").splitlines()
        found += [f"{log_path.name}: {lines[i + 1].strip() if i + 1 < len(lines) else ''}"
                  for i, line in enumerate(lines) if line.startswith("Traceback")]  # fmt: skip
    return found


def exit_lines(run_dir: Path) -> list[str]:
    """The lines in which a role told its supervisor why it stopped (``async-rl learner: ...; exiting``: a role that
    fails on purpose says so in one line, with no traceback), from each process log."""
    found = []
    for log_path in sorted(run_dir.glob("*.log")):
        found += [f"{log_path.name}: {line}" for line in log_path.read_text(errors="replace").splitlines()
                  if EXIT_LINE.match(line)]  # fmt: skip
    return found


EXIT_LINE = re.compile(r"^(\[rank\d+\]:)?async-rl [\w-]+: ")


def held_run(run_dir: Path | None) -> str | None:
    """The refusal of a ``--run-dir`` that holds a run already (its learner would resume it, and a finished one
    trains 0 steps): a benchmark measures a fresh run."""
    pointer = None if run_dir is None else run_dir / "checkpoints" / "latest"
    if pointer is None or not pointer.is_file():
        return None
    return (f"--run-dir {run_dir} holds a run already (checkpoint {pointer.read_text().strip()}); a benchmark starts "
            "fresh: give a new --run-dir, or leave it out for runs/bench-loop-<time>")


def main(argv: list[str] | None = None, prog: str = "async-rl bench loop") -> int:
    from actors.commands.bench.report import emit

    args = parse_args(argv, prog)
    held = held_run(args.run_dir)
    if held:
        print(f"{prog}: {held}", file=sys.stderr)
        return 2
    summary = asyncio.run(run_loop(args))
    emit(summary, args.json, print_skip=("reward_curve",))
    done = summary["steps"] >= args.steps or (args.target and summary.get("wall_to_target_s") is not None)
    return 0 if done and not summary["tracebacks"] else 1


STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
INTERRUPTED = "interrupted (SIGTERM or SIGINT)"
"""The outcome of a run stopped by a signal: its roles were stopped (nothing outlives it) and its summary holds what
it measured until then."""


async def run_loop(args: argparse.Namespace) -> dict[str, Any]:
    """Run the loop ``args`` (of :func:`parse_args`) describes; returns its summary."""
    from actors.commands.bench.report import machine
    from actors.commands.quickstart import spawn_role, stop_roles
    from async_rl.run.names import Names
    from async_rl.servers.control import ControlPlane, Heartbeat, LearnerProgress, Message
    from async_rl.servers.embedded import ensure_servers

    run_dir: Path = args.run_dir or Path("runs") / f"bench-loop-{time.strftime('%Y%m%d-%H%M%S')}"
    run_dir.mkdir(parents=True, exist_ok=True)
    model = args.model
    prefix = f"bench-loop-{os.getpid()}"
    names = Names(prefix=prefix)
    servers = ensure_servers(None, None)
    learner_cmd, gen_cmds = commands(args, model, prefix, servers.redis_url, servers.nats_url, run_dir)
    (run_dir / "commands.json").write_text(json.dumps({"learner": learner_cmd, "generators": gen_cmds}, indent=1))
    events: list[tuple[float, int, dict[str, float]]] = []
    beats: list[Any] = []

    async def on_event(msg: Message) -> None:
        if isinstance(msg, Heartbeat):
            beats.append(msg)
        elif isinstance(msg, LearnerProgress):
            events.append((time.time(), msg.step, dict(msg.metrics)))

    plane = await ControlPlane(servers.nats_url, name="bench-loop").connect()
    await plane.subscribe(names.heartbeat_subject, on_event, kinds=(Heartbeat,))
    await plane.subscribe(names.learner_subject, on_event, kinds=(LearnerProgress,))
    threads = 1 if args.device == "cpu" else 4
    t0 = time.time()
    procs = [spawn_role(learner_cmd, run_dir / "learner.log", threads=threads)]
    procs += [spawn_role(cmd, run_dir / f"generator-{i}.log", threads=threads) for i, cmd in enumerate(gen_cmds)]
    deadline = t0 + args.max_minutes * 60
    outcome = "time limit"
    stop = asyncio.Event()  # SIGTERM or SIGINT (a device's time limit, Ctrl-C): the roles stop, the summary is written
    loop = asyncio.get_running_loop()
    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    try:
        while time.time() < deadline:
            await asyncio.sleep(0.5)
            if stop.is_set():
                outcome = INTERRUPTED
                break
            if procs[0].poll() is not None:
                outcome = "learner finished" if procs[0].returncode == 0 else f"learner failed ({procs[0].returncode})"
                break
            if all(p.poll() is not None for p in procs[1:]):  # the run ended (they leave first), or they failed
                try:
                    await asyncio.wait_for(asyncio.to_thread(procs[0].wait), timeout=60)
                    outcome = "learner finished" if procs[0].returncode == 0 else f"learner failed ({procs[0].returncode})"
                except TimeoutError:
                    outcome = "all generators exited"
                break
    finally:
        stop_roles(procs, timeout_s=30.0)
        await plane.close()
        servers.stop()
        for sig in STOP_SIGNALS:
            loop.remove_signal_handler(sig)
    summary: dict[str, Any] = {
        "bench": "loop", "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": machine(args.device),
        "model": args.model, "backend": args.backend, "device": args.device, "learner_nproc": args.learner_nproc,
        "generators": args.generators, "generator_engine": args.generator_engine,
        "generator_devices": args.generator_devices or args.device, "lr": args.lr, "learner_overrides": args.learner,
        "generator_overrides": args.generator, "outcome": outcome, "wall_s": round(time.time() - t0, 1),
        **summarize(events, beats, args.warmup_steps, t0, args.target), "tracebacks": tracebacks(run_dir),
        "exit_lines": exit_lines(run_dir), "run_dir": str(run_dir), "signalled": stop.is_set(),
    }  # fmt: skip
    summary.update(per_gpu_rates(summary, args))
    summary["generator_gpus_per_learner_gpu"] = split(summary)
    return summary
