"""Every rank publishes its own pieces into its own GPU slots; a reader in another process assembles them bit for bit,
and so does a reader of the host transport, fed from every rank's slot on rank 0's GPU.

    torchrun --nproc-per-node 2 scripts/megatron/check_gpu_export.py --ep 2 --out OUT/gpu-export-ep2.json
    torchrun --nproc-per-node 1 scripts/megatron/check_gpu_export.py --out OUT/gpu-export-1.json   (one rank: its own pieces too)

A toy Qwen3-MoE (8 experts, the first layer dense) in bfloat16 under the given layout, leader and followers as the
learner runs them. Rank 0 publishes versions through the GPU path with every rank filling its own slots
(``MegatronWeights.gpu_export``: no gather), a reader process (``tests/gpu/ipc_reader.py``) maps every rank's
buffers over CUDA IPC, checks the checksums and assembles the tensors on its GPU; they must equal the gathered
export (``export_weights``) bit for bit, before and after optimizer steps. The same versions go to the host transport
(Redis) from rank 0's copy of every rank's slot, encoded on its GPU (a delta where that pays: ``--lr 1e-5`` moves few
bf16 weights a step), and a host-transport reader must get the gathered export bit for bit too; ``--cpu-encode``:
encoded on the CPU instead (``publisher.gpu_encode=false``). Exit code 0 when every check holds.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--lr", type=float, default=1e-2)
    ap.add_argument("--cpu-encode", action="store_true")
    ap.add_argument("--dist-opt", action="store_true", help="learner.megatron.distributed_optimizer=true")
    ap.add_argument("--out", type=Path, required=True)
    args = ap.parse_args()
    from actors.learner.megatron.backend import MegatronBackend
    from actors.learner.megatron.config import MegatronConfig
    from actors.learner.megatron.toy import build_hf, make_batch, nll_loss, toy_config

    cfg = toy_config(num_layers=4, dense_first=True)
    hf = build_hf(cfg, device="cuda")
    # With tensor parallelism (and, for MoE training, megatron's required sequence parallelism) the experts are cut by
    # it too, and rank_export cannot cut transformers' fused expert tensors that way (the learner would gather instead,
    # and say so): per-expert names, as the learner advises.
    mcfg = MegatronConfig(tensor_parallel=args.tp, sequence_parallel=args.tp > 1, pipeline_parallel=args.pp,
                          expert_parallel=args.ep, fused_experts_export=args.tp == 1, dtype="bfloat16",
                          router_replay=False, lr=args.lr, distributed_optimizer=args.dist_opt)  # fmt: skip
    sd = {k: v.detach().to(torch.bfloat16).cpu() for k, v in hf.state_dict().items()}
    meg = MegatronBackend(mcfg, hf.config, sd)
    if torch.distributed.get_rank() != 0:
        meg.follow()
        meg.close()
        return 0
    try:
        res = asyncio.run(_lead(meg, make_batch(cfg, [64] * 4, seed=3), nll_loss, args))
    finally:
        meg.close()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(res, indent=1))
    print(json.dumps(res))
    return 0 if res["ok"] else 1


async def _lead(meg, mb, loss, args) -> dict:  # type: ignore[no-untyped-def]
    import redis.asyncio as aioredis

    from async_rl.run.names import Names
    from async_rl.servers.embedded import ensure_servers
    from async_rl.weights import WeightPublisher, WeightReader
    from async_rl.weights.background import BackgroundPublisher
    from async_rl.weights.config import PublisherConfig
    from async_rl.weights.gpu.publisher import GpuPublisher
    from async_rl.weights.redis_transport import RedisTransport

    servers = ensure_servers(None, None)
    redis = aioredis.Redis.from_url(servers.redis_url)
    names = Names(prefix=f"gpu-export-{os.getpid()}")
    pcfg = PublisherConfig(gpu_bucket_bytes=1 << 20, bucket_bytes=1 << 20, gpu_encode=not args.cpu_encode)
    export = meg.gpu_export(pcfg)
    host = BackgroundPublisher(WeightPublisher(redis, RedisTransport(servers.redis_url, names), names, pcfg))
    pub = GpuPublisher(redis, names, pcfg, export, host=host)
    host_reader = WeightReader(redis, RedisTransport(servers.redis_url, names), names)
    held = None
    machine = " + ".join(torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count()))
    res: dict = {"machine": machine, "layout": {"tp": args.tp, "pp": args.pp, "ep": args.ep}, "lr": args.lr,
                 "host_encoded_on": "cpu" if args.cpu_encode else "gpu", "versions": [], "ok": True}  # fmt: skip
    try:
        for version in (1, 2, 3, 4):
            if version > 1:
                meg.train_step([mb], loss, replay_routes=False)
            t0 = time.perf_counter()
            assert await pub.offer(version, meg.snapshot_source)
            block_s = time.perf_counter() - t0
            await pub.wait_idle()
            await host.wait_idle()
            want = dict(meg.export_weights())
            fed = export.whole is not None  # rank 0 holds every rank's slot (one host): the host transport fed from it
            host_bad: list[str] = ["not fed from the GPU slots"]
            host_kind = None
            if fed:
                got_host = await host_reader.fetch(version, held)
                held, host_kind = got_host, got_host.manifest.kind
                host_bad = sorted(k for k in want if k not in got_host.tensors or not torch.equal(
                    got_host.tensors[k].cpu().view(torch.uint8), want[k].contiguous().cpu().view(torch.uint8)))  # fmt: skip
                host_bad += sorted(set(got_host.tensors) - set(want))
            out = args.out.with_suffix(f".v{version}.pt")
            env = {**os.environ, "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
            proc = await asyncio.to_thread(
                subprocess.run, [sys.executable, "-m", "tests.gpu.ipc_reader", servers.redis_url, names.prefix,
                                 "cuda:0", str(out), "--version", str(version)],
                cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)  # fmt: skip
            if proc.returncode != 0:
                res["ok"] = False
                res["versions"].append({"version": version, "reader_error": proc.stderr[-2000:]})
                break
            got = torch.load(out, weights_only=True)
            bad = sorted(k for k in want if k not in got["tensors"] or not torch.equal(
                got["tensors"][k].cpu().view(torch.uint8), want[k].contiguous().cpu().view(torch.uint8)))  # fmt: skip
            extra = sorted(set(got["tensors"]) - set(want))
            res["versions"].append({"version": version, "tensors": len(want), "mismatched": bad[:10],
                                    "unexpected": extra[:10], "offer_block_s": round(block_s, 4),
                                    "reader_total_s": round(got["total_s"], 4), "host_kind": host_kind,
                                    "host_mismatched": host_bad[:10]})  # fmt: skip
            res["ok"] = res["ok"] and not bad and not extra and not host_bad
            out.unlink()
        slots = export.slots  # every rank's (DistributedGpuSlots) or, with one rank, its own (GpuSlots)
        res["ranks_buckets"] = getattr(slots, "counts", None) or [len(slots.bucket_sizes)]
        res["host_records"] = [{"version": r.version, "kind": r.kind, "bytes_sent": r.bytes_sent,
                                "latency_s": round(r.latency_s, 4)} for r in host.take_records()]  # fmt: skip
    finally:
        await pub.aclose()
        await redis.aclose()
        servers.stop()
    return res


if __name__ == "__main__":
    sys.exit(main())
