"""In-process copy-task training with the quickstart's pieces and no servers: for investigating stability.

A thin driver of :mod:`actors.learner.simulate` (the learner's own code paths; samples from the real
:class:`TorchEngine` running weights ``staleness`` versions old, as a fully asynchronous run would). One
JSON line per step goes to ``--out``: reward and its components, grad norm, IS ratios, log-ratio statistics,
lr, and the entropy of the learner's policy on the sampled tokens.

    python3 scripts/copy_sim.py --steps 1500 --out /tmp/sim.jsonl learner overrides... (dotted key=value)

``--restart-at N`` saves a checkpoint at step N, builds a fresh backend and loads it (as a restarted
learner does); ``--staleness S`` samples with the weights of version ``v - S`` (uniform in [0, S] with
``--random-staleness``); ``--mixed per_token|oldest`` makes responses span versions v - S and v.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from actors.learner.simulate import MIXED_MODES, SimConfig, Simulation

QUICKSTART = ["model.name=tiny-moe", "task.name=copy", "batch_groups=32", "sampling.n=8", "torch.lr=1e-3",
              "torch.device=cpu"]  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--staleness", type=int, default=1)
    p.add_argument("--random-staleness", action="store_true")
    p.add_argument("--mixed", choices=MIXED_MODES, default="off")
    p.add_argument("--restart-at", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--probe", action="store_true", help="also log the step's update size, policy change and Adam state")
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("overrides", nargs="*")
    args = p.parse_intermixed_args(argv)
    sim = Simulation(SimConfig(staleness=args.staleness, random_staleness=args.random_staleness, mixed=args.mixed,
                               seed=args.seed, threads=args.threads, overrides=[*QUICKSTART, *args.overrides]))  # fmt: skip
    args.out.parent.mkdir(parents=True, exist_ok=True)
    try:
        with args.out.open("w") as fh:
            for step in range(1, args.steps + 1):
                row = sim.step(probe=args.probe)
                if step == args.restart_at:
                    sim.restart(args.out.parent / f"{args.out.stem}-ckpt")
                    row["restarted"] = True
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                if step % 50 == 0 or step == 1:
                    print(f"step {step} reward {row['reward']:.3f} exact {row.get('reward/exact', 0):.3f} "
                          f"ent {row['entropy']:.3f} gn {row['grad_norm']:.2f} isr {row['is_ratio_max']:.1f} "
                          f"{row['step_s']:.2f}s", flush=True)  # fmt: skip
    finally:
        sim.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
