"""A separate reader process for the GPU weight-path tests: fetch GPU-held versions over CUDA IPC.

    python -m tests.gpu.ipc_reader REDIS_URL PREFIX DEVICE OUT.pt [--version V] [--loop] [--until V]

Fetches version V (default: the newest GPU-held one) into DEVICE and saves the tensors (on the CPU) to OUT.pt with
the version, timings and how many handles it mapped; ``--loop`` fetches the newest version again and again until
killed (a reader to SIGKILL in the middle of a copy); ``--until V``: fetches each newest version as it appears, as a
generator does, until it has V (both print a line a version read). Exit code 3 with the reason on stderr: the path is not usable here (IpcUnavailable).
"""

from __future__ import annotations

import argparse
import asyncio
import sys

import redis.asyncio as aioredis
import torch

from async_rl.run.names import Names
from async_rl.weights.config import ReaderConfig
from async_rl.weights.gpu.cuda_ipc import IpcUnavailable
from async_rl.weights.gpu.reader import GpuReader
from async_rl.weights.reader import WeightsError


async def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("redis_url")
    p.add_argument("prefix")
    p.add_argument("device")
    p.add_argument("out")
    p.add_argument("--version", type=int, default=-1)
    p.add_argument("--loop", action="store_true")
    p.add_argument("--until", type=int, default=-1)
    args = p.parse_args()
    redis = aioredis.Redis.from_url(args.redis_url)
    try:
        reader = GpuReader(redis, Names(prefix=args.prefix), args.device, ReaderConfig(gpu_lease_ttl_s=2.0))
        read: list[int] = []
        while True:
            version = args.version if args.version >= 0 else await reader.latest_version()
            if args.until >= 0 and (version is None or version in read):
                await asyncio.sleep(0.01)  # waiting for the next version
                continue
            if version is None:
                print("no GPU-held version", file=sys.stderr)
                return 2
            try:
                fetched = await reader.fetch(version)
            except WeightsError as exc:  # a slot reused under a looping reader: take the next one
                if not args.loop and args.until < 0:
                    raise
                print(f"skipped v{version}: {exc}", file=sys.stderr)
                continue
            read.append(fetched.version)
            if args.loop or args.until >= 0:
                print(f"read v{fetched.version} in {fetched.total_s * 1e3:.1f} ms", flush=True)
            if args.until >= 0 and fetched.version < args.until:
                continue
            if not args.loop:
                break
        torch.save({"version": fetched.version, "total_s": fetched.total_s, "transfer_s": fetched.transfer_s,
                    "read": read, "opened": reader.mapper.opened, "mapped": reader.mapper.mapped,
                    "tensors": {k: v.cpu() for k, v in fetched.tensors.items()}}, args.out)  # fmt: skip
        return 0
    except IpcUnavailable as exc:
        print(f"IpcUnavailable: {exc}", file=sys.stderr)
        return 3
    finally:
        await redis.aclose()


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
