"""``async-rl bench backends``: learner-backend training throughput and MFU (Megatron vs torch) on one GPU.

Both backends train the same small Qwen3-MoE (seeded random init, bf16) on the same micro-batches
of random tokens with the same NLL loss and the same replayed expert routes (recorded from the HF
model), one optimizer step per iteration. Reported per backend and setting: median step time,
tokens/s (all tokens of the step, prompt + response) and model FLOPs utilisation:

    model FLOPs per token = 6 * (matmul parameters a token touches: attention, router, top-k experts or
                                 the dense MLP, LM head) + 6 * layers * seq_len * heads * head_dim  (causal attention)
    MFU = model FLOPs per second / the GPU's dense bf16 peak

Activation recompute adds a forward pass of hardware work that model FLOPs do not count (as is usual).
Needs a CUDA GPU and, for the Megatron rows, megatron-core (Python >= 3.12).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from async_rl.entry import first_sentence

PEAK_BF16_FLOPS = {"H100 PCIe": 756e12, "H100": 989.4e12, "H200": 989.4e12, "A100": 312e12}
"""Dense bf16 tensor-core peaks from the vendors' datasheets (SXM parts unless named), first match wins."""


def peak_flops(device_name: str) -> float | None:
    for key, value in PEAK_BF16_FLOPS.items():
        if all(part in device_name for part in key.split()):
            return value
    return None


def model_flops_per_token(cfg, seq_len: int) -> float:  # type: ignore[no-untyped-def]
    """Model (not hardware) FLOPs per trained token for a Qwen3-MoE-style config (forward + backward)."""
    h, hd = cfg.hidden_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * hd, cfg.num_key_value_heads * hd
    mlp_only = set(cfg.mlp_only_layers or [])
    n = 0
    for i in range(cfg.num_hidden_layers):
        n += h * q + 2 * h * kv + q * h
        if i in mlp_only or cfg.num_experts == 0:
            n += 3 * h * cfg.intermediate_size
        else:
            n += h * cfg.num_experts + cfg.num_experts_per_tok * 3 * h * cfg.moe_intermediate_size
    n += h * cfg.vocab_size
    attn = 6 * cfg.num_hidden_layers * seq_len * q
    return 6.0 * n + attn


