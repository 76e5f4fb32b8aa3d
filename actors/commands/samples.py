"""``async-rl samples RUN_DIR_OR_CONFIG [--n N] [--follow]``: the newest groups of a run's rollout stream, as text.

Each group's prompt and every response as the model read and wrote them, decoded by the run's task and tokenizer
(special tokens shown; an episode's environment turns between ``[env]`` and ``[/env]``), with the reward and its
components, the weight versions of the response's tokens, how it finished, and the advantage the learner gives it (the
run's ``algorithm.advantage`` on the group's rewards). The run is a learner's run directory (its
``learner-config.json``) or a learner config file. Read-only (:mod:`buffer.peek`): nothing is acked, claimed or
deleted. The stream holds the groups not yet trained, since the learner deletes what it commits; the samples of
trained steps are in the run directory's ``samples.jsonl`` (``learner.samples_table``).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import signal
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from async_rl.entry import first_sentence, resolved_config_path

if TYPE_CHECKING:
    from actors.learner.config import LearnerConfig
    from async_rl.tasks.base import Task
    from buffer.peek import Peeked

FOLLOW_BLOCK_MS = 5000
"""One blocking read of ``--follow`` (it waits on the server, never polls; a shorter one notices Ctrl-C sooner)."""


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    p.add_argument("run", type=Path, metavar="RUN_DIR_OR_CONFIG",
                   help="a learner's run.run_dir (its learner-config.json), or a learner TOML config")  # fmt: skip
    p.add_argument("--n", type=int, default=2, help="newest groups to print (default %(default)s)")
    p.add_argument("--follow", action="store_true", help="then print new groups as they come, until interrupted")
    p.add_argument("--redis-url", default=None,
                   help="Redis URL (default: the run's run.redis_url, else $ASYNC_RL_REDIS_URL)")  # fmt: skip
    args = p.parse_args(argv)
    if args.n < 1:
        p.error("--n must be >= 1")
    if not args.run.exists():
        p.error(f"RUN_DIR_OR_CONFIG {str(args.run)!r} does not exist")
    return args


def load_run_config(path: Path) -> LearnerConfig:
    """The learner config of a run directory or a TOML file (ConfigError naming the key on a bad one)."""
    from actors.learner.config import LearnerConfig
    from async_rl.config.configurable import config_from_data, load_config

    if path.is_dir():
        return config_from_data(LearnerConfig, json.loads(resolved_config_path(path, "learner").read_text()))
    return load_config(LearnerConfig, path)


def format_group(peeked: Peeked, task: Task, cfg: LearnerConfig) -> str:
    """One group as text (see the module docstring); an entry without a group says why."""
    import numpy as np

    from async_rl.algorithms import compute_advantages
    from async_rl.tasks.transcript import group_rows

    g = peeked.group
    if g is None:
        return f"== entry {peeked.entry_id}: {peeked.error}"
    [advantages], _ = compute_advantages([np.array([s.reward for s in g.samples], dtype=np.float64)], cfg.algorithm)
    rows = group_rows(g, task, [float(a) for a in advantages])
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(g.created_at))
    lines = [f"== group {g.group_id}  prompt {g.prompt_id}  generator {g.generator_id}  {when}  entry {peeked.entry_id}",
             f"prompt ({np.asarray(g.prompt_ids).size} tokens):", _indent(rows[0]["prompt"] if rows else "")]  # fmt: skip
    estimator = cfg.algorithm.advantage.estimator
    for r in rows:
        parts = ", ".join(f"{k} {v:.3f}" for k, v in r["reward_info"].items())
        low, high = r["min_version"], r["max_version"]
        versions = "-" if low is None else f"v{low}" if low == high else f"v{low}-{high}"
        env = f" ({r['env_tokens']} environment's)" if r["env_tokens"] else ""
        lines.append(f"sample {r['sample']}: reward {r['reward']:.3f}" + (f" ({parts})" if parts else "")
                     + f"  advantage {r['advantage']:+.3f} ({estimator})  {versions}  {r['finish_reason']}  "
                     f"{r['response_tokens']} tokens{env}")  # fmt: skip
        lines.append(_indent(r["response"]))
    return "\n".join(lines)


def _indent(text: str) -> str:
    return "\n".join("    " + line for line in (text.splitlines() or [""]))


def main(argv: list[str] | None = None, prog: str = "async-rl samples") -> int:
    args = parse_args(argv, prog)
    from async_rl.config.configurable import ConfigError
    from async_rl.process.lifecycle import redact_url
    from async_rl.servers.reach import Unreachable, probe_redis

    if args.run.is_dir() and not resolved_config_path(args.run, "learner").is_file():
        print(f"{prog}: {str(args.run)!r} has no {resolved_config_path(args.run, 'learner').name}: not the run "
              "directory of a learner that started (its run.run_dir)", file=sys.stderr)  # fmt: skip
        return 2
    try:
        cfg = load_run_config(args.run)
    except (ConfigError, ValueError) as exc:
        print(f"{prog}: config error in {args.run}: {exc}", file=sys.stderr)
        return 2
    url = args.redis_url or cfg.run.redis_url
    if not url:
        print(f"{prog}: no Redis URL: the run's config names none (run.redis_url) and ASYNC_RL_REDIS_URL is unset; "
              "pass --redis-url", file=sys.stderr)  # fmt: skip
        return 2
    if "***@" in url:
        print(f"{prog}: the run's saved run.redis_url {url} has its credentials redacted: pass --redis-url with them "
              "(or set ASYNC_RL_REDIS_URL and --redis-url $ASYNC_RL_REDIS_URL)", file=sys.stderr)  # fmt: skip
        return 2
    try:
        probe_redis(url)
    except Unreachable as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    from async_rl.run.listing import missing_run_at

    missing = missing_run_at(url, cfg.run.prefix)
    if missing is not None:
        print(f"{prog}: {missing}", file=sys.stderr)
        return 1
    from async_rl.tasks.config import build_task

    try:
        task = build_task(cfg.task)
    except ValueError as exc:
        print(f"{prog}: config error: {exc}", file=sys.stderr)
        return 2
    from redis.exceptions import ConnectionError as RedisConnectionError

    try:
        return asyncio.run(_show(args, cfg, url, task, prog))
    except (ConnectionError, RedisConnectionError) as exc:
        print(f"{prog}: lost Redis at {redact_url(url)}: {exc}", file=sys.stderr)
        return 1


async def _show(args: argparse.Namespace, cfg: LearnerConfig, url: str, task: Task, prog: str) -> int:
    import redis.asyncio as aioredis
    from redis.exceptions import TimeoutError as RedisTimeout

    from async_rl.process.lifecycle import redact_url
    from buffer.peek import StreamPeek

    client: Any = aioredis.Redis.from_url(url)
    try:
        peek = StreamPeek(client, cfg.run.names)
        if not await peek.exists() and not args.follow:
            print(f"{prog}: run {cfg.run.prefix!r} at {redact_url(url)} has no rollout stream "
                  f"({cfg.run.names.rollouts_stream}): no generator has written a group yet", file=sys.stderr)  # fmt: skip
            return 1
        newest = await peek.newest(args.n)
        for p in newest:
            print(format_group(p, task, cfg), flush=True)
        if not newest:
            print(f"{prog}: no group in {cfg.run.names.rollouts_stream} now (the learner deletes the groups it trains; "
                  f"{cfg.run.run_dir / 'samples.jsonl'} keeps samples of trained steps)", file=sys.stderr)  # fmt: skip
        if not args.follow:
            return 0
        last = newest[-1].entry_id if newest else await peek.last_id()
        stop = asyncio.Event()  # Ctrl-C or SIGTERM: the blocking read is cancelled and the command exits 0
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        stopped = asyncio.ensure_future(stop.wait())
        while not stop.is_set():
            read = asyncio.ensure_future(peek.after(last, FOLLOW_BLOCK_MS))
            await asyncio.wait({read, stopped}, return_when=asyncio.FIRST_COMPLETED)
            if not read.done():
                read.cancel()
                with contextlib.suppress(asyncio.CancelledError, RedisTimeout):  # redis-py turns the cancel into this
                    await read
                break
            for p in read.result():
                print(format_group(p, task, cfg), flush=True)
                last = p.entry_id
        stopped.cancel()
        return 0
    finally:
        await client.aclose()
