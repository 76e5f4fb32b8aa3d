"""``async-rl bench fanout``: one weight version to 1-16 generator hosts, simulated with network namespaces.

Each host is a Linux network namespace (``arlfo-<run>-h<k>``) whose ``eth0`` is one end of a veth pair; the other
end is a port of a bridge in a switch namespace (``arlfo-<run>-sw``); both ends of every link are shaped by netem
(``--link-gbps`` each way, ``--link-ms`` each way). Host 0 runs Valkey and the publisher (a real
:class:`WeightPublisher`); hosts 1..16 run one generator process each (a real :class:`WeightReader` over the
real transport). A round publishes one version of a synthetic model (``--model-gb``, uint8 tensors of
``--bucket-mb``), then tells N generators to fetch it at once; it ends when every one of them has applied it:
received, every bucket checksum-verified by the reader, and every tensor hashed again against the publisher's
own digests. Modes: ``redis`` (buckets in the one Valkey), ``direct`` (``peer://``, every generator pulls from
the publisher), ``relay`` (``peer://``, the publisher feeds ``--publisher-fanout`` peers and each generator
``--fanout`` more). Bytes sent per host are the ``tx`` counters of its link (headers included).
Per round, ``cpu_busy`` is the whole machine's busy share (other work included), ``workers_cpu_s`` the CPU
seconds of the publisher and generator processes (with the softirq work the kernel charged to them), and
``softirq_cpu_s`` the machine's softirq time: the simulated links' and switch's packet processing, which a
real cluster spreads over its hosts and NICs but which here shares the same cores.
``--kill-relay`` adds a relay round in which the publisher's first child is SIGKILLed when it holds a third of
the buckets. Needs root (namespaces, veth, tc); every namespace and process it makes is removed at the end,
and leftovers of an earlier run that is gone (names ``arlfo-*``) at the start; a run still going is left alone.
The namespaces, their shaped links and counters are :mod:`actors.commands.bench.netns`; this module is the worker
processes, the rounds and their summary.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from actors.commands.bench.cpu_accounting import cpu_times, process_cpu_s
from actors.commands.bench.netns import (
    NS_PREFIX,
    RUN_TAG,
    cleanup_namespaces,
    host_addr,
    host_ns,
    link_tx_bytes,
    setup_namespaces,
)
from actors.commands.bench.report import emit

REDIS_PORT = 6379
MODES = ("redis", "direct", "relay")
DEFAULT_HOSTS = (1, 2, 4, 8, 16)
APPLIED_MEANS = (
    "received, every bucket checksum-verified by the WeightReader, every tensor re-hashed against the publisher's "
    "digests (bit_exact)"
)
# Per generator the model is held once, plus the publisher's tensors and peer copy and Valkey's copy.
MEMORY_SLACK = 1.3


def _parse(argv: list[str] | None, prog: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--model-gb", type=float, default=0.5, help="synthetic model size in GB (default 0.5: fits "
                    "16 generator copies in this machine's memory)")  # fmt: skip
    ap.add_argument("--bucket-mb", type=int, default=16, help="bucket size in MiB (the relay forwards per bucket)")
    ap.add_argument("--link-gbps", type=float, default=10.0, help="rate of every link, each way")
    ap.add_argument("--link-ms", type=float, default=0.2, help="delay of every link, each way")
    ap.add_argument("--hosts", default=",".join(map(str, DEFAULT_HOSTS)), help="generator host counts to run")
    ap.add_argument("--modes", default=",".join(MODES), help="modes to run (redis, direct, relay)")
    ap.add_argument("--fanout", type=int, default=1, help="children per generator in relay mode (1: a chain)")
    ap.add_argument("--publisher-fanout", type=int, default=1, help="peers the publisher serves in relay mode")
    ap.add_argument("--kill-relay", action="store_true", help="add a relay round that kills a relay mid-transfer")
    ap.add_argument("--timeout-s", type=float, default=300.0, help="limit for one round")
    ap.add_argument("--worker", choices=("publisher", "generator"), help=argparse.SUPPRESS)
    ap.add_argument("--redis-url", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        return args
    try:
        args.host_counts = sorted({int(x) for x in args.hosts.split(",") if x.strip()})
    except ValueError:
        ap.error(f"--hosts must be comma-separated integers, got {args.hosts!r}")
    if not args.host_counts or min(args.host_counts) < 1 or max(args.host_counts) > 64:
        ap.error("--hosts: each count must be in [1, 64]")
    args.mode_list = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in args.mode_list if m not in MODES]
    if bad or not args.mode_list:
        ap.error(f"--modes: unknown {bad}; known {list(MODES)}")
    if args.model_gb <= 0 or not 0 < args.bucket_mb <= 512:
        ap.error("--model-gb must be > 0 and --bucket-mb in (0, 512]")
    if args.link_gbps <= 0 or args.link_ms < 0:
        ap.error("--link-gbps must be > 0 and --link-ms >= 0")
    if args.fanout < 1 or args.publisher_fanout < 1:
        ap.error("--fanout and --publisher-fanout must be >= 1")
    return args


# ---- workers (one process per host) ----------------------------------------------------------


async def _lines() -> Any:
    loop = asyncio.get_running_loop()
    while True:
        line = await loop.run_in_executor(None, sys.stdin.readline)
        if not line:
            return
        yield json.loads(line)


def _reply(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


async def _publisher_worker(args: argparse.Namespace) -> None:
    import redis.asyncio as aioredis
    import torch
    import xxhash

    from async_rl.run.names import Names
    from async_rl.weights import PublisherConfig, WeightPublisher
    from async_rl.weights.transport import TransportConfig, make_transport

    r = aioredis.Redis.from_url(args.redis_url)
    tensors: dict[str, torch.Tensor] = {}
    digests: dict[str, int] = {}
    state: dict[str, Any] = {}
    _reply({"ready": True})
    async for cmd in _lines():
        kind = cmd["cmd"]
        if kind == "model":
            tensors.clear()
            g = torch.Generator().manual_seed(cmd["seed"])
            left, i = cmd["model_bytes"], 0
            while left > 0:
                n = min(left, cmd["tensor_bytes"])
                tensors[f"layers.{i}.weight"] = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
                left, i = left - n, i + 1
            digests = {k: xxhash.xxh3_64_intdigest(t.numpy().data) for k, t in tensors.items()}
            _reply({"digests": digests})
        elif kind == "publish":
            names = Names(prefix=cmd["prefix"])
            transport = make_transport(TransportConfig(url=cmd["url"]), args.redis_url, names)
            pub = WeightPublisher(r, transport, names, PublisherConfig(
                bucket_bytes=cmd["bucket_bytes"], keep_versions=1, background=False, delta=False))  # fmt: skip
            t0 = time.perf_counter()
            m = await pub.publish(tensors, cmd["version"])
            state.update(names=names, transport=transport, version=cmd["version"])
            _reply({"publish_s": time.perf_counter() - t0, "num_buckets": m.num_buckets, "total_bytes": m.total_bytes})
        elif kind == "relays":
            raw = await r.hgetall(state["names"].weights_relays(state["version"]))
            _reply({"relays": {(k.decode() if isinstance(k, bytes) else k): json.loads(v) for k, v in raw.items()}})
        elif kind == "finish":
            transport = state.pop("transport")
            sent = getattr(transport, "bytes_sent", 0)
            peer_id = getattr(transport, "peer_id", "")
            await transport.close()
            keys = [k async for k in r.scan_iter(match=state["names"].all_key_pattern(), count=1000)]
            if keys:
                await r.delete(*keys)
            _reply({"bytes_sent": sent, "peer_id": peer_id})
    await r.aclose()


async def _generator_worker(args: argparse.Namespace) -> None:
    import gc

    import redis.asyncio as aioredis
    import xxhash

    from async_rl.run.names import Names
    from async_rl.weights import WeightReader
    from async_rl.weights.config import ReaderConfig
    from async_rl.weights.transport import TransportConfig, make_transport

    r = aioredis.Redis.from_url(args.redis_url)
    state: dict[str, Any] = {}
    _reply({"ready": True})
    async for cmd in _lines():
        if cmd["cmd"] == "fetch":
            names = Names(prefix=cmd["prefix"])
            transport = make_transport(TransportConfig(url=cmd["url"]), args.redis_url, names)
            state["transport"] = transport
            reader = WeightReader(r, transport, names, ReaderConfig(prefetch_buckets=2))
            try:
                fetched = await reader.fetch(cmd["version"])
            except Exception as exc:  # reported to the driver, which fails the round with it
                _reply({"error": repr(exc)})
                continue
            applied_at = time.time()
            digests = cmd["digests"]
            exact = all(xxhash.xxh3_64_intdigest(t.numpy().data) == digests[k] for k, t in fetched.tensors.items())
            exact = exact and fetched.tensors.keys() == digests.keys()
            del fetched
            _reply({"applied_at": applied_at, "bit_exact": exact,
                    "reattaches": getattr(transport, "num_reattaches", 0),
                    "corrupt_refused": getattr(transport, "num_corrupt", 0),
                    "reattach_s": getattr(transport, "reattach_s", [])})  # fmt: skip
        elif cmd["cmd"] == "end":
            transport = state.pop("transport", None)
            sent = getattr(transport, "bytes_sent", 0)
            if transport is not None:
                await transport.close()
            gc.collect()
            _reply({"bytes_sent": sent})
    await r.aclose()


# ---- driver ----------------------------------------------------------------------------------


def _open_log(path: Path) -> Any:
    return open(path, "wb")  # noqa: SIM115 - handed to the worker process, closed by the caller after the spawn


def _mem_available() -> int:
    with open("/proc/meminfo") as fh:
        return next(int(line.split()[1]) * 1024 for line in fh if line.startswith("MemAvailable"))


def _start_valkey() -> subprocess.Popen:
    from async_rl.servers.embedded import valkey_binary

    return subprocess.Popen(
        ["ip", "netns", "exec", host_ns(0), str(valkey_binary()), "--bind", host_addr(0), "--port", str(REDIS_PORT),
         "--save", "", "--appendonly", "no", "--protected-mode", "no"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip


class Worker:
    """One worker process in a host namespace, spoken to in JSON lines."""

    proc: asyncio.subprocess.Process
    host: int

    def __init__(self, proc: asyncio.subprocess.Process, host: int) -> None:
        self.proc = proc
        self.host = host

    @classmethod
    async def start(cls, host: int, role: str, redis_url: str, log_dir: Path) -> Worker:
        env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[3]), OMP_NUM_THREADS="1")
        log = _open_log(log_dir / f"{role}-{host}.log")
        proc = await asyncio.create_subprocess_exec(
            "ip", "netns", "exec", host_ns(host), sys.executable, "-m", "actors.commands.bench.fanout",
            "--worker", role, "--redis-url", redis_url,
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, limit=64 << 20,
        )  # fmt: skip
        log.close()
        return cls(proc, host)

    async def send(self, obj: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps(obj) + "\n").encode())
        await self.proc.stdin.drain()

    async def recv(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = await asyncio.wait_for(self.proc.stdout.readline(), timeout_s)
        if not line:
            raise RuntimeError(f"worker on host {self.host} exited (rc {self.proc.returncode}); see its log")
        return dict(json.loads(line))

    async def ask(self, obj: dict[str, Any], timeout_s: float) -> dict[str, Any]:
        await self.send(obj)
        return await self.recv(timeout_s)

    def kill(self) -> None:
        if self.proc.returncode is None:
            self.proc.kill()


async def _round(
    mode: str, n: int, args: argparse.Namespace, pub: Worker, gens: list[Worker], digests: dict[str, int],
    version: int, kill: bool = False,
) -> dict[str, Any]:  # fmt: skip
    prefix = f"fanout-{mode}-{n}-{uuid.uuid4().hex[:6]}"
    if mode == "redis":
        pub_url, gen_urls = "", ["" for _ in range(n)]
    elif mode == "direct":
        pub_url = f"peer://{host_addr(0)}:0?fanout={n}"
        gen_urls = [f"peer://{host_addr(k)}:0?fanout=0" for k in range(1, n + 1)]
    else:
        pub_url = f"peer://{host_addr(0)}:0?fanout={args.publisher_fanout}"
        gen_urls = [f"peer://{host_addr(k)}:0?fanout={args.fanout}" for k in range(1, n + 1)]
    published = await pub.ask({"cmd": "publish", "prefix": prefix, "url": pub_url, "version": version,
                               "bucket_bytes": args.bucket_mb << 20}, args.timeout_s)  # fmt: skip
    pids = [w.proc.pid for w in (pub, *gens[:n])]
    tx0, cpu0, proc0 = link_tx_bytes(max(args.host_counts) + 1), cpu_times(), process_cpu_s(pids)
    t0 = time.time()
    for w, url in zip(gens[:n], gen_urls, strict=True):
        await w.send({"cmd": "fetch", "prefix": prefix, "url": url, "version": version, "digests": digests})
    killed: dict[str, Any] | None = None
    if kill:
        killed = await _kill_first_relay(pub, gens[:n], published["num_buckets"], t0)
    survivors = [w for w in gens[:n] if w.proc.returncode is None and (killed is None or w.host != killed["host"])]
    replies = await asyncio.gather(*(w.recv(args.timeout_s) for w in survivors))
    t_end = time.time()
    errors = [rep["error"] for rep in replies if "error" in rep]
    if errors:
        raise RuntimeError(f"{mode} N={n}: a generator failed: {errors[0]}")
    cpu1, proc1 = cpu_times(), process_cpu_s(pids)
    tx1 = link_tx_bytes(max(args.host_counts) + 1)
    ended = await asyncio.gather(*(w.ask({"cmd": "end"}, args.timeout_s) for w in survivors))
    fin = await pub.ask({"cmd": "finish"}, args.timeout_s)
    sent = [b - a for a, b in zip(tx0, tx1, strict=True)]
    applied = [rep["applied_at"] - t0 for rep in replies]
    out: dict[str, Any] = {
        "all_applied_s": round(max(applied), 3),
        "first_applied_s": round(min(applied), 3),
        "publisher_bytes": sent[0],
        "max_peer_bytes": max(sent[w.host] for w in survivors),
        "publisher_copies": round(sent[0] / published["total_bytes"], 3),
        "publisher_payload_bytes": fin["bytes_sent"] if mode != "redis" else None,
        "bit_exact": all(rep["bit_exact"] for rep in replies),
        "reattaches": sum(rep["reattaches"] for rep in replies),
        "cpu_busy": round(1 - (cpu1[1] - cpu0[1]) / max(1, cpu1[0] - cpu0[0]), 3),
        "workers_cpu_s": round(proc1 - proc0, 2),
        "softirq_cpu_s": round((cpu1[2] - cpu0[2]) / os.sysconf("SC_CLK_TCK"), 2),
        "round_s": round(t_end - t0, 3),
        "publish_s": round(published["publish_s"], 3),
    }
    del ended
    if killed is not None:
        out["killed"] = killed
        out["survivors"] = len(survivors)
        out["survivor_reattaches"] = {str(w.host): rep["reattaches"] for w, rep in zip(survivors, replies, strict=True)
                                      if rep["reattaches"]}  # fmt: skip
        out["reattach_s"] = [round(x, 3) for rep in replies for x in rep["reattach_s"]]
        out["corrupt_refused"] = sum(rep["corrupt_refused"] for rep in replies)
    return out


async def _kill_first_relay(pub: Worker, gens: list[Worker], num_buckets: int, t0: float) -> dict[str, Any]:
    """SIGKILL the publisher's child once it holds a third of the buckets and feeds a child of its own."""
    by_addr = {host_addr(w.host): w for w in gens}
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        relays = (await pub.ask({"cmd": "relays"}, 10))["relays"]
        pub_ids = [pid for pid, e in relays.items() if e["depth"] == 0]
        for pid, e in relays.items():
            has_child = any(c["parent"] == pid for c in relays.values())
            if pub_ids and e["parent"] in pub_ids and e["done"] == 0 and e["have"] >= num_buckets // 3 and has_child:
                victim = by_addr[e["tcp"].rpartition(":")[0]]
                victim.kill()
                await victim.proc.wait()
                return {"host": victim.host, "at_s": round(time.time() - t0, 3), "had_buckets": e["have"],
                        "of_buckets": num_buckets}  # fmt: skip
        gens_seen = [e for e in relays.values() if e["depth"] > 0]
        if len(gens_seen) == len(gens) and all(e["done"] for e in gens_seen):
            raise RuntimeError("--kill-relay: every generator finished before a relay could be killed mid-transfer; "
                               "use a larger --model-gb or a slower --link-gbps")  # fmt: skip
        await asyncio.sleep(0.005)
    raise RuntimeError("--kill-relay: no relay reached a third of the buckets within 60 s")


