"""``async-rl status``: generators alive (from heartbeats), their versions and throughput, stream
depths, pending counts, dead letters, learner version and published weight versions, and which learner holds the
run (its lease: host, pid, how long, token).

Generators that left (their last heartbeat said 'stopping') or were lost (no heartbeat for a while: killed, host
gone) stay in the table from the learner's registry (``names.generators``), with the prompts they still hold
pending and when other generators may reclaim them (after its ``prompts.reclaim_idle_ms``, which its heartbeats
carry; 300 s by default)."""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import time
from typing import Any

from async_rl.entry import first_sentence
from async_rl.run.config import RunConfig
from async_rl.run.lease import Holder
from buffer.prompts import PromptQueueConfig

STALENESS_NOTE = ("versions behind: the learner's version now minus the weights the generator sampled with at its "
                  "last heartbeat. staleness.max_staleness bounds something else: how many versions a group's oldest "
                  "token lags the learner when the group is trained (groups over it are dropped and counted above).")
"""What the generators table's "versions behind" column measures. A healthy generator can show more than S: its
version is from its last heartbeat (every ``heartbeat_interval_s``, 2 s) and the learner's from now, so a learner
taking several steps a second runs ahead of it between two heartbeats."""


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    p.add_argument("--prefix", default="async-rl", help="run prefix: run.prefix of the learner (default %(default)s)")
    p.add_argument("--redis-url", default=None, help="Redis URL (default $ASYNC_RL_REDIS_URL)")
    p.add_argument("--nats-url", default=None,
                   help="NATS URL for the generators' heartbeats (default $ASYNC_RL_NATS_URL; without one, the "
                        "learner's registry alone)")  # fmt: skip
    p.add_argument("--listen-s", type=float, default=3.0,
                   help="seconds to collect heartbeats before each snapshot (default %(default)s)")  # fmt: skip
    p.add_argument("--watch", action="store_true", help="refresh until interrupted (default: one snapshot)")
    p.add_argument("--json", action="store_true", help="print one JSON snapshot (default: tables)")
    args = p.parse_args(argv)
    try:
        run = RunConfig(prefix=args.prefix, redis_url=args.redis_url, nats_url=args.nats_url)
    except ValueError as exc:
        p.error(str(exc))
    if not run.redis_url:
        p.error("--redis-url (or ASYNC_RL_REDIS_URL) is required")
    args.run = run
    return args


async def snapshot(run: RunConfig, heartbeats: dict[str, Any], listen_s: float) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from buffer.evals import EvalQueue
    from buffer.stats import buffer_stats

    names = run.names
    assert run.redis_url
    client = aioredis.Redis.from_url(run.redis_url)
    try:
        await asyncio.sleep(listen_s)
        stats = await buffer_stats(client, names)
        raw_state: dict[bytes, bytes] = await client.hgetall(names.learner_state)  # type: ignore[assignment]
        lease_raw, lease_pttl, server_time = (await client.hgetall(names.learner_lease),  # type: ignore[misc]
                                              await client.pttl(names.learner_lease), await client.time())  # fmt: skip
        learner = {k.decode(): v.decode() for k, v in raw_state.items()}
        versions = [int(v) for v in await client.zrange(names.weights_versions, 0, -1)]  # type: ignore[arg-type]
        latest = await client.get(names.weights_latest)
        scaling = await client.get(names.scaling_state)
        registry: dict[bytes, bytes] = await client.hgetall(names.generators)  # type: ignore[assignment]
        eval_counters = await EvalQueue(client, names).counters()
    finally:
        await client.aclose()
    now = time.time()
    beats = {**_registry(registry), **heartbeats}  # what was heard just now wins over the learner's registry
    pending = {c["name"]: c for c in stats["prompts"]["stream"].get("consumers", [])}
    default_reclaim_ms = PromptQueueConfig().reclaim_idle_ms
    gens = []
    for h in sorted(beats.values(), key=lambda h: h.generator_id):
        # Three missed heartbeats (the generator says its interval), and never less than this listening window.
        fresh_s = max(3 * h.interval_s, listen_s + h.interval_s) if h.interval_s else max(3 * listen_s, 10.0)
        alive = now - h.sent_at < fresh_s and h.state != "stopping"
        held = pending.get(h.generator_id, {"pending": 0, "idle_ms": 0})
        reclaim_ms = h.reclaim_idle_ms or default_reclaim_ms
        if not alive and not held["pending"] and now - h.sent_at > 3600:
            continue  # long gone and holding nothing: not worth a row
        gens.append({
            "id": h.generator_id, "host": h.host, "pid": h.pid, "engine": h.engine, "version": h.version,
            "tokens_per_s": round(h.tokens_per_s, 1), "in_flight": h.in_flight,
            "state": h.state if alive else ("left" if h.state == "stopping" else "lost"),
            "weight_failures": h.weight_failures, "last_seen_s": round(now - h.sent_at, 1), "alive": alive,
            "pending_prompts": int(held["pending"]),
            "reclaim_in_s": round(max(reclaim_ms - int(held["idle_ms"]), 0) / 1000) if held["pending"] else None,
        })  # fmt: skip
    holder = Holder.parse(lease_raw, server_time[0] + server_time[1] / 1e6, int(lease_pttl))
    return {
        "prefix": run.prefix,
        "learner": learner,
        # Who holds the run's lease (async_rl/run/lease.py), None: no learner holds it now.
        "lease": None if holder is None else {"host": holder.host, "pid": holder.pid, "since": holder.since,
                                              "held_s": round(holder.age_s, 1), "token": holder.number,
                                              "run_dir": holder.run_dir, "expires_in_s": holder.ttl_s},  # fmt: skip
        "weights": {"latest": int(latest) if latest else None, "kept": versions},
        "generators": gens,
        "buffer": stats,
        "scaling": _scaling(scaling),
        # The newest evaluation round the learner reported (eval/<task>/...), and the evaluation queue's totals.
        "eval": {"latest": json.loads(learner.pop("eval", "{}")), "prompts": eval_counters},
    }


