"""``async-rl bench backends``: learner-backend training throughput and MFU (Megatron vs torch) on one GPU.

Both backends train the same Qwen3-MoE (seeded random init, bf16) on the same micro-batches of random
tokens with the same NLL loss and the same replayed expert routes (recorded from the HF model), one
optimizer step per iteration. The shape is set by flags or a ``--preset`` (``qwen3-30b-a3b-slice``:
Qwen3-30B-A3B's layers, a few of them, on sequences of 2-8k tokens of lognormal lengths); the step's
sequence lengths are drawn from ``--lengths`` and cut into right-padded micro-batches under
``--micro-batch-tokens`` as the learner cuts them (:mod:`actors.commands.bench.backend_shapes`).
Reported per backend and setting: median step time, tokens/s (the real tokens of the step, prompt +
response, no padding), model FLOPs utilisation, peak GPU memory and ``padding_frac`` (the share of
the step's token slots that are padding):

    model FLOPs per token = 6 * (matmul parameters a token touches: attention, router, top-k experts or
                                 the dense MLP, LM head) + 6 * layers * n * heads * head_dim  (causal attention,
                                 n the token's sequence length: sum n^2 / sum n over the step)
    MFU = model FLOPs per second / (the GPU's dense bf16 peak x GPUs)

Activation recompute adds a forward pass of hardware work that model FLOPs do not count (as is usual).
Needs a CUDA GPU and, for the Megatron rows, megatron-core (Python >= 3.12).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any

from actors.commands.bench.backend_shapes import (
    LENGTH_DISTRIBUTIONS,
    SHAPE_PRESETS,
    model_flops_per_token,
    padding_frac,
    sequence_lengths,
)
from actors.commands.bench.step_profile import format_profile, profile_step, sync_sites
from async_rl.entry import first_sentence

PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
"""Dense bf16 tensor-core peaks from the vendors' datasheets (SXM parts unless named), first match wins."""


def peak_flops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_FLOPS.items():
        if all(part in device_name for part in key.split()):
            return value
    return None


def step_micro_batches(hf, lengths: list[int], micro_batch_tokens: int) -> tuple[list[list[int]], list[Any]]:  # type: ignore[no-untyped-def]
    """The step's micro-batches of random tokens of these lengths (8-token prompts, the rest response), cut as the
    learner cuts them, each with the routes ``hf`` (a transformers Qwen3-MoE) takes on it; and their lengths."""
    from actors.learner.batching import group_by_budget
    from actors.learner.config import BatchingConfig
    from actors.learner.megatron.toy import hf_routes, make_batch, with_routes

    cut = group_by_budget(lengths, BatchingConfig(micro_batch_tokens=micro_batch_tokens))
    groups = [[lengths[i] for i in g] for g in cut]
    total = sum(n - 8 for n in lengths)  # step-global response tokens: the loss's denominator
    mbs = []
    for i, g in enumerate(groups):
        mb = make_batch(hf.config, g, seed=100 + i, step_num_tokens=total)
        mbs.append(with_routes(mb, hf_routes(hf, mb)))
    return groups, mbs


def _time_steps(step, warmup: int, steps: int) -> list[float]:  # type: ignore[no-untyped-def]
    import torch

    for _ in range(warmup):
        step()
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        step()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return times


