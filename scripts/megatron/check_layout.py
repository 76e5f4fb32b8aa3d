"""Run one Megatron parallel layout on a small MoE and compare it with the single-GPU reference.

    torchrun --nproc-per-node N scripts/megatron/check_layout.py --name pp2 --pp 2 --first-stage-layers 3 \
        --out OUT/pp2.json --ref OUT/ref.pt

Model: a 7-layer Qwen3-MoE (layer 0 dense, DeepSeek-style; 8 experts, top-2) in float32 with full
activation recompute and router replay. With the same seeded weights and batch on every layout:

* ``free``: logprobs with the model's own routing; ``replayed``: with the HF model's routes replayed;
  ``recorded``: with the routes this layout itself recorded, replayed: bit-exact on an unpadded batch
  (every row replayed), within ``--tol`` on a padded one (pad rows get dummy experts under replay);
* ``losses``: three optimizer steps (NLL, two micro-batches, replay on), losses and gradient norms;
* ``resume``: the layout's checkpoint loaded back after two more steps, and those two steps taken again: the same
  losses and gradient norms within ``--tol`` (the optimizer state, sharded with ``--dist-opt``, restored);
* ``export``: weights exported in HF names, reloaded into a fresh transformers model, logprobs
  through the torch backend compared with the layout's own; the layout's checkpoint (every rank's file and
  layout), read back on the host as ``async-rl export`` does, equals that export bit for bit;
* timing: step time and tokens/s of further steps (bf16 is not used: these are correctness runs).

``--save-ref PATH`` (single GPU) writes the reference; ``--ref PATH`` compares against it within
``--tol`` (float32; see tests/gpu/test_megatron_backend.py for the justification of 2e-4).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--name", required=True)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--cp", type=int, default=1)
    ap.add_argument("--sp", action="store_true")
    ap.add_argument("--first-stage-layers", type=int, default=None)
    ap.add_argument("--last-stage-layers", type=int, default=None)
    ap.add_argument("--layers", type=int, default=7)
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--save-ref", type=Path, default=None)
    ap.add_argument("--ref", type=Path, default=None)
    ap.add_argument("--tol", type=float, default=2e-4)
    ap.add_argument("--timed-steps", type=int, default=5)
    ap.add_argument("--follow", action="store_true", help="leader/followers: rank 0 drives, the others follow()")
    ap.add_argument("--dist-opt", action="store_true", help="learner.megatron.distributed_optimizer=true")
    args = ap.parse_args()

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    from actors.learner.config import TorchBackendConfig
    from actors.learner.megatron.backend import MegatronBackend
    from actors.learner.megatron.config import MegatronConfig
    from actors.learner.megatron.toy import build_hf, hf_routes, make_batch, nll_loss, toy_config, with_routes
    from actors.learner.torch_backend import TorchBackend

    cfg = toy_config(num_layers=args.layers, dense_first=True)
    hf = build_hf(cfg, device="cuda")
    lengths = [96, 80, 64, 51, 40, 33, 25, 12]
    mb = make_batch(cfg, lengths, seed=11)
    mb = with_routes(mb, hf_routes(hf, mb))
    mcfg = MegatronConfig(tensor_parallel=args.tp, pipeline_parallel=args.pp, expert_parallel=args.ep,
                          context_parallel=args.cp, sequence_parallel=args.sp,
                          first_stage_layers=args.first_stage_layers, last_stage_layers=args.last_stage_layers,
                          dtype="float32", recompute=True, router_replay=True, lr=1e-3,
                          distributed_optimizer=args.dist_opt)  # fmt: skip
    sd = {k: v.detach().float().cpu() for k, v in hf.state_dict().items()}
    meg = MegatronBackend(mcfg, hf.config, sd)
    rank = torch.distributed.get_rank()
    if args.follow and rank != 0:
        meg.follow()  # runs rank 0's calls until rank 0 closes the backend
        meg.close()  # a no-op after follow() returned: what the learner entry point does
        torch.distributed.barrier()
        return 0
    res: dict = {"name": args.name, "world_size": torch.distributed.get_world_size(), "device": torch.cuda.get_device_name(),
                 "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep, "cp": args.cp, "sp": args.sp,
                            "first_stage_layers": args.first_stage_layers, "last_stage_layers": args.last_stage_layers,
                            "distributed_optimizer": args.dist_opt},
                 "stage_moe_layers": meg.moe_idx}  # fmt: skip
    free = meg.forward_logprobs(mb, replay_routes=False).logprobs
    replayed = meg.forward_logprobs(mb, replay_routes=True).logprobs
    rec = meg.record_routes(mb)
    recorded = meg.forward_logprobs(with_routes(mb, rec), replay_routes=True).logprobs
    free_again = meg.forward_logprobs(mb, replay_routes=False).logprobs
    # Without padding, recorded routes cover every row, so replay must reproduce the forward bit for bit.
    # (With padding, pad rows get dummy experts under replay but their own routing in the free forward,
    # which changes per-expert GEMM row counts and so, on some layouts, the last bit of real tokens.)
    flat = make_batch(cfg, [64] * 4, seed=12)
    flat_free = meg.forward_logprobs(flat, replay_routes=False).logprobs
    flat_rec = meg.forward_logprobs(with_routes(flat, meg.record_routes(flat)), replay_routes=True).logprobs
    res["recorded_replay_unpadded_max_abs_diff"] = float((flat_rec - flat_free).abs().max())
    res["recorded_replay_max_abs_diff"] = float((recorded - free).abs().max())
    # Run-to-run noise of this layout's kernels: replay is "exact" when it is no further from the
    # recorded forward than a repeat of that forward is (0.0 where the layout is deterministic).
    res["free_repeat_max_abs_diff"] = float((free_again - free).abs().max())
    half = len(lengths) // 2
    from async_rl.algorithms.batch import MicroBatch

    def part(sl: slice) -> MicroBatch:
        return MicroBatch(input_ids=mb.input_ids[sl], attention_mask=mb.attention_mask[sl], loss_mask=mb.loss_mask[sl],
                          behaviour_logprobs=mb.behaviour_logprobs[sl], advantages=mb.advantages[sl],
                          token_versions=mb.token_versions[sl], routes=mb.routes[sl], step_num_tokens=mb.step_num_tokens,
                          step_num_sequences=mb.step_num_sequences)  # fmt: skip

    mbs = [part(slice(0, half)), part(slice(half, None))]
    steps = [meg.train_step(mbs, nll_loss, replay_routes=True) for _ in range(3)]
    res["losses"] = [s.metrics["nll_per_token"] for s in steps]
    res["grad_norms"] = [s.grad_norm for s in steps]
    after = meg.forward_logprobs(mb, replay_routes=True).logprobs
    exported = dict(meg.export_weights())
    # The checkpoint of this layout, read back on the host as `async-rl export` does: the same bits as the export.
    # (torchrun's run id: the same on every rank, new for every run; follow mode: followers take rank 0's path)
    ckpt = Path(os.environ.get("TMPDIR", "/tmp")) / f"layout-ckpt-{args.name}-{os.environ.get('TORCHELASTIC_RUN_ID')}"
    meg.save(ckpt)
    if rank == 0:
        from actors.learner.megatron.checkpoint_reader import read_global_weights
        from actors.learner.megatron.convert import mcore_to_hf

        back = mcore_to_hf(read_global_weights(ckpt, meg.arch), meg.arch,
                           fused_experts=mcfg.fused_experts_export)  # fmt: skip
        res["checkpoint_export_equal"] = sorted(back) == sorted(exported) and all(
            back[k].dtype == v.dtype and torch.equal(back[k].cpu(), v) for k, v in exported.items())  # fmt: skip
    # Resume: two steps on from the checkpoint, then the checkpoint loaded back and the same two steps again.
    on = [meg.train_step(mbs, nll_loss, replay_routes=True) for _ in range(2)]
    meg.load(ckpt)
    again = [meg.train_step(mbs, nll_loss, replay_routes=True) for _ in range(2)]
    res["resume_losses"] = [[s.metrics["nll_per_token"] for s in r] for r in (on, again)]
    res["resume_max_abs_diff"] = max(max(abs(a.metrics["nll_per_token"] - b.metrics["nll_per_token"]),
                                         abs(a.grad_norm - b.grad_norm)) for a, b in zip(on, again, strict=True))  # fmt: skip
    if rank == 0:
        from transformers import Qwen3MoeForCausalLM

        fresh = Qwen3MoeForCausalLM(cfg)
        fresh.load_state_dict(exported, strict=True)
        tb = TorchBackend(fresh, TorchBackendConfig(dtype="float32", device="cuda"))
        reloaded = tb.forward_logprobs(mb, replay_routes=True).logprobs
        m = mb.attention_mask.clone()
        m[:, 0] = False
        res["export_reload_max_abs_diff"] = float((after - reloaded).abs()[m].max())
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.timed_steps):
        meg.train_step(mbs, nll_loss, replay_routes=True)
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / args.timed_steps
    res["step_time_s"] = dt
    res["tokens_per_s"] = int(mb.attention_mask.sum()) / dt
    if rank == 0:
        tensors = {"free": free, "replayed": replayed, "after": after, "losses": torch.tensor(res["losses"])}
        if args.save_ref is not None:
            torch.save(tensors, args.save_ref)
        checks = {"recorded_replay_exact": res["recorded_replay_unpadded_max_abs_diff"] == 0.0,
                  "recorded_replay_padded": res["recorded_replay_max_abs_diff"] < args.tol,
                  "export_reload": res["export_reload_max_abs_diff"] < args.tol,
                  "checkpoint_export": res["checkpoint_export_equal"],
                  "resume": res["resume_max_abs_diff"] < args.tol}  # fmt: skip
        if args.ref is not None:
            ref = torch.load(args.ref)
            m = mb.attention_mask.clone()
            m[:, 0] = False
            for k in ("free", "replayed", "after"):
                d = float((tensors[k] - ref[k]).abs()[m].max())
                res[f"vs_ref_{k}_max_abs_diff"] = d
                checks[f"vs_ref_{k}"] = d < args.tol
            dl = float((tensors["losses"] - ref["losses"]).abs().max())
            res["vs_ref_losses_max_abs_diff"] = dl
            checks["vs_ref_losses"] = dl < args.tol
        res["checks"] = checks
        res["passed"] = all(checks.values())
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(res, indent=2))
        print(json.dumps(res, indent=2))
    meg.close()
    torch.distributed.barrier()
    if not args.follow:
        from actors.learner.megatron.launch import shutdown

        shutdown()
    return 0 if rank != 0 or res["passed"] else 1


if __name__ == "__main__":
    sys.path.insert(0, os.getcwd())
    sys.exit(main())