def _profile(step, label: str) -> None:  # type: ignore[no-untyped-def]
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    print(f"--- top CUDA kernels, one step: {label}")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=12, max_name_column_width=70))


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
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--experts", type=int, default=32)
    ap.add_argument("--top-k", type=int, default=4)
    ap.add_argument("--moe-ffn", type=int, default=512)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq", type=int, default=1024, help="tokens per sequence")
    ap.add_argument("--batch", type=int, default=8, help="sequences per micro-batch")
    ap.add_argument("--micro-batches", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--backends", default="megatron,torch", help="comma-separated: megatron, torch")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one step of each backend")
    ap.add_argument("--default-settings-only", action="store_true",
                    help="only Megatron with SDPA + grouped experts and torch without checkpointing (large models: "
                         "the sequential-experts settings take minutes a step)")
    args = ap.parse_args(argv)
    for name in ("layers", "hidden", "experts", "top_k", "moe_ffn", "vocab", "seq", "batch", "micro_batches", "steps"):
        if getattr(args, name) <= 0:
            raise SystemExit(f"{prog}: --{name.replace('_', '-')} must be > 0")
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    if not backends or any(b not in ("megatron", "torch") for b in backends):
        raise SystemExit(f"{prog}: --backends takes megatron and/or torch, got {args.backends!r}")

    import torch

    if not torch.cuda.is_available():
        raise SystemExit(f"{prog}: needs a CUDA GPU")
    from actors.learner.megatron.toy import build_hf, hf_routes, make_batch, nll_loss, toy_config, with_routes

    cfg = toy_config(num_layers=args.layers, dense_first=True, vocab_size=args.vocab, hidden_size=args.hidden,
                     num_experts=args.experts, top_k=args.top_k, moe_ffn=args.moe_ffn, heads=args.hidden // 64,
                     kv_heads=max(1, args.hidden // 256), head_dim=64, max_len=max(args.seq, 1024))  # fmt: skip
    hf = build_hf(cfg, dtype=torch.bfloat16, device="cuda")
    total = args.micro_batches * args.batch * (args.seq - 8)
    mbs = []
    for i in range(args.micro_batches):
        mb = make_batch(cfg, [args.seq] * args.batch, seed=100 + i, step_num_tokens=total)
        mbs.append(with_routes(mb, hf_routes(hf, mb)))
    tokens = sum(int(m.attention_mask.sum()) for m in mbs)
    fpt = model_flops_per_token(cfg, args.seq)
    dev = torch.cuda.get_device_name()
    peak = peak_flops(dev)
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    rows = []

    def record(backend: str, setting: str, times: list[float]) -> None:
        med = statistics.median(times)
        tps = tokens / med
        row: dict[str, Any] = {"backend": backend, "setting": setting, "step_time_s_median": med, "step_times_s": times,
               "tokens_per_s": tps, "model_tflops_per_s": fpt * tps / 1e12,
               "mfu": (fpt * tps / peak) if peak else None,
               "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}  # fmt: skip
        rows.append(row)
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
            mcfg = MegatronConfig(dtype="bfloat16", recompute=recompute, lr=1e-5, attention=attention, experts=experts)
            meg = MegatronBackend(mcfg, hf.config, sd)
            times = _time_steps(
                lambda meg=meg: meg.train_step(mbs, nll_loss, replay_routes=True), args.warmup, args.steps
            )
            record("megatron", f"local spec, {attention} attn, {experts} experts, replay, recompute={recompute}", times)
            if args.profile and attention == "sdpa" and experts == "grouped" and not recompute:
                _profile(lambda meg=meg: meg.train_step(mbs, nll_loss, replay_routes=True), "megatron")
            meg.close()
            del meg
            torch.cuda.empty_cache()
    if "torch" in backends:
        from actors.learner.config import TorchBackendConfig
        from actors.learner.torch_backend import TorchBackend

        for ckpt in (False,) if args.default_settings_only else (False, True):
            torch.cuda.reset_peak_memory_stats()
            model = build_hf(cfg, dtype=torch.bfloat16, device="cuda")
            tb = TorchBackend(model, TorchBackendConfig(dtype="bfloat16", device="cuda", lr=1e-5,
                                                        gradient_checkpointing=ckpt))  # fmt: skip
            times = _time_steps(lambda tb=tb: tb.train_step(mbs, nll_loss, replay_routes=True), args.warmup, args.steps)
            record("torch", f"HF model, replay, recompute={ckpt}", times)
            if args.profile and not ckpt:
                _profile(lambda tb=tb: tb.train_step(mbs, nll_loss, replay_routes=True), "torch")
            del tb, model
            torch.cuda.empty_cache()
    result = {
        "bench": "backends", "date": datetime.now(UTC).isoformat(timespec="seconds"), "device": dev,
        "peak_bf16_flops": peak, "python": platform.python_version(), "torch": torch.__version__,
        "model": {"type": "qwen3_moe", "layers": args.layers, "hidden": args.hidden, "experts": args.experts,
                  "top_k": args.top_k, "moe_ffn": args.moe_ffn, "vocab": args.vocab, "dense_first_layer": True,
                  "experts_implementation": getattr(hf.config, "_experts_implementation", None)},
        "batch": {"micro_batches": args.micro_batches, "sequences_per_micro_batch": args.batch, "seq_len": args.seq,
                  "tokens_per_step": tokens},
        "model_flops_per_token": fpt, "results": rows,
    }  # fmt: skip
    try:
        import megatron.core

        result["megatron_core"] = megatron.core.__version__
    except ImportError:
        pass
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