def main(argv: list[str] | None = None, prog: str = "async-rl bench backends") -> int:
    ap = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    ap.add_argument("--json", type=Path, default=None, help="write the results here")
    ap.add_argument("--preset", choices=sorted(SHAPE_PRESETS), default=None,
                    help="a named model and step shape (backend_shapes.py); flags given here override its values")
    ap.add_argument("--layers", type=int, default=None, help="decoder layers (default 8)")
    ap.add_argument("--hidden", type=int, default=None, help="hidden size (default 1024)")
    ap.add_argument("--experts", type=int, default=None, help="experts per MoE layer (default 32)")
    ap.add_argument("--top-k", type=int, default=None, help="experts per token (default 4)")
    ap.add_argument("--moe-ffn", type=int, default=None, help="expert FFN width (default 512)")
    ap.add_argument("--heads", type=int, default=None, help="query heads (default hidden / 64)")
    ap.add_argument("--kv-heads", type=int, default=None, help="KV heads (default max(1, hidden / 256))")
    ap.add_argument("--head-dim", type=int, default=None, help="head width (default 64)")
    ap.add_argument("--vocab", type=int, default=None, help="vocabulary (default 32768)")
    ap.add_argument("--dense-first", type=int, choices=(0, 1), default=None,
                    help="1: layer 0 is a dense MLP (default), 0: every layer MoE (Qwen3-30B-A3B)")
    ap.add_argument("--seq", type=int, default=None, help="tokens per sequence, the longest with --lengths (default 1024)")
    ap.add_argument("--lengths", choices=LENGTH_DISTRIBUTIONS, default=None,
                    help="sequence length distribution between --min-seq and --seq (default fixed: all --seq)")
    ap.add_argument("--min-seq", type=int, default=None, help="shortest sequence with --lengths uniform/lognormal")
    ap.add_argument("--length-seed", type=int, default=0, help="seed of the length draws")
    ap.add_argument("--batch", type=int, default=None, help="sequences per micro-batch with fixed lengths (default 8)")
    ap.add_argument("--micro-batches", type=int, default=None, help="micro-batches with fixed lengths (default 2)")
    ap.add_argument("--sequences", type=int, default=None,
                    help="sequences per step (default batch x micro-batches)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None,
                    help="padded-token budget per micro-batch, cut as the learner does (default batch x seq)")
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backends", default="megatron,torch", help="comma-separated: megatron, torch")
    ap.add_argument("--expert-parallel", type=int, default=1,
                    help="Megatron's expert parallelism; above 1 run under torchrun (e.g. torchrun --nproc-per-node 2 "
                         "-m actors.commands bench backends --backends megatron --expert-parallel 2): every rank "
                         "trains the same step, each micro-batch's rows split over the data-parallel ranks (give "
                         "--micro-batch-tokens room for one sequence per rank); rows then add world_size, "
                         "tokens_per_s_per_gpu, and MFU per GPU")
    ap.add_argument("--profile", action="store_true",
                    help="profile one step of each backend's first setting: GPU busy share, kernel time by kind, "
                         "top kernels (step_profile.py), printed and stored in the row")
    ap.add_argument("--default-settings-only", action="store_true",
                    help="only Megatron with SDPA + grouped experts and torch without checkpointing (large models: "
                         "the sequential-experts settings take minutes a step)")
    ap.add_argument("--logprob-chunk-tokens", default=None,
                    help="comma-separated values of the torch backend's learner.torch.logprob_chunk_tokens, a row "
                         "each (0: the full logits; default: the backend's default)")
    args = ap.parse_args(argv)
    defaults: dict[str, Any] = dict(layers=8, hidden=1024, experts=32, top_k=4, moe_ffn=512, head_dim=64, vocab=32768,
                                    dense_first=1, seq=1024, lengths="fixed", batch=8, micro_batches=2)  # fmt: skip
    preset = SHAPE_PRESETS[args.preset] if args.preset else {}
    for name, value in {**defaults, **preset}.items():
        if getattr(args, name, None) is None:
            setattr(args, name, value)
    args.heads = args.heads or args.hidden // 64
    args.kv_heads = args.kv_heads or max(1, args.hidden // 256)
    args.min_seq = args.min_seq or args.seq
    args.sequences = args.sequences or args.batch * args.micro_batches
    args.micro_batch_tokens = args.micro_batch_tokens or args.batch * args.seq
    for name in ("layers", "hidden", "experts", "top_k", "moe_ffn", "heads", "kv_heads", "head_dim", "vocab", "seq",
                 "min_seq", "batch", "micro_batches", "sequences", "micro_batch_tokens", "steps"):  # fmt: skip
        if getattr(args, name) <= 0:
            raise SystemExit(f"{prog}: --{name.replace('_', '-')} must be > 0")
    if args.min_seq > args.seq or args.min_seq <= 8:
        raise SystemExit(f"{prog}: --min-seq must be in (8, --seq], got {args.min_seq}")
    try:
        chunk_sizes = [int(x) for x in (args.logprob_chunk_tokens or "").split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"{prog}: --logprob-chunk-tokens takes integers, got {args.logprob_chunk_tokens!r}") from None
    if any(c < 0 for c in chunk_sizes):
        raise SystemExit(f"{prog}: --logprob-chunk-tokens must be >= 0")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("megatron", "torch") for b in backends):
        raise SystemExit(f"{prog}: --backends takes megatron and/or torch, got {args.backends!r}")
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if args.expert_parallel <= 0 or world % args.expert_parallel:
        raise SystemExit(f"{prog}: --expert-parallel must divide the {world} process(es) torchrun started, got "
                         f"{args.expert_parallel}")  # fmt: skip
    if world > 1 and backends != ["megatron"]:
        raise SystemExit(f"{prog}: under torchrun ({world} processes) only --backends megatron runs (the torch backend "
                         "trains on one GPU)")  # fmt: skip
    if world > 1:
        args.default_settings_only = True  # one backend per process: megatron's groups are built once
    rank = int(os.environ.get("RANK", "0"))

    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{prog}: needs a CUDA GPU")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))  # under torchrun: this rank's GPU from the start
    from actors.learner.megatron.toy import build_hf, nll_loss, toy_config

    cfg = toy_config(num_layers=args.layers, dense_first=bool(args.dense_first), vocab_size=args.vocab,
                     hidden_size=args.hidden, num_experts=args.experts, top_k=args.top_k, moe_ffn=args.moe_ffn,
                     heads=args.heads, kv_heads=args.kv_heads, head_dim=args.head_dim,
                     max_len=max(args.seq, 1024))  # fmt: skip
    lengths = sequence_lengths(args.sequences, distribution=args.lengths, min_len=args.min_seq, max_len=args.seq,
                               seed=args.length_seed)  # fmt: skip
    hf = build_hf(cfg, dtype=torch.bfloat16, device="cuda")
    hf_config = hf.config
    experts_impl = getattr(hf_config, "_experts_implementation", None)
    groups, mbs = step_micro_batches(hf, lengths, args.micro_batch_tokens)
    tokens = sum(int(m.attention_mask.sum()) for m in mbs)  # real tokens (prompt + response), no padding
    pad = padding_frac(groups)  # one GPU: neither backend pads beyond the micro-batch's longest row
    fpt = model_flops_per_token(cfg, lengths)
    dev = torch.cuda.get_device_name()
    peak = peak_flops(dev)
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    del hf  # the backends build their own: keep the GPU for them
    torch.cuda.empty_cache()
    rows = []

    def record(backend: str, setting: str, times: list[float]) -> None:
        med = statistics.median(times)
        tps = tokens / med
        row: dict[str, Any] = {"backend": backend, "setting": setting, "step_time_s_median": med, "step_times_s": times,
               "tokens_per_s": tps, "model_tflops_per_s": fpt * tps / 1e12,
               "mfu": (fpt * tps / (peak * world)) if peak else None,
               "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30, "padding_frac": pad}  # fmt: skip
        if world > 1:
            row.update(world_size=world, expert_parallel=args.expert_parallel, tokens_per_s_per_gpu=tps / world)
        rows.append(row)
        if rank == 0:
            print(f"{backend:9s} {setting:62s} {med * 1e3:8.1f} ms/step {tps:10.0f} tok/s "
                  f"MFU {row['mfu'] if row['mfu'] is None else round(100 * row['mfu'], 1)}%", flush=True)  # fmt: skip

    if "megatron" in backends:
        from actors.learner.megatron.backend import MegatronBackend
        from actors.learner.megatron.config import MegatronConfig

        settings: tuple[tuple[Any, Any, bool], ...] = (("sdpa", "grouped", False), ("sdpa", "sequential", False), ("unfused", "sequential", False),
                    ("sdpa", "grouped", True))  # fmt: skip
        if args.default_settings_only:
            settings = settings[:1]
        for attention, experts, recompute in settings:
            torch.cuda.reset_peak_memory_stats()
            mcfg = MegatronConfig(dtype="bfloat16", recompute=recompute, lr=1e-5, attention=attention, experts=experts,
                                  expert_parallel=args.expert_parallel)  # fmt: skip
            meg = MegatronBackend(mcfg, hf_config, sd)
            times = _time_steps(
                lambda meg=meg: meg.train_step(mbs, nll_loss, replay_routes=True), args.warmup, args.steps
            )
            record("megatron", f"local spec, {attention} attn, {experts} experts, replay, recompute={recompute}", times)
            if args.profile and attention == "sdpa" and experts == "grouped" and not recompute:
                step = partial(meg.train_step, mbs, nll_loss, replay_routes=True)
                if rank == 0:  # the step is collective: the other ranks run it unprofiled
                    rows[-1]["profile"] = profile_step(step)
                else:
                    step()
                sites = sync_sites(step)  # every rank
                if rank == 0:
                    rows[-1]["profile"]["sync_sites"] = sites
                    print(format_profile("megatron", rows[-1]["profile"]), flush=True)
            meg.close()
            del meg
            torch.cuda.empty_cache()
    if "torch" in backends:
        from actors.learner.config import TorchBackendConfig
        from actors.learner.torch_backend import TorchBackend

        chunk_settings = chunk_sizes or [TorchBackendConfig().logprob_chunk_tokens]
        for ckpt in (False,) if args.default_settings_only else (False, True):
            for chunk in chunk_settings:
                torch.cuda.reset_peak_memory_stats()
                model = build_hf(cfg, dtype=torch.bfloat16, device="cuda")
                tb = TorchBackend(model, TorchBackendConfig(dtype="bfloat16", device="cuda", lr=1e-5,
                                                            gradient_checkpointing=ckpt, logprob_chunk_tokens=chunk))  # fmt: skip
                times = _time_steps(lambda tb=tb: tb.train_step(mbs, nll_loss, replay_routes=True), args.warmup,
                                    args.steps)  # fmt: skip
                logits = f"logprob chunks of {chunk}" if chunk else "full logits"
                record("torch", f"HF model, replay, recompute={ckpt}, {logits}", times)
                if args.profile and not ckpt and chunk == chunk_settings[0]:
                    step = partial(tb.train_step, mbs, nll_loss, replay_routes=True)
                    rows[-1]["profile"] = {**profile_step(step), "sync_sites": sync_sites(step)}
                    print(format_profile("torch", rows[-1]["profile"]), flush=True)
                del tb, model
                torch.cuda.empty_cache()
    result = {
        "bench": "backends", "date": datetime.now(UTC).isoformat(timespec="seconds"), "device": dev,
        "peak_bf16_flops": peak, "python": platform.python_version(), "torch": torch.__version__,
        "world_size": world, "expert_parallel": args.expert_parallel,
        "model": {"type": "qwen3_moe", "preset": args.preset, "layers": args.layers, "hidden": args.hidden,
                  "experts": args.experts, "top_k": args.top_k, "moe_ffn": args.moe_ffn, "heads": args.heads,
                  "kv_heads": args.kv_heads, "head_dim": args.head_dim, "vocab": args.vocab,
                  "dense_first_layer": bool(args.dense_first), "experts_implementation": experts_impl},
        "batch": {"micro_batches": len(groups), "sequences_per_micro_batch": max(len(g) for g in groups),
                  "seq_len": args.seq, "tokens_per_step": tokens, "lengths": args.lengths, "min_seq_len": args.min_seq,
                  "length_seed": args.length_seed, "micro_batch_tokens": args.micro_batch_tokens,
                  "sequence_lengths": [list(g) for g in groups], "padding_frac": pad},
        "model_flops_per_token": fpt, "results": rows,
    }  # fmt: skip
    try:
        import megatron.core

        result["megatron_core"] = megatron.core.__version__
    except ImportError:
        pass
    if args.json is not None and rank == 0:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
