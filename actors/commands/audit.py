"""``async-rl audit``: check that every prompt a run issued is trained, dropped, dead-lettered or still in a stream.

Prints the totals (issued = trained + dropped stale + dead-lettered + in flight), whether the kept
fates match the counters, and every open prompt found in neither stream; exits 1 when anything is
unaccounted, 0 otherwise (so it can gate a CI job or a cron check). When the run's Redis state was lost and its
learner rebuilt it from a checkpoint (``checkpoint.on_lost_state``), a line says when and what was lost: the totals
count from then on, and the prompts in flight at the loss have no fate.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from async_rl.entry import first_sentence
from async_rl.run.config import RunConfig


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    p.add_argument("--prefix", default="async-rl", help="run prefix (run.prefix of the learner)")
    p.add_argument("--redis-url", default=None, help="Redis URL (default $ASYNC_RL_REDIS_URL)")
    p.add_argument("--fates", type=int, default=0, metavar="N", help="also print the newest N fates")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    args = p.parse_args(argv)
    try:
        run = RunConfig(prefix=args.prefix, redis_url=args.redis_url)
    except ValueError as exc:
        p.error(str(exc))
    if not run.redis_url:
        p.error("--redis-url (or ASYNC_RL_REDIS_URL) is required")
    if args.fates < 0:
        p.error("--fates must be >= 0")
    args.run = run
    return args


async def report(run: RunConfig, num_fates: int = 0) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from actors.learner.run_state import LOST_FIELD
    from buffer.audit import Audit, audit_run

    assert run.redis_url
    client = aioredis.Redis.from_url(run.redis_url)
    try:
        out = await audit_run(client, run.names)
        lost = await client.hget(run.names.learner_state, LOST_FIELD)
        out["lost_state"] = json.loads(lost) if lost else None
        if num_fates:
            out["latest_fates"] = await Audit(client, run.names).fates(num_fates)
    finally:
        await client.aclose()
    return out


def render(prefix: str, rep: dict[str, Any]) -> str:
    c = rep["counters"]
    finished = c["trained"] + c["dropped_stale"] + c["dead_lettered"]
    lines = [
        f"run {prefix!r}: issued {c['issued']} = trained {c['trained']} + dropped stale {c['dropped_stale']} + "
        f"dead-lettered {c['dead_lettered']} + in flight {c['in_flight']}"
        + ("" if rep["balanced"] else f"  MISMATCH: the right side sums to {finished + c['in_flight']}"),
        f"in flight: {rep['open_in_prompt_stream']} in the prompt stream, {rep['open_in_rollout_stream']} in the "
        f"rollout stream, {rep['num_unaccounted']} in neither",
        f"fates kept: {rep['fates_kept']}" + (" (older ones trimmed; counters keep the totals)" if rep["fates_trimmed"]
                                              else "" if rep["fates_match_counters"] else "  MISMATCH with counters"),
    ]  # fmt: skip
    if rep.get("lost_state"):
        lost = rep["lost_state"]
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(lost["at"]))
        lines.append(f"state lost: at {when} the run's Redis {lost['missing']}; its learner went on from checkpoint "
                     f"{lost['checkpoint']} (step {lost['step']}, version {lost['version']}, prompts issued from "
                     f"#{lost['prompts_issued']}): the counters count from then on, and the prompts in flight at the "
                     "loss have no fate")  # fmt: skip
    if rep["finished_twice"]:
        lines.append(f"finished twice: {', '.join(rep['finished_twice'])}")
    if rep["unaccounted"]:
        lines.append(f"unaccounted prompts: {', '.join(rep['unaccounted'])}")
    for f in rep.get("latest_fates", []):
        lines.append(f"  {f['pid']}: {f['fate']} {f['detail']}")
    lines.append("OK: every issued prompt is accounted for" if rep["ok"] else "NOT OK")
    return "\n".join(lines)


def main(argv: list[str] | None = None, prog: str = "async-rl audit") -> int:
    args = parse_args(argv, prog)
    from redis.exceptions import RedisError

    from async_rl.servers.reach import Unreachable, probe_redis

    try:
        probe_redis(args.run.redis_url)
    except Unreachable as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    from async_rl.run.listing import missing_run_at

    missing = missing_run_at(args.run.redis_url, args.run.prefix, key="--prefix")
    if missing is not None:  # nothing issued is not "every issued prompt is accounted for"
        print(f"{prog}: {missing}", file=sys.stderr)
        return 1

    try:
        rep = asyncio.run(report(args.run, args.fates))
    except (RedisError, OSError) as exc:
        print(f"{prog}: cannot read the run at {args.run.redis_url}: {exc}", file=sys.stderr)
        return 1
    print(json.dumps(rep, indent=2) if args.json else render(args.run.prefix, rep))
    return 0 if rep["ok"] else 1
