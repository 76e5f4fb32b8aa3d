"""Host-side (cProfile) and device-side time of one Megatron train step on the benchmark's small MoE.

    PYTHONPATH=. python scripts/megatron/profile_step.py [--recompute]

The benchmark showed the GPU busy for ~130 ms of a ~600 ms step: this says where the host time goes.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from actors.learner.megatron.backend import MegatronBackend
    from actors.learner.megatron.config import MegatronConfig
    from actors.learner.megatron.toy import build_hf, hf_routes, make_batch, nll_loss, toy_config, with_routes

    cfg = toy_config(num_layers=8, vocab_size=32768, hidden_size=1024, num_experts=32, top_k=4, moe_ffn=512,
                     heads=16, kv_heads=4, head_dim=64, max_len=1024)  # fmt: skip
    hf = build_hf(cfg, dtype=torch.bfloat16)
    mbs = []
    for i in range(2):
        mb = make_batch(cfg, [1024] * 8, seed=100 + i, step_num_tokens=2 * 8 * 1016)
        mbs.append(with_routes(mb, hf_routes(hf, mb)))
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    meg = MegatronBackend(MegatronConfig(dtype="bfloat16", recompute=args.recompute, lr=1e-5), hf.config, sd)
    for _ in range(2):
        meg.train_step(mbs, nll_loss, replay_routes=True)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    meg.train_step(mbs, nll_loss, replay_routes=True)
    torch.cuda.synchronize()
    prof.disable()
    print(f"step wall {1e3 * (time.perf_counter() - t0):.1f} ms (under cProfile)")
    for key in ("tottime", "cumulative"):
        print(f"--- by {key}")
        pstats.Stats(prof).strip_dirs().sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
