"""Time the vLLM engine's weight swaps on one GPU while it generates: the ``moe-1.6b`` preset with CUDA graphs,
versions published into GPU slots by a ``GpuPublisher`` in this process (the learner's side, the preset's weights
and half of them in turn) and copied by the engine's worker over CUDA IPC, as a generator on the learner's host takes them. No
learner trains here: the figures are the swap's own (pause, in-worker load, copy), not a loop's.

Each way a version goes into use (``vllm.swap``: pause, core, boundary; then ``follow-core``, the engine core
following the versions itself, ``vllm.follow="core"``; ``--modes``) takes ``--swaps`` versions in turn on the same
engine, generating all along: per mode the pause, the copy, the time from the version's publish to
its use, and the tokens generated meanwhile; ``applied_p50_vs_pause`` and ``tokens_per_s_vs_pause`` are each mode's
ratios to ``pause`` in the same run.

    python3 scripts/gpu/vllm_swap.py --json OUT.json [--swaps 30] [--modes pause,core,boundary]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import platform
import statistics
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


async def run(args: argparse.Namespace) -> dict[str, Any]:
    import numpy as np
    import redis.asyncio as aioredis
    import torch
    from safetensors.torch import load_file

    from actors.generator.config import VLLMEngineConfig
    from actors.generator.engine import SamplingParams
    from actors.generator.vllm_engine import VLLMEngine
    from async_rl.model.config import ModelConfig
    from async_rl.model.presets import save_pretrained_dir
    from async_rl.run.names import Names
    from async_rl.servers.control import ControlPlane
    from async_rl.servers.embedded import start_nats, start_redis
    from async_rl.weights.config import PublisherConfig
    from async_rl.weights.gpu.publisher import GpuPublisher, local_slots
    from async_rl.weights.gpu.reader import GpuReader

    root = Path(tempfile.mkdtemp(prefix="arl-vllm-swap-"))
    model_dir = save_pretrained_dir(root / "a", preset=args.model, seed=0, dtype="bfloat16")
    server, nats = start_redis(), start_nats()
    redis = aioredis.Redis.from_url(server.url)
    control = await ControlPlane(nats.url, name="vllm-swap-bench").connect()  # the versions' announcements
    t0 = time.perf_counter()
    engine = await asyncio.to_thread(VLLMEngine, VLLMEngineConfig(
        model=ModelConfig(name=str(model_dir), dtype="bfloat16"), max_batch_prompts=args.prompts,
        max_num_seqs=args.prompts, max_model_len=256, gpu_memory_utilization=args.gpu_memory_utilization,
        stop_on_eos=False))  # fmt: skip
    await engine.ready()
    startup_s = time.perf_counter() - t0
    a = {k: v.cuda() for k, v in load_file(str(model_dir / "model.safetensors")).items()}
    weights = [a, {k: v * 0.5 for k, v in a.items()}]  # B: other values, the same layout (values do not matter here)
    names = Names(prefix=f"swap-{uuid.uuid4().hex[:8]}")
    cfg = PublisherConfig(gpu_dtype="bfloat16")
    pub = GpuPublisher(redis, names, cfg, local_slots("cuda:0", cfg), control=control)
    await pub.clean()
    reader = GpuReader(redis, names, None)
    copier = engine.gpu_copier()
    assert copier is not None
    rng = np.random.default_rng(0)
    prompts = [rng.integers(4, 22, 16).astype(np.int32) for _ in range(args.prompts)]
    params = SamplingParams(max_new_tokens=200, temperature=1.0, mask_special_tokens=False)
    await engine.generate(prompts[:8], SamplingParams(max_new_tokens=16, mask_special_tokens=False))  # warm-up
    done = asyncio.Event()
    calls: list[tuple[float, float, int]] = []  # (start, end, tokens) of each generate call

    async def generating() -> None:
        while not done.is_set():
            t = time.perf_counter()
            out = await engine.generate(prompts, params)
            calls.append((t, time.perf_counter(), sum(int(c.token_ids.size) for group in out for c in group)))

    def rate(t1: float, t2: float) -> float:
        """Tokens a second from ``t1`` to ``t2``: each call's tokens spread evenly over its own span (a call of 128
        prompts of 200 tokens takes seconds: counted when it ends, it fell into the wrong mode's window)."""
        return sum(n * max(0.0, min(b, t2) - max(a, t1)) / (b - a) for a, b, n in calls if b > a) / (t2 - t1)

    gen = asyncio.ensure_future(generating())
    modes: dict[str, Any] = {}
    version = 0
    ms = 1e3
    try:
        await asyncio.sleep(1.0)  # generation under way
        for mode in args.modes.split(","):
            follow = mode == FOLLOW_CORE  # the engine core follows the versions itself (vllm.follow="core")
            engine.config = dataclasses.replace(engine.config, swap="boundary" if follow else mode,
                                                follow="core" if follow else "front")  # fmt: skip
            if follow:
                await _start_follower(engine, names, server.url, nats.url)
            pauses, loads, copies, applied = [], [], [], []
            t1 = time.perf_counter()
            for _ in range(args.swaps):
                version += 1
                tensors = weights[version % 2]
                assert await pub.offer(version, lambda t=tensors: t.items())
                await pub.wait_idle()  # committed and announced
                t_pub, t_pub_unix = time.perf_counter(), time.time()
                if follow:
                    at, pause = await _followed(engine, version)
                    applied.append(at - t_pub_unix)
                    pauses.append(pause)
                else:
                    await reader.fetch(version, copy=copier)
                    engine.stage_copied(version)
                    assert await engine.wait_applied(version, 60.0), engine.last_stage_error
                    applied.append(time.perf_counter() - t_pub)
                    pauses.append(engine.last_swap_pause_s)
                    loads.append(engine.last_load_s)
                    copies.append(engine.last_stage_s)
                await asyncio.sleep(args.interval_s)
            modes[mode] = {
                "swaps": len(pauses),
                "swap_pause_ms": {"p50": _p(pauses, 0.5) * ms, "p95": _p(pauses, 0.95) * ms, "max": max(pauses) * ms},
                "load_ms": {"p50": _p(loads, 0.5) * ms, "p95": _p(loads, 0.95) * ms} if loads else None,
                "copy_ms": {"p50": _p(copies, 0.5) * ms, "p95": _p(copies, 0.95) * ms} if copies else None,
                "published_to_applied_ms": {"p50": _p(applied, 0.5) * ms, "p95": _p(applied, 0.95) * ms},
                "window_s": (t1, time.perf_counter()),
                "mean_pause_ms": statistics.fmean(pauses) * ms,
            }  # fmt: skip
            print(mode, json.dumps(modes[mode]), flush=True)
    finally:
        done.set()
        await gen  # the last call ends after the last window: every window's calls are in
        await engine.close()
        await control.close()
        await redis.aclose()
        server.stop()
        nats.stop()
    for r in modes.values():
        r["generated_tokens_per_s"] = rate(*r.pop("window_s"))
    base = modes.get("pause")
    for r in modes.values():
        if base is not None:
            r["applied_p50_vs_pause"] = r["published_to_applied_ms"]["p50"] / base["published_to_applied_ms"]["p50"]
            r["tokens_per_s_vs_pause"] = r["generated_tokens_per_s"] / base["generated_tokens_per_s"]
    return {
        "bench": "vllm_swap", "machine": f"{torch.cuda.get_device_name(0)}; {platform.platform()}",
        "model": args.model, "prompts": args.prompts, "interval_s": args.interval_s, "swap_load": engine.swap_load,
        "startup_s": round(startup_s, 1), "modes": modes,
    }  # fmt: skip