def _check_root() -> str | None:
    if os.geteuid() != 0:
        return "async-rl bench fanout needs root (network namespaces, veth links, tc); run it as root"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"async-rl bench fanout needs the '{tool}' command (iproute2)"
    return None


async def _drive(args: argparse.Namespace) -> dict[str, Any]:
    num_hosts = max(args.host_counts) + 1
    model_bytes = int(args.model_gb * 1e9)
    avail = _mem_available()
    need = int((max(args.host_counts) + 3) * model_bytes * MEMORY_SLACK)
    if need > avail:
        raise SystemExit(f"async-rl bench fanout: {max(args.host_counts)} generators x {args.model_gb} GB needs about "
                         f"{need / 1e9:.1f} GB, {avail / 1e9:.1f} GB available; lower --model-gb or --hosts")  # fmt: skip
    stale = cleanup_namespaces()
    workers: list[Worker] = []
    valkey: subprocess.Popen | None = None
    log_dir = Path(f"/tmp/async-rl-fanout-{os.getpid()}")
    log_dir.mkdir(exist_ok=True)
    results: dict[str, dict[str, Any]] = {m: {} for m in args.mode_list}
    fault: dict[str, Any] | None = None
    qdisc = ""
    try:
        qdisc = setup_namespaces(num_hosts, args.link_gbps, args.link_ms)
        valkey = _start_valkey()
        redis_url = f"redis://{host_addr(0)}:{REDIS_PORT}/0"
        pub = await Worker.start(0, "publisher", redis_url, log_dir)
        workers.append(pub)
        gens = [await Worker.start(k, "generator", redis_url, log_dir) for k in range(1, num_hosts)]
        workers += gens
        for w in workers:
            await w.recv(120)
        tensor_bytes = (args.bucket_mb << 20) - 64
        digests = (await pub.ask({"cmd": "model", "seed": 1, "model_bytes": model_bytes,
                                  "tensor_bytes": tensor_bytes}, 300))["digests"]  # fmt: skip
        version = 0
        for mode in args.mode_list:
            for n in args.host_counts:
                version += 1
                res = await _round(mode, n, args, pub, gens, digests, version)
                results[mode][str(n)] = res
                print(f"{mode:>6} N={n:>2}: all applied {res['all_applied_s']:.2f}s, publisher sent "
                      f"{res['publisher_copies']:.2f} copies, max peer {res['max_peer_bytes'] / 1e6:.0f} MB, "
                      f"cpu busy {res['cpu_busy']:.0%} (workers {res['workers_cpu_s']:.1f} cpu-s, softirq "
                      f"{res['softirq_cpu_s']:.1f} cpu-s)", file=sys.stderr, flush=True)  # fmt: skip
        if args.kill_relay:
            n = max(args.host_counts)
            version += 1
            fault = await _round("relay", n, args, pub, gens, digests, version, kill=True)
            base = results.get("relay", {}).get(str(n))
            if base is not None:
                fault["delay_vs_relay_s"] = round(fault["all_applied_s"] - base["all_applied_s"], 3)
            print(f" fault N={n}: {fault}", file=sys.stderr, flush=True)
    finally:
        for w in workers:
            w.kill()
        for w in workers:
            with contextlib.suppress(ProcessLookupError):
                await w.proc.wait()
        if valkey is not None:
            valkey.kill()
            valkey.wait()
        cleanup_namespaces()
    one, many = str(min(args.host_counts)), str(max(args.host_counts))
    relay = results.get("relay", {})
    out: dict[str, Any] = {
        "model_bytes": model_bytes,
        "bucket_bytes": args.bucket_mb << 20,
        "link_gbps": args.link_gbps,
        "link_ms_each_way": args.link_ms,
        "link_qdisc": qdisc,
        "link_delay_applied": qdisc == "netem",
        "fanout": args.fanout,
        "publisher_fanout": args.publisher_fanout,
        "results": results,
        "relay_ratio_16_vs_1": (
            round(relay[many]["all_applied_s"] / relay[one]["all_applied_s"], 3)
            if one in relay and many in relay
            else None
        ),
        "relay_ratio_hosts": [int(one), int(many)],
        "kill_relay": fault,
        "applied_means": APPLIED_MEANS,
        "stale_namespaces_removed": stale,
        "namespace_prefix": f"{NS_PREFIX}{RUN_TAG}-",
        "machine": {
            "cpus": os.cpu_count(),
            "memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
            "platform": platform.platform(),
            "python": platform.python_version(),
            "load_avg_1m_after": round(os.getloadavg()[0], 2),
            "date": datetime.now(UTC).isoformat(timespec="seconds"),
        },
    }
    return out


def main(argv: list[str] | None = None, prog: str = "async-rl bench fanout") -> int:
    args = _parse(argv, prog)
    if args.worker == "publisher":
        asyncio.run(_publisher_worker(args))
        return 0
    if args.worker == "generator":
        asyncio.run(_generator_worker(args))
        return 0
    problem = _check_root()
    if problem is not None:
        print(problem, file=sys.stderr)
        return 2
    result = asyncio.run(_drive(args))
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
