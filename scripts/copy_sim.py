"""In-process copy-task training with the quickstart's pieces and no servers: for investigating stability.

The learner's own code paths (``build_samples``, ``make_micro_batches``, ``make_loss_fn``,
``TorchBackend.train_step``, ``CheckpointManager`` save/load) train the tiny MoE on the copy task;
samples come from the real :class:`TorchEngine` (routes recorded, replayed by the learner) running
weights ``staleness`` versions old, as a fully asynchronous run would. One JSON line per step goes to
``--out``: reward and its components, grad norm, IS ratios, lr, and the entropy of the learner's policy
on the sampled tokens.

    python3 scripts/copy_sim.py --steps 1500 --out /tmp/sim.jsonl learner overrides... (dotted key=value)

``--restart-at N`` saves a checkpoint at step N, builds a fresh backend and loads it (as a restarted
learner does); ``--staleness S`` samples with the weights of version ``v - S`` (uniform in [0, S] with
``--random-staleness``).
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

from actors.generator.config import TorchEngineConfig
from actors.generator.engine import SamplingParams
from actors.generator.torch_engine import TorchEngine
from actors.learner.batching import make_micro_batches
from actors.learner.build import build_backend
from actors.learner.checkpoint import CheckpointManager, LearnerState
from actors.learner.config import LearnerConfig
from actors.learner.loop import build_samples
from async_rl import tokenizer as tt
from async_rl.algorithms import make_loss_fn
from async_rl.configurable import load_config
from async_rl.tasks.config import build_task
from async_rl.wire_types import GroupRecord, Sample

QUICKSTART = ["model.name=tiny-moe", "task.name=copy", "batch_groups=32", "sampling.n=8", "torch.lr=1e-3",
              "torch.device=cpu"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--random-staleness", action="store_true")
    p.add_argument("--restart-at", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--probe", action="store_true", help="also log the step's update size, policy change and Adam state")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args(argv)
    torch.set_num_threads(args.threads)
    urls = ["run.redis_url=redis://127.0.0.1:1/0", "run.nats_url=nats://127.0.0.1:1"]
    cfg = load_config(LearnerConfig, None, [*urls, *QUICKSTART, *args.overrides])
    task = build_task(cfg.task)
    backend = build_backend(cfg)
    engine = TorchEngine(TorchEngineConfig(seed=args.seed, num_threads=args.threads, max_batch_sequences=512))
    rng = np.random.default_rng(args.seed)
    weights: collections.deque[tuple[int, dict[str, torch.Tensor]]] = collections.deque(maxlen=args.staleness + 1)
    weights.append((0, {k: v.clone() for k, v in backend.export_weights()}))
    engine.stage_weights(weights[0][1], 0)
    engine.wait_staged(0)
    sampling = SamplingParams(n=cfg.sampling.n, max_new_tokens=task.max_new_tokens, temperature=1.0,
                              stop_token_ids=(tt.EOS_ID,))  # fmt: skip
    version, index = 0, 0
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with args.out.open("w") as fh:
        for step in range(1, args.steps + 1):
            t0 = time.monotonic()
            lag = int(rng.integers(0, args.staleness + 1)) if args.random_staleness else args.staleness
            behaviour_version = max(0, version - lag)
            if engine.version < behaviour_version:  # weights of that version, as a generator would hold them
                tensors = dict(weights)[behaviour_version]
                engine.stage_weights(tensors, behaviour_version)
                engine.wait_staged(behaviour_version)
            specs = [task.prompt(index + i) for i in range(cfg.batch_groups)]
            index += cfg.batch_groups
            completions = asyncio.run(engine.generate([s.prompt_ids for s in specs], sampling))
            groups = []
            for spec, comps in zip(specs, completions, strict=True):
                samples = []
                for c in comps:
                    score = task.score(spec.metadata, c.token_ids)
                    samples.append(Sample(response_ids=c.token_ids, logprobs=c.logprobs, versions=c.versions,
                                          reward=score.reward, finish_reason=c.finish_reason, routes=c.routes,
                                          reward_info=dict(score.info)))  # fmt: skip
                groups.append(GroupRecord(group_id=spec.prompt_id, prompt_id=spec.prompt_id, generator_id="sim",
                                          created_at=time.time(), prompt_ids=spec.prompt_ids, samples=samples))  # fmt: skip
            samples, adv_metrics, rewards = build_samples(groups, cfg)
            mbs = make_micro_batches(samples, cfg.batching)
            if cfg.algorithm.needs_proximal_logprobs:
                for mb in mbs:
                    mb.proximal_logprobs = backend.forward_logprobs(mb, replay_routes=cfg.replay_routes).logprobs
            loss_fn = make_loss_fn(cfg.algorithm, learner_version=version)
            if args.probe:
                before = [p.detach().clone() for p in backend.model.parameters()]
                lp_before = [backend.forward_logprobs(mb, replay_routes=False).logprobs for mb in mbs]
            result = backend.train_step(mbs, loss_fn, replay_routes=cfg.replay_routes, with_entropy=True)
            probe = _probe(backend, mbs, before, lp_before) if args.probe else {}
            version += 1
            weights.append((version, {k: v.clone() for k, v in backend.export_weights()}))
            m = result.metrics
            info = collections.defaultdict(list)
            for g in groups:
                for s in g.samples:
                    for k, v in s.reward_info.items():
                        info[k].append(v)
            row = {"step": step, "reward": float(np.mean(rewards)), **{f"reward/{k}": float(np.mean(v))
                   for k, v in info.items()}, "grad_norm": result.grad_norm, "lr": m.get("lr"),
                   "entropy": m.get("entropy_mean"), "is_ratio_max": m.get("is_ratio_max"),
                   "cispo_ratio_max": m.get("cispo/ratio_max"), "clip_ratio": m.get("clip_ratio"),
                   "abs_log_ratio_max": m.get("abs_log_ratio_max"), "lag": lag,
                   "zero_std_groups": adv_metrics.get("adv_zero_std_groups_count"),
                   "resp_len": float(np.mean([s.response_ids.size for g in groups for s in g.samples])),
                   "adv_abs_mean": adv_metrics.get("adv_abs_mean"), **probe,
                   "step_s": time.monotonic() - t0}  # fmt: skip
            if step == args.restart_at:
                ckpt = CheckpointManager(args.out.parent / f"{args.out.stem}-ckpt", keep=1)
                ckpt.save(backend, LearnerState(step=step, version=version))
                backend = build_backend(cfg)
                ckpt.load(backend)
                row["restarted"] = True
            fh.write(json.dumps(row) + "\n")
            fh.flush()
            if step % 50 == 0 or step == 1:
                print(f"step {step} reward {row['reward']:.3f} exact {row.get('reward/exact', 0):.3f} "
                      f"ent {row['entropy']:.3f} gn {row['grad_norm']:.2f} isr {row['is_ratio_max']:.1f} "
                      f"{row['step_s']:.2f}s", flush=True)  # fmt: skip
    asyncio.run(engine.close())
    return 0


def _probe(backend, mbs, before, lp_before) -> dict[str, float]:  # type: ignore[no-untyped-def]
    """How far the step moved the weights and the policy, and what Adam's second moment looks like."""
    deltas = [(p.detach() - b).flatten() for p, b in zip(backend.model.parameters(), before, strict=True)]
    delta = torch.cat(deltas)
    out: dict[str, float] = {"upd_norm": float(delta.norm()), "upd_max": float(delta.abs().max())}
    shifts = []
    for mb, lp0 in zip(mbs, lp_before, strict=True):
        lp1 = backend.forward_logprobs(mb, replay_routes=False).logprobs
        shifts.append((lp1 - lp0)[mb.loss_mask].abs())
    shift = torch.cat(shifts)
    out.update(policy_shift_mean=float(shift.mean()), policy_shift_max=float(shift.max()))
    sq = [st["exp_avg_sq"].flatten() for st in backend.optimizer.state.values() if "exp_avg_sq" in st]
    if sq:
        v = torch.cat(sq).sqrt()
        out.update(adam_sqrt_v_median=float(v.median()), adam_sqrt_v_p10=float(v.quantile(0.1)))
    return out


if __name__ == "__main__":
    sys.exit(main())
