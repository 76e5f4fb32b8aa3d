"""NIXL against the GPU weight path's own CUDA IPC copy, for one weight version between two processes of one host.

Issue 25, item 4: adopt NIXL behind a ``nixl://`` scheme only if it is faster or simpler at equal safety, and record
the comparison either way. The NIXL wheel (``nixl-cu13``, 56 MiB) does not fit the 64 MiB a device call carries
beside the project's other wheels, and this script needs none of them (torch and numpy are in the GPU image), so it
runs in a call of its own:

    pip download --no-deps -d .whl-nixl nixl==1.5.1 nixl-cu13==1.5.1 --python-version 3.12 --only-binary=:all: \\
        --platform manylinux_2_28_x86_64                                  # here, once (carry [".whl-nixl"])
    pip install -q --no-deps --target /tmp/nx .whl-nixl/*.whl && \\
        PYTHONPATH=/tmp/nx:$PWD python3 scripts/gpu/nixl_vs_ipc.py --gb 3.3 --json $OUT/nixl-vs-ipc.json   # there
    python3 scripts/gpu/nixl_vs_ipc.py --dram --gb 0.05 --json /tmp/nixl-dram.json   # host memory: NIXL only, a check

A producer process fills a buffer with a known pattern and serves it both ways: exported once as a CUDA IPC handle
(:mod:`async_rl.weights.gpu.cuda_ipc`, what generators map today) and registered with a NIXL agent (UCX backend: its
``cuda_ipc`` / ``cuda_copy`` transports on one host). For each placement (the same GPU, then the other GPU when
there is one) a consumer process reads it into a buffer of its own: ``copy_`` from the mapped handle, and a NIXL
READ of the registered region; each timed over ``--reps`` after one warm-up and checked byte for byte against the
pattern. The JSON has ``bytes``, ``nixl_version``, and per placement ``cuda_ipc_s`` and ``nixl_read_s`` (medians),
``nixl_vs_cuda_ipc`` (their ratio: above 1 means NIXL is slower), and the one-time set-up of each
(``cuda_ipc_open_s``: mapping the handle; ``nixl_setup_s``: agent, registration, metadata, transfer handle).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import platform
import statistics
import time
from pathlib import Path
from typing import Any

PATTERN = 251
"""Byte ``i`` of the buffer is ``i % PATTERN`` (a prime, so no power-of-two stride hides a misplaced block)."""


def _pattern(nbytes: int, device: str) -> Any:
    if device == "cpu":
        import numpy as np

        return (np.arange(nbytes, dtype=np.int64) % PATTERN).astype(np.uint8)
    import torch

    return (torch.arange(nbytes, dtype=torch.int64, device=device) % PATTERN).to(torch.uint8)


def _reg(agent: Any, buf: Any, dram: bool) -> Any:
    if dram:
        import numpy as np

        return agent.register_memory(np.array([[buf.ctypes.data, buf.nbytes, 0]], dtype=np.uint64), "DRAM")
    return agent.register_memory(buf)


def producer(conn: Any, nbytes: int, device: str, dram: bool) -> None:
    """Hold the pattern, export it both ways, and serve until told to stop."""
    from nixl._api import nixl_agent, nixl_agent_config

    buf = _pattern(nbytes, "cpu" if dram else device)
    handle = None
    if not dram:
        from async_rl.weights.gpu.cuda_ipc import export

        handle = export(buf)
    agent = nixl_agent("producer", nixl_agent_config(backends=["UCX"]))
    reg = _reg(agent, buf, dram)
    where = (buf.ctypes.data, nbytes, 0) if dram else (buf.data_ptr(), nbytes, buf.device.index)
    conn.send({"meta": agent.get_agent_metadata(), "where": where, "ipc": handle})
    conn.recv()  # every consumer is done
    agent.deregister_memory(reg)


def consumer(conn: Any, meta: bytes, where: tuple[int, int, int], ipc: Any, nbytes: int, device: str, dram: bool,
             reps: int) -> None:  # fmt: skip
    """Read the producer's buffer into this process's own, both ways; send the timings."""
    from nixl._api import nixl_agent, nixl_agent_config

    out: dict[str, Any] = {"dst": "cpu" if dram else device}
    want = _pattern(nbytes, "cpu" if dram else device)
    if dram:
        import numpy as np

        dst = np.zeros(nbytes, dtype=np.uint8)

        def sync() -> None:
            return None

        def same() -> bool:
            return bool(np.array_equal(dst, want))
    else:
        import torch

        dst = torch.zeros(nbytes, dtype=torch.uint8, device=device)

        def sync() -> None:
            torch.cuda.synchronize(device)

        def same() -> bool:
            return bool(torch.equal(dst, want))

        from async_rl.weights.gpu.cuda_ipc import IpcMapper

        t0 = time.perf_counter()
        src = IpcMapper().open(ipc, nbytes)
        out["cuda_ipc_open_s"] = time.perf_counter() - t0
        times = []
        for _ in range(reps + 1):
            sync()
            t0 = time.perf_counter()
            dst.copy_(src, non_blocking=True)
            sync()
            times.append(time.perf_counter() - t0)
        out["cuda_ipc_s"] = statistics.median(times[1:])
        out["cuda_ipc_exact"] = same()
        dst.zero_()
        sync()
    t0 = time.perf_counter()
    agent = nixl_agent(f"consumer-{out['dst']}", nixl_agent_config(backends=["UCX"]))
    reg = _reg(agent, dst, dram)
    remote = agent.add_remote_agent(meta)
    mem = "DRAM" if dram else "VRAM"
    local_descs = agent.get_xfer_descs([(dst.ctypes.data, nbytes, 0)] if dram else dst, mem if dram else None)
    remote_descs = agent.get_xfer_descs([where], mem)
    xfer = agent.initialize_xfer("READ", local_descs, remote_descs, remote)
    out["nixl_setup_s"] = time.perf_counter() - t0
    times = []
    for _ in range(reps + 1):
        sync()
        t0 = time.perf_counter()
        state = agent.transfer(xfer)
        while state not in ("DONE", "ERR"):
            state = agent.check_xfer_state(xfer)
        sync()
        times.append(time.perf_counter() - t0)
        if state == "ERR":
            out["nixl_error"] = "transfer state ERR"
            break
    if "nixl_error" not in out:
        out["nixl_read_s"] = statistics.median(times[1:])
        out["nixl_exact"] = same()
        if "cuda_ipc_s" in out:
            out["nixl_vs_cuda_ipc"] = out["nixl_read_s"] / out["cuda_ipc_s"]
    agent.release_xfer_handle(xfer)
    agent.remove_remote_agent(remote)
    agent.deregister_memory(reg)
    conn.send(out)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=3.3, help="buffer size in GB (the 1.65B MoE's version: 3.3)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dram", action="store_true", help="host memory, NIXL only (a check of the script's NIXL use)")
    ap.add_argument("--json", type=Path, required=True)
    args = ap.parse_args()
    nbytes = int(args.gb * 1e9)
    ctx = mp.get_context("spawn")
    devices = ["cpu"]
    name = "host memory"
    if not args.dram:
        import torch

        devices = [f"cuda:{i}" for i in range(min(torch.cuda.device_count(), 2))]
        name = " + ".join(torch.cuda.get_device_name(i) for i in range(len(devices)))
    here, there = ctx.Pipe()
    prod = ctx.Process(target=producer, args=(there, nbytes, devices[0], args.dram))
    prod.start()
    served = here.recv()
    placements = []
    try:
        for dst in devices:
            a, b = ctx.Pipe()
            cons = ctx.Process(target=consumer, args=(b, served["meta"], served["where"], served["ipc"], nbytes, dst,
                                                      args.dram, args.reps))  # fmt: skip
            cons.start()
            got = a.recv()
            cons.join(60)
            placements.append({"src": devices[0], **got})
            print(json.dumps(placements[-1]))
    finally:
        here.send("done")
        prod.join(60)
    from importlib.metadata import version

    result = {"bench": "nixl_vs_ipc", "machine": f"{name}; {platform.platform()}", "bytes": nbytes,
              "reps": args.reps, "nixl_version": version("nixl"), "placements": placements}  # fmt: skip
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1))
    exact = all(p.get("nixl_exact", False) and p.get("cuda_ipc_exact", args.dram) for p in placements)
    return 0 if exact else 1


if __name__ == "__main__":
    raise SystemExit(main())