FOLLOW_CORE = "follow-core"
"""The mode in which the engine core follows the versions itself (``vllm.follow="core"``): the version's announcement
on NATS is all this process sends; the applied time is the engine core's own, from its report."""


async def _start_follower(engine: Any, names: Any, redis_url: str, nats_url: str) -> None:
    """The engine core's follower on this run (as a generator with ``vllm.follow="core"`` starts it)."""
    from actors.generator.config import GeneratorConfig, WeightSyncConfig
    from async_rl.config.configurable import to_dict
    from async_rl.run.config import RunConfig

    cfg = GeneratorConfig(engine="vllm", generator_id="vllm-swap-bench", vllm=engine.config,
                          run=RunConfig(prefix=names.prefix, redis_url=redis_url, nats_url=nats_url),
                          weight_sync=WeightSyncConfig(first_version_timeout_s=0))  # fmt: skip
    await engine.core_call("arl_follow_start", to_dict(cfg))


async def _followed(engine: Any, version: int, timeout_s: float = 60.0) -> tuple[float, float]:
    """The engine core's unix time of the swap to ``version`` and the last load's GPU seconds known, from its
    reports (asked every 2 ms)."""
    deadline, pause = time.monotonic() + timeout_s, 0.0
    while time.monotonic() < deadline:
        r = await engine.core_call("arl_follow_report")
        if r["error"] is not None or r["load_error"]:
            raise RuntimeError(f"the engine core's follower: {r['error'] or r['load_error']}")
        pause = r["pauses"][-1] if r["pauses"] else pause
        for v, at in r["swaps"]:
            if int(v) == version:
                return float(at), pause
        await asyncio.sleep(0.002)
    raise TimeoutError(f"the engine core did not take version {version} within {timeout_s} s")


def main() -> None:
    import logging

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")  # the engine's swap lines
    p = argparse.ArgumentParser(description="Time the vLLM engine's weight swaps on one GPU while it generates.")
    p.add_argument("--json", required=True, help="where the summary goes")
    p.add_argument("--model", default="moe-1.6b", help="a preset (default moe-1.6b)")
    p.add_argument("--swaps", type=int, default=30, help="versions swapped in (default 30)")
    p.add_argument("--prompts", type=int, default=128, help="prompts generating meanwhile, 200 tokens each")
    p.add_argument("--interval-s", type=float, default=0.3, help="seconds between versions (default 0.3)")
    p.add_argument("--modes", default="pause,core,boundary,follow-core",
                   help="vllm.swap modes, in turn, and follow-core (vllm.follow=core); default all four")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.45, help="vLLM's share of the GPU")
    args = p.parse_args()
    out = asyncio.run(run(args))
    print(json.dumps(out, indent=1))
    Path(args.json).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