def _registry(raw: dict[bytes, bytes]) -> dict[str, Any]:
    """The learner's registry of generators (id -> last heartbeat); entries that do not decode are skipped."""
    from async_rl.servers.control import Heartbeat, MessageError, decode

    out: dict[str, Any] = {}
    for value in raw.values():
        try:
            msg = decode(value)
        except MessageError:
            continue
        if isinstance(msg, Heartbeat):
            out[msg.generator_id] = msg
    return out


def _scaling(raw: Any) -> dict[str, Any] | None:
    """The learner's latest scaling signal (async_rl.metrics.scaling) as plain data, or None before its first step."""
    import dataclasses

    from async_rl.servers.control import MessageError, ScalingSignal, decode

    if not isinstance(raw, bytes):
        return None
    try:
        msg = decode(raw)
    except MessageError:
        return None
    return dataclasses.asdict(msg) if isinstance(msg, ScalingSignal) else None


def render(snap: dict[str, Any]) -> Any:
    from rich.console import Group
    from rich.table import Table

    learner = snap["learner"]
    b = snap["buffer"]
    lease = snap.get("lease")
    holder = ("no learner holds the run" if lease is None else
              f"learner: pid {lease['pid']} on host {lease['host']}, holding the run for {lease['held_s']:.0f}s "
              f"(token {lease['token']})")  # fmt: skip
    head = Table(title=f"async-rl run {snap['prefix']!r}", caption=holder, show_header=True)
    for col in ("learner step", "learner version", "published", "rollout backlog", "duplicates", "dead letters"):
        head.add_column(col, justify="right")
    head.add_row(str(learner.get("step", "-")), str(learner.get("version", "-")), str(snap["weights"]["latest"]),
                 str(b["rollouts"]["backlog"]), str(b["rollouts"]["duplicates"]),
                 str(b["dead_letters"]["length"]))  # fmt: skip
    a = b["audit"]
    fates = Table(title="prompts: issued = trained + dropped stale + dead-lettered + in flight (async-rl audit checks)")
    for col in ("issued", "trained", "dropped stale", "dead-lettered", "in flight"):
        fates.add_column(col, justify="right")
    fates.add_row(*(str(a[k]) for k in ("issued", "trained", "dropped_stale", "dead_lettered", "in_flight")))
    gens = Table(title="generators", caption=STALENESS_NOTE)
    for col in ("id", "host", "engine", "state", "version", "versions behind", "tokens/s", "in flight", "last seen",
                "pending prompts", "reclaimable in"):
        gens.add_column(col)
    v = int(learner.get("version", 0) or 0)
    for g in snap["generators"]:
        style = None if g["alive"] else "dim"
        reclaim = "-" if g["reclaim_in_s"] is None else ("now" if g["reclaim_in_s"] == 0 else f"{g['reclaim_in_s']}s")
        gens.add_row(g["id"], g["host"], g["engine"], g["state"], str(g["version"]), str(v - g["version"]),
                     f"{g['tokens_per_s']:.0f}", str(g["in_flight"]), f"{g['last_seen_s']}s",
                     str(g["pending_prompts"]), reclaim, style=style)  # fmt: skip
    parts: list[Any] = [head, fates, gens]
    if "bytes" in learner:  # the learner's last published version (async_rl/weights/background.py)
        pub = Table(title="weights publishing (last version out)")
        for col in ("visible version", "kind", "bytes sent", "delta ratio", "snapshot -> visible", "versions skipped"):
            pub.add_column(col, justify="right")
        kind = "full" if float(learner.get("full", 0)) else "delta"
        pub.add_row(str(learner.get("published_version", "-")), kind, f"{float(learner['bytes']) / 1e6:.2f} MB",
                    f"{float(learner.get('delta_ratio', 1)):.3f}", f"{float(learner.get('publish_latency_s', 0)):.3f}s",
                    str(learner.get("versions_skipped", 0)))  # fmt: skip
        parts.insert(1, pub)
    s = snap["scaling"]
    if s:
        sc = Table(title=f"scaling signal (step {s['step']}): {s['reason']}")
        for col in ("learner waits", "backlog (batches)", "generators alive", "suggested", "decision"):
            sc.add_column(col, justify="right")
        sc.add_row(f"{s['wait_share']:.0%}", f"{s['backlog_groups']} ({s['backlog_batches']:.2f})",
                   str(s["generators"]), str(s["suggested_generators"]), s["decision"])  # fmt: skip
        parts.insert(1, sc)
    ev = snap.get("eval") or {}
    if ev.get("latest") or (ev.get("prompts") or {}).get("issued"):
        et = Table(title="evaluation on held-out prompts (never trained on; not in the prompts' totals above)")
        for col in ("metric", "value"):
            et.add_column(col)
        for k, val in sorted(ev.get("latest", {}).items()):
            et.add_row(k, f"{val:.4g}")
        c = ev.get("prompts", {})
        et.add_row("prompts issued / evaluated / dead-lettered / in flight",
                   " / ".join(str(c.get(k, 0)) for k in ("issued", "evaluated", "dead_lettered", "in_flight")))  # fmt: skip
        parts.insert(2, et)
    if b["dead_letters"]["latest"]:
        dl = Table(title="latest dead letters")
        for col in ("source", "id", "generator", "reason", "error"):
            dl.add_column(col)
        for d in b["dead_letters"]["latest"]:
            dl.add_row(str(d["source_stream"]), str(d["source_id"]), str(d["generator"]), str(d["reason"])[:120],
                       str(d["error"])[:80])  # fmt: skip
        parts.append(dl)
    return Group(*parts)


