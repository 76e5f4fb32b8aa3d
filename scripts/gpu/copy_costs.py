"""Where a GPU version's copy goes on a generator's GPU: its parts one at a time, with the GPU idle and while it is
busy with memory-bound work as decoding is (docs/gpus.md, "Why versions took 0.13-0.20 s").

moe-5b's 10.1 GB in 1 GB buckets, half on each of two source GPUs (the learner's two ranks), copied onto a third (a
generator's) in one process, as ``copy_buckets`` does it: every bucket on one destination stream (before
2026-11-28), then each source's buckets on a stream of their own; then with each bucket's wsum64 after its copy; then
also with its assembly (one more copy of the bucket on the destination). Each with the destination idle and with a
stream of memory-bound work beside it (a read and a write of LOAD_GB a kernel, in a loop).

    python3 scripts/gpu/copy_costs.py --json OUT/copy-costs.json     # four GPUs: sources 0 and 1, destination 2
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import threading
import time

import torch

from async_rl.weights.gpu.checksum import wsum64

GB = 1 << 30


def _busy(device: torch.device, stop: threading.Event, gb: float) -> None:
    """Memory-bound kernels on ``device`` until ``stop`` (a stream of its own)."""
    torch.cuda.set_device(device)
    a = torch.empty(int(gb * GB) // 2, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    stream = torch.cuda.Stream(device)
    with torch.cuda.stream(stream):
        while not stop.is_set():
            for _ in range(8):
                torch.mul(a, 1.0001, out=b)
            stream.synchronize()


def _run(sources: list[list[torch.Tensor]], dst: list[torch.Tensor], extra: list[torch.Tensor], streams: int,
         checksum: bool, assemble: bool, priority: int = 0) -> float:  # fmt: skip
    device = dst[0].device
    main = torch.cuda.Stream(device, priority=priority)
    side = [torch.cuda.Stream(device, priority=priority) for _ in range(len(sources) - 1)] if streams > 1 else []
    order = [main, *side] if streams > 1 else [main] * len(sources)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    main.wait_stream(torch.cuda.current_stream(device))
    for s in side:
        s.wait_stream(main)
    i = 0
    sums = []
    for on, bucket_list in zip(order, sources, strict=True):
        with torch.cuda.stream(on):
            for src in bucket_list:
                dst[i].copy_(src, non_blocking=True)
                if checksum:
                    sums.append(wsum64(dst[i]))
                if assemble:
                    extra[i].copy_(dst[i])
                i += 1
    for s in side:
        main.wait_stream(s)
    main.synchronize()
    return time.perf_counter() - t0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", required=True)
    ap.add_argument("--total-gb", type=float, default=10.1)
    ap.add_argument("--bucket-gb", type=float, default=1.0)
    ap.add_argument("--load-gb", type=float, default=4.0)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    n = torch.cuda.device_count()
    if n < 3:
        raise SystemExit(f"copy_costs.py needs three GPUs (two sources, one destination), {n} visible")
    dev = [torch.device("cuda", i) for i in range(3)]
    per_source = args.total_gb / 2
    sizes = [int(args.bucket_gb * GB)] * int(per_source // args.bucket_gb)
    if per_source % args.bucket_gb:
        sizes.append(int((per_source % args.bucket_gb) * GB) // 4096 * 4096)
    sources = [[torch.randint(0, 255, (s,), dtype=torch.uint8, device=d) for s in sizes] for d in dev[:2]]
    dst = [torch.empty(s, dtype=torch.uint8, device=dev[2]) for s in sizes * 2]
    extra = [torch.empty_like(t) for t in dst]
    torch.cuda.set_device(dev[2])
    total = sum(t.numel() for t in dst)
    variants: list[tuple] = [("one stream", 1, False, False), ("a stream a source", 2, False, False),
                ("a stream a source + checksums", 2, True, False),
                ("a stream a source + checksums + assembly", 2, True, True),
                ("high priority streams + checksums + assembly", 2, True, True, -1)]  # fmt: skip
    rows = []
    for load in (False, True):
        stop = threading.Event()
        busy = threading.Thread(target=_busy, args=(dev[2], stop, args.load_gb), daemon=True) if load else None
        if busy is not None:
            busy.start()
            time.sleep(1.0)
        for name, *how in variants:
            _run(sources, dst, extra, *how)  # warm
            times = [_run(sources, dst, extra, *how) for _ in range(args.reps)]
            s = statistics.median(times)
            rows.append({"variant": name, "destination_busy": load, "s": round(s, 5), "gb_per_s": round(total / s / 1e9, 1)})
            print(rows[-1], flush=True)
        stop.set()
        if busy is not None:
            busy.join()
    names = " + ".join(torch.cuda.get_device_name(i) for i in range(3))
    with open(args.json, "w") as f:
        json.dump({"bench": "copy_costs", "machine": f"{names}; {platform.platform()}", "bytes": total,
                   "buckets": len(dst), "load_gb": args.load_gb, "rows": rows}, f, indent=1)  # fmt: skip


if __name__ == "__main__":
    main()
