"""``async-rl bench buffer``: rollout-stream throughput against raw bytes and JSON encodings.

Pushes N realistic group records (default 8 samples x 2,048 response tokens after a 256-token
prompt, routes for 48 MoE layers x top-8 as uint8) end to end through a real Redis-compatible
server with our path (encode + validate, SET + XADD of a small entry pointing to it, XREADGROUP,
GET, decode + validate, XACK/XDEL/DEL) and,
in the same run and through the same server, the same arrays as:

* ``raw``: one pre-built blob of the arrays' bytes with SET / GET / DEL (the ceiling);
* ``json``: JSON with nested integer lists (how routes travelled in popular frameworks);
* ``b64json``: JSON with base64-encoded arrays (how the best of them ship routes now).

Every variant decodes back to numpy arrays. Throughput is array bytes (``group_bytes`` per
group, the same for all) per second of wall time, in GB/s. Ours and raw take turns batch by batch
(so a busy spell on a shared machine falls on both alike) for ``--repeats`` runs; the best run of
each counts, and ``ratio_vs_raw_paired_median`` is the median of the per-run ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import numpy as np

from async_rl.model.moe import route_dtype
from async_rl.run.names import Names
from async_rl.wire.types import GroupRecord, Sample


def make_group(
    *,
    group_id: str,
    prompt_tokens: int = 256,
    response_tokens: int = 2048,
    num_samples: int = 8,
    moe_layers: int = 48,
    top_k: int = 8,
    num_experts: int = 64,
    version: int = 0,
    seed: int = 0,
    generator_id: str = "bench",
) -> GroupRecord:
    """A synthetic but realistic group: random ids, logprobs <= 0, two weight versions per sample
    (a swap mid-sequence), routes for every token but the last (what an engine actually ran)."""
    rng = np.random.default_rng(seed)
    samples = []
    for i in range(num_samples):
        n = int(response_tokens)
        versions = np.full(n, version, dtype=np.int32)
        if n > 1:
            versions[: n // 3] = max(0, version - 1)
        routes = None
        if moe_layers > 0:
            routes = rng.integers(0, num_experts, (prompt_tokens + n - 1, moe_layers, top_k), dtype=np.int64)
            routes = routes.astype(route_dtype(num_experts))
        samples.append(
            Sample(
                response_ids=rng.integers(0, 150_000, n, dtype=np.int32),
                logprobs=-rng.exponential(1.0, n).astype(np.float32),
                versions=versions,
                reward=float(i % 2),
                finish_reason="stop" if i % 3 else "length",
                routes=routes,
                reward_info={"correct": float(i % 2)},
            )
        )
    return GroupRecord(
        group_id=group_id,
        prompt_id=f"prompt-{seed}",
        generator_id=generator_id,
        created_at=time.time(),
        prompt_ids=rng.integers(0, 150_000, prompt_tokens, dtype=np.int32),
        samples=samples,
        metadata={"task": "bench", "issued_version": version},
    )


def _arrays(rec: GroupRecord) -> list[np.ndarray]:
    out = [rec.prompt_ids]
    for s in rec.samples:
        out += [s.response_ids, s.logprobs, s.versions]
        if s.routes is not None:
            out.append(s.routes)
    return out


def group_bytes(rec: GroupRecord) -> int:
    return sum(a.nbytes for a in _arrays(rec))


# ---- the JSON baselines --------------------------------------------------------------------
def _json_sample(s: Sample, arr: Any) -> dict[str, Any]:
    return {
        "response_ids": arr(s.response_ids),
        "logprobs": arr(s.logprobs),
        "versions": arr(s.versions),
        "routes": None if s.routes is None else arr(s.routes),
        "reward": s.reward,
        "finish_reason": s.finish_reason,
        "reward_info": s.reward_info,
    }


def _json_group(rec: GroupRecord, arr: Any) -> bytes:
    doc = {
        "group_id": rec.group_id,
        "prompt_id": rec.prompt_id,
        "generator_id": rec.generator_id,
        "created_at": rec.created_at,
        "prompt_ids": arr(rec.prompt_ids),
        "samples": [_json_sample(s, arr) for s in rec.samples],
        "metadata": rec.metadata,
    }
    return json.dumps(doc).encode()


def encode_json(rec: GroupRecord) -> bytes:
    return _json_group(rec, lambda a: a.tolist())


def decode_json(data: bytes) -> list[np.ndarray]:
    doc = json.loads(data)
    out = [np.asarray(doc["prompt_ids"], dtype=np.int32)]
    for s in doc["samples"]:
        out += [np.asarray(s["response_ids"], dtype=np.int32), np.asarray(s["logprobs"], dtype=np.float32)]
        out.append(np.asarray(s["versions"], dtype=np.int32))
        if s["routes"] is not None:
            out.append(np.asarray(s["routes"], dtype=np.uint8))
    return out


def _b64(a: np.ndarray) -> dict[str, Any]:
    return {"dtype": a.dtype.str, "shape": list(a.shape), "data": base64.b64encode(a.tobytes()).decode("ascii")}


def _unb64(d: dict[str, Any]) -> np.ndarray:
    return np.frombuffer(base64.b64decode(d["data"]), dtype=np.dtype(d["dtype"])).reshape(d["shape"])


def encode_b64json(rec: GroupRecord) -> bytes:
    return _json_group(rec, _b64)


def decode_b64json(data: bytes) -> list[np.ndarray]:
    doc = json.loads(data)
    out = [_unb64(doc["prompt_ids"])]
    for s in doc["samples"]:
        out += [_unb64(s["response_ids"]), _unb64(s["logprobs"]), _unb64(s["versions"])]
        if s["routes"] is not None:
            out.append(_unb64(s["routes"]))
    return out


# ---- runs ----------------------------------------------------------------------------------
class _OursLane:
    """Our path: RolloutWriter.append (encode, SET + XADD), RolloutReader.read (XREADGROUP, GET, decode), ack."""

    def __init__(self, redis: Any, names: Names, recs: list[GroupRecord], batch: int) -> None:
        from buffer.rollout_writer import RolloutWriter, RolloutWriterConfig
        from buffer.rollouts import RolloutReader

        self.redis, self.names, self.recs = redis, names, recs
        self.writer = RolloutWriter(redis, names, RolloutWriterConfig(max_backlog=max(batch, 1) * 4))
        self.reader = RolloutReader(redis, names)

    async def open(self) -> None:
        await self.reader.read("bench", count=1)  # creates the group; nothing to read yet

    async def batch(self, idx: range) -> None:
        for j in idx:
            await self.writer.append(self.recs[j])
        got: list[Any] = []
        while len(got) < len(idx):
            got += await self.reader.read("bench", count=len(idx) - len(got), block_ms=1000)
        await self.reader.ack(got)

    async def close(self) -> None:
        keys = [k async for k in self.redis.scan_iter(match=self.names.all_key_pattern())]
        if keys:
            await self.redis.delete(*keys)


class _KvLane:
    """SET / GET / DEL of ``enc(rec)``, ``dec`` on what comes back; ``enc=None``: pre-built raw blobs."""

    def __init__(self, redis: Any, names: Names, recs: list[GroupRecord], enc: Any, dec: Any) -> None:
        self.redis, self.names, self.recs, self.enc, self.dec = redis, names, recs, enc, dec
        self.blobs = [b"".join(a.tobytes() for a in _arrays(r)) for r in recs] if enc is None else None

    async def open(self) -> None:
        pass

    async def batch(self, idx: range) -> None:
        keys = [self.names.key("kv", j) for j in idx]
        for j, k in zip(idx, keys, strict=True):
            await self.redis.set(k, self.blobs[j] if self.blobs is not None else self.enc(self.recs[j]))
        for k in keys:
            data = await self.redis.get(k)
            if self.dec is not None:
                self.dec(data)
        await self.redis.delete(*keys)

    async def close(self) -> None:
        pass


async def _measure(lanes: dict[str, Any], num: int, batch: int, repeats: int) -> dict[str, list[tuple[float, float]]]:
    """Per repeat and lane: (groups/s, client CPU s per group). Lanes take turns batch by batch, so a busy
    spell on a shared machine falls on all of them alike."""
    runs: dict[str, list[tuple[float, float]]] = {name: [] for name in lanes}
    for lane in lanes.values():
        await lane.open()
    for _ in range(repeats):
        wall = dict.fromkeys(lanes, 0.0)
        cpu = dict.fromkeys(lanes, 0.0)
        for i in range(0, num, batch):
            idx = range(i, min(i + batch, num))
            for name, lane in lanes.items():
                c0, t0 = time.process_time(), time.perf_counter()
                await lane.batch(idx)
                wall[name] += time.perf_counter() - t0
                cpu[name] += time.process_time() - c0
        for name in lanes:
            runs[name].append((num / wall[name], cpu[name] / num))
    for lane in lanes.values():
        await lane.close()
    return runs


def _machine(info: dict[str, Any]) -> dict[str, Any]:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    import hiredis
    import msgspec
    import redis as redis_pkg

    server = info.get("valkey_version") and f"valkey {info['valkey_version']}" or f"redis {info.get('redis_version')}"
    return {
        "cpu_model": cpu,
        "cpu_cores": os.cpu_count(),
        "server": server,
        "python": sys.version.split()[0],
        "redis_py": redis_pkg.__version__,
        "hiredis": hiredis.__version__,
        "msgspec": msgspec.__version__,
        "numpy": np.__version__,
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from async_rl.servers.embedded import DEFAULT_REDIS_URL, start_redis, url_reachable
    from async_rl.wire import encode_group

    owned = None
    url = args.redis_url
    if url is None:
        if url_reachable(DEFAULT_REDIS_URL):
            url = DEFAULT_REDIS_URL
        else:
            owned = start_redis()
            url = owned.url
    redis = aioredis.Redis.from_url(url)
    try:
        shape = dict(
            prompt_tokens=args.prompt_tokens,
            response_tokens=args.response_tokens,
            num_samples=args.samples,
            moe_layers=args.moe_layers,
            top_k=args.top_k,
        )
        recs = [make_group(group_id=f"bench-{i}", seed=i, version=5, **shape) for i in range(args.groups)]
        json_recs = recs[: args.json_groups]
        nbytes = group_bytes(recs[0])
        prefix = f"bench-buffer-{os.getpid()}"
        ours, raw, b64, js = (Names(prefix=f"{prefix}-{v}") for v in ("ours", "raw", "b64json", "json"))
        load_before = os.getloadavg()
        runs = await _measure(
            {"raw": _KvLane(redis, raw, recs, None, None), "ours": _OursLane(redis, ours, recs, args.batch)},
            len(recs),
            args.batch,
            args.repeats,
        )
        b64_lane = {"b64json": _KvLane(redis, b64, recs, encode_b64json, decode_b64json)}
        runs |= await _measure(b64_lane, len(recs), args.batch, args.b64_repeats)
        json_lane = {"json": _KvLane(redis, js, json_recs, encode_json, decode_json)}
        runs |= await _measure(json_lane, len(json_recs), args.batch, args.json_repeats)
        load_after = os.getloadavg()
        best = {k: max(r[0] for r in v) for k, v in runs.items()}
        gbps = {k: v * nbytes / 1e9 for k, v in best.items()}
        cpu_ms = {k: min(r[1] for r in v) * 1e3 for k, v in runs.items()}
        machine = _machine(await redis.info("server"))
    finally:
        await redis.aclose()
        if owned is not None:
            owned.stop()
    return {
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
        "machine": machine,
        "redis_url": url if owned is None else "embedded",
        "config": {
            **shape,
            "groups": args.groups,
            "json_groups": len(json_recs),
            "batch": args.batch,
            "repeats": args.repeats,
            "b64_repeats": args.b64_repeats,
            "json_repeats": args.json_repeats,
            "route_dtype": "uint8",
        },  # fmt: skip
        "group_bytes": nbytes,
        "encoded_bytes": {
            "ours": len(encode_group(recs[0])),
            "json": len(encode_json(recs[0])),
            "b64json": len(encode_b64json(recs[0])),
        },
        "ours_gbps": gbps["ours"],
        "raw_gbps": gbps["raw"],
        "json_gbps": gbps["json"],
        "b64json_gbps": gbps["b64json"],
        "ratio_vs_raw": gbps["ours"] / gbps["raw"],
        "speedup_vs_json": gbps["ours"] / gbps["json"],
        "speedup_vs_b64json": gbps["ours"] / gbps["b64json"],
        "groups_per_s": best["ours"],
        "groups_per_s_all_runs": {k: [round(r[0], 3) for r in v] for k, v in runs.items()},
        # Robust to a busy spell: the median over alternating (ours, raw) run pairs.
        "ratio_vs_raw_paired_median": statistics.median(
            o[0] / r[0] for o, r in zip(runs["ours"], runs["raw"], strict=True)
        ),
        "client_cpu_ms_per_group": {k: round(v, 2) for k, v in cpu_ms.items()},
        "client_cpu_ratio_vs_raw": cpu_ms["raw"] / cpu_ms["ours"],
        "load_avg_1m": [round(load_before[0], 2), round(load_after[0], 2)],
    }


def _positive(name: str):  # type: ignore[no-untyped-def]
    def parse(text: str) -> int:
        value = int(text)
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def main(argv: list[str] | None = None, prog: str = "async-rl bench buffer") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--json", type=Path, default=None, help="write the results to this JSON file")
    p.add_argument(
        "--redis-url", default=None, help="server to use (default: 127.0.0.1:6379 if reachable, else embedded)"
    )
    p.add_argument("--groups", type=_positive("--groups"), default=24, help="groups per run (ours, raw, b64json)")
    p.add_argument(
        "--json-groups", type=_positive("--json-groups"), default=2, help="groups per nested-list JSON run (slow)"
    )
    p.add_argument("--repeats", type=_positive("--repeats"), default=5, help="runs of ours and raw; the best counts")
    p.add_argument("--b64-repeats", type=_positive("--b64-repeats"), default=2, help="runs of the base64 JSON variant")
    p.add_argument(
        "--json-repeats", type=_positive("--json-repeats"), default=1, help="runs of the nested-list JSON variant"
    )
    p.add_argument("--batch", type=_positive("--batch"), default=4, help="groups written before they are read back")
    p.add_argument("--samples", type=_positive("--samples"), default=8, help="samples per group")
    p.add_argument("--prompt-tokens", type=_positive("--prompt-tokens"), default=256, help="prompt length")
    p.add_argument("--response-tokens", type=_positive("--response-tokens"), default=2048, help="response length")
    p.add_argument("--moe-layers", type=int, default=48, help="MoE layers with routes (0: dense, no routes)")
    p.add_argument("--top-k", type=_positive("--top-k"), default=8, help="experts per token")
    args = p.parse_args(argv)
    if args.moe_layers < 0:
        p.error("--moe-layers must be >= 0")
    result = asyncio.run(run(args))
    text = json.dumps(result, indent=2)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    print(text)
    return 0
