"""Host-side (cProfile) time of one Megatron train step, to find what keeps the GPU waiting.

    PYTHONPATH=. python scripts/megatron/profile_step.py [--preset qwen3-30b-a3b-slice] [--recompute] [--top N]

Without ``--preset``: the benchmark's small MoE (8 layers, hidden 1024, 32 experts top-4, 2 x 8 x 1024 tokens).
With one: that ``bench backends`` preset's model and step (its lengths cut into micro-batches as the learner cuts
them). ``bench backends --profile`` gives the device side (GPU busy share, kernels by kind).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time

import torch


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default=None, help="a bench backends preset (backend_shapes.SHAPE_PRESETS)")
    ap.add_argument("--recompute", action="store_true")
    ap.add_argument("--top", type=int, default=30)
    args = ap.parse_args()
    from actors.commands.bench.backend_shapes import SHAPE_PRESETS, sequence_lengths
    from actors.commands.bench.backends import step_micro_batches
    from actors.learner.megatron.backend import MegatronBackend
    from actors.learner.megatron.config import MegatronConfig
    from actors.learner.megatron.toy import build_hf, nll_loss, toy_config

    if args.preset:
        p = SHAPE_PRESETS[args.preset]
        cfg = toy_config(num_layers=p["layers"], dense_first=p["dense_first"], vocab_size=p["vocab"],
                         hidden_size=p["hidden"], num_experts=p["experts"], top_k=p["top_k"], moe_ffn=p["moe_ffn"],
                         heads=p["heads"], kv_heads=p["kv_heads"], head_dim=p["head_dim"],
                         max_len=max(p["seq"], 1024))  # fmt: skip
        lengths = sequence_lengths(p["sequences"], distribution=p["lengths"], min_len=p["min_seq"], max_len=p["seq"])
        budget = p["micro_batch_tokens"]
    else:
        cfg = toy_config(num_layers=8, vocab_size=32768, hidden_size=1024, num_experts=32, top_k=4, moe_ffn=512,
                         heads=16, kv_heads=4, head_dim=64, max_len=1024)  # fmt: skip
        lengths, budget = [1024] * 16, 8 * 1024
    hf = build_hf(cfg, dtype=torch.bfloat16, device="cuda")
    _, mbs = step_micro_batches(hf, lengths, budget)
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    del hf
    torch.cuda.empty_cache()
    meg = MegatronBackend(MegatronConfig(dtype="bfloat16", recompute=args.recompute, lr=1e-5), cfg, sd)
    for _ in range(2):
        meg.train_step(mbs, nll_loss, replay_routes=True)
    torch.cuda.synchronize()
    prof = cProfile.Profile()
    t0 = time.perf_counter()
    prof.enable()
    meg.train_step(mbs, nll_loss, replay_routes=True)
    torch.cuda.synchronize()
    prof.disable()
    print(f"step wall {1e3 * (time.perf_counter() - t0):.1f} ms (under cProfile), {len(mbs)} micro-batches")
    for key in ("tottime", "cumulative"):
        print(f"--- by {key}")
        pstats.Stats(prof).strip_dirs().sort_stats(key).print_stats(args.top)


if __name__ == "__main__":
    main()