async def _run(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.live import Live

    from async_rl.servers.control import ControlPlane, Heartbeat, Message

    run: RunConfig = args.run
    heartbeats: dict[str, Any] = {}
    plane = None
    if run.nats_url:

        async def on_beat(msg: Message) -> None:
            assert isinstance(msg, Heartbeat)
            heartbeats[msg.generator_id] = msg

        plane = await ControlPlane(run.nats_url, name="status").connect()
        await plane.subscribe(run.names.heartbeat_subject, on_beat, kinds=(Heartbeat,))
    try:
        if args.json:
            print(json.dumps(await snapshot(run, heartbeats, args.listen_s), indent=2, default=str))
            return 0
        # Piped (a log, a file): tables as wide as their content instead of cut at 80 columns.
        console = Console() if sys.stdout.isatty() else Console(width=400)
        if not args.watch:
            console.print(render(await snapshot(run, heartbeats, args.listen_s)))
            return 0
        with Live(console=console, refresh_per_second=1) as live:
            while True:
                live.update(render(await snapshot(run, heartbeats, 1.0)))
    except KeyboardInterrupt:
        return 0
    finally:
        if plane is not None:
            await plane.close()


def main(argv: list[str] | None = None, prog: str = "async-rl status") -> int:
    args = parse_args(argv, prog)
    from async_rl.servers.reach import Unreachable, check_servers

    try:
        check_servers(args.run.redis_url, args.run.nats_url)
    except Unreachable as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    from async_rl.run.listing import missing_run_at

    missing = missing_run_at(args.run.redis_url, args.run.prefix, key="--prefix")
    if missing is not None:  # an empty table would read as a run that has not started; say what is there
        print(f"{prog}: {missing}", file=sys.stderr)
        return 1
    try:
        return asyncio.run(_run(args))
    except ConnectionError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
