"""Where one training step's time goes on the GPU: kernel time by kind, the GPU's busy share, launches, host time.

:func:`profile_step` runs a step under ``torch.profiler`` (CPU and CUDA activities) and returns a JSON-ready
summary, which ``bench backends --profile`` stores in each profiled row and prints:

* ``wall_s``: the step's wall time under the profiler (the profiler adds host overhead per op);
* ``gpu_busy_s``: the union of the step's kernel intervals (overlapping streams counted once), and
  ``gpu_busy_frac`` = ``gpu_busy_s / wall_s``: well under 1 means the host (launches, synchronisations) paces
  the step, not the kernels;
* ``kernels``: kernel launches; ``syncs``: host waits on the device (``cudaStreamSynchronize``,
  ``cudaDeviceSynchronize``, ``cudaEventSynchronize``, blocking copies to the host);
* ``by_kind``: kernel time per kind (:data:`KINDS`, first match on the lower-cased kernel name wins),
  seconds and share of the kernel time;
* ``top``: the most expensive kernels (name, calls, total seconds);
* ``ops``: the ATen ops whose kernels took the most GPU time, by op and input shapes (:func:`top_ops`): where a
  kind of kernel in ``top`` comes from (which matmul, which copy). No Python stacks: recording them slowed the
  profiled step by a third (505 against 368 ms on two H200s) and they came back empty for most GPU ops.

:func:`sync_sites` runs the step once more under torch's CUDA sync debug mode and counts the host waits by the code
that caused them (the innermost frame outside torch): where ``syncs`` come from, which the profiler cannot say.

:func:`categorise` and :func:`top_ops` are tested on the CPU; the rest needs a CUDA device.
"""

from __future__ import annotations

import re
import traceback
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

KINDS: tuple[tuple[str, str], ...] = (
    ("nccl", r"nccl"),
    ("attention", r"flash|fmha|attention|sdpa|softmax_warp"),
    ("grouped_gemm", r"grouped|group_gemm"),
    ("gemm", r"gemm|cutlass|xmma|nvjet|sm90_|sm100_|cublas|matmul|splitk"),
    ("copy", r"memcpy|memset|copy|cat_|catarray|fill|index|gather|scatter|sort|radix|permute|transpose"),
    ("reduction", r"reduce|norm|sum|logsumexp|max_|min_|argmax|cumsum|scan"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise|triton"),
)
"""Kernel kinds by name pattern, in matching order; anything else is ``other``."""

_SYNC_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize")


def categorise(name: str) -> str:
    """The kind (:data:`KINDS`) of a kernel by its name, ``other`` when none matches."""
    low = name.lower()
    for kind, pattern in KINDS:
        if re.search(pattern, low):
            return kind
    return "other"


def busy_time(intervals: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals (overlaps counted once)."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def device_intervals(events: Any) -> tuple[list[tuple[str, float, float]], int]:
    """A profile's kernels (name, start s, end s) and its host syncs. A range torch marks on the device around a
    collective (``nccl:all_to_all``, a user annotation spanning its kernel) is not a kernel: counted, it doubled every
    collective's time."""
    kernels: list[tuple[str, float, float]] = []
    syncs = 0
    for ev in events:
        dev_type = str(getattr(ev, "device_type", ""))
        if dev_type.endswith("CUDA") and ev.time_range.elapsed_us() > 0:
            if not (getattr(ev, "is_user_annotation", False) or ev.name.startswith("nccl:")):
                kernels.append((ev.name, ev.time_range.start / 1e6, ev.time_range.end / 1e6))
        elif ev.name in _SYNC_CALLS or (ev.name == "cudaMemcpyAsync" and ev.time_range.elapsed_us() > 50):
            syncs += 1
    return kernels, syncs


def profile_step(step: Callable[[], object], *, top: int = 30) -> dict[str, Any]:
    """Profile one call of ``step`` (a training step, a batch's generation) and summarise it (see the module doc)."""
    import time

    import torch
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()  # without CUDA (a CPU test): host ops only, no kernels
    activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA] if cuda else [ProfilerActivity.CPU]
    if cuda:
        torch.cuda.synchronize()
    with profile(activities=activities, record_shapes=True) as prof:
        t0 = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        wall = time.perf_counter() - t0
    kernels, syncs = device_intervals(prof.events())
    by_name: dict[str, list[float]] = {}
    by_kind: dict[str, float] = {}
    for name, s, e in kernels:
        entry = by_name.setdefault(name, [0, 0.0])
        entry[0] += 1
        entry[1] += e - s
        kind = categorise(name)
        by_kind[kind] = by_kind.get(kind, 0.0) + (e - s)
    kernel_s = sum(by_kind.values())
    busy = busy_time([(s, e) for _, s, e in kernels])
    return {
        "wall_s": wall,
        "gpu_busy_s": busy,
        "gpu_busy_frac": busy / wall if wall > 0 else None,
        "kernel_s": kernel_s,
        "kernels": len(kernels),
        "syncs": syncs,
        "by_kind": {
            k: {"s": v, "share": v / kernel_s if kernel_s else 0.0}
            for k, v in sorted(by_kind.items(), key=lambda kv: -kv[1])
        },  # fmt: skip
        "top": [
            {"name": n[:120], "calls": int(c), "s": t}
            for n, (c, t) in sorted(by_name.items(), key=lambda kv: -kv[1][1])[:top]
        ],  # fmt: skip
        "ops": top_ops(prof.events(), top=top),
    }


SYNC_WARNING = "synchronizing CUDA operation"
"""What torch's CUDA sync debug mode warns at every host wait on the device."""


class SyncSites:
    """Host syncs counted by site: the innermost frame of the warning's stack outside torch, ``warnings`` and this
    module (``path:line function``, the path's last three parts). Syncs of a backward pass are warned when it returns,
    at the call of ``backward``."""

    counts: dict[str, int]

    def __init__(self) -> None:
        self.counts = {}

    def note(self, stack: list[traceback.FrameSummary]) -> None:
        skip = ("/torch/", "/warnings.py", __file__)
        frame = next((f for f in reversed(stack) if not any(s in f.filename for s in skip)), stack[-1])
        site = f"{'/'.join(frame.filename.split('/')[-3:])}:{frame.lineno} {frame.name}"
        self.counts[site] = self.counts.get(site, 0) + 1

    def top(self, n: int = 15) -> list[dict[str, Any]]:
        """The ``n`` sites with the most syncs, most first."""
        return [{"site": k, "calls": c} for k, c in sorted(self.counts.items(), key=lambda kv: -kv[1])[:n]]


@contextmanager
def recording_sync_sites() -> Iterator[SyncSites]:
    """Every :data:`SYNC_WARNING` warned inside goes to the yielded :class:`SyncSites` (other warnings as before)."""
    sites = SyncSites()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        shown = warnings.showwarning

        def show(message: Any, category: Any, filename: str, lineno: int, file: Any = None, line: Any = None) -> None:
            if SYNC_WARNING in str(message):
                sites.note(traceback.extract_stack()[:-1])
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        yield sites


def sync_sites(step: Callable[[], object], *, top: int = 15) -> dict[str, Any]:
    """Run ``step`` once under torch's CUDA sync debug mode (``warn``): ``{"syncs": total, "sites": [{"site",
    "calls"}]}`` (:class:`SyncSites`). Needs a CUDA device; a collective step is run on every rank."""
    import torch

    torch.cuda.synchronize()
    before = torch.cuda.get_sync_debug_mode()
    with recording_sync_sites() as sites:
        torch.cuda.set_sync_debug_mode("warn")
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(before)
    torch.cuda.synchronize()
    return {"syncs": sum(sites.counts.values()), "sites": sites.top(top)}


def top_ops(events: Any, *, top: int = 30, time_attr: str = "self_device_time_total") -> list[dict[str, Any]]:
    """The ``top`` ATen ops (``aten::``) of a profile's ``events()`` (recorded with ``record_shapes``) by their own
    kernels' time (``time_attr``, microseconds), grouped by op and input shapes: op, calls, seconds, shapes (the
    first three tensor inputs)."""
    groups: dict[tuple, list] = {}
    for ev in events:
        t = float(getattr(ev, time_attr, 0.0) or 0.0)
        if not ev.name.startswith("aten::") or t <= 0:
            continue
        shapes = tuple(tuple(x) for x in (ev.input_shapes or []) if x)[:3]
        entry = groups.setdefault((ev.name, shapes), [0, 0.0])
        entry[0] += 1
        entry[1] += t / 1e6
    rows = [{"op": op, "calls": c, "s": t, "shapes": [list(x) for x in shapes]}
            for (op, shapes), (c, t) in groups.items()]  # fmt: skip
    rows.sort(key=lambda r: -r["s"])
    return rows[:top]


def format_profile(label: str, p: dict[str, Any]) -> str:
    """A few lines for the terminal."""
    lines = [
        f"--- profile, one step: {label}: wall {p['wall_s'] * 1e3:.1f} ms, GPU busy {p['gpu_busy_s'] * 1e3:.1f} ms "
        f"({100 * (p['gpu_busy_frac'] or 0):.0f}%), {p['kernels']} kernels, {p['syncs']} host syncs",
        "    by kind: " + ", ".join(f"{k} {v['s'] * 1e3:.1f} ms" for k, v in p["by_kind"].items()),
    ]
    lines += [f"    {t['s'] * 1e3:8.2f} ms {t['calls']:5d}x  {t['name'][:90]}" for t in p["top"][:15]]
    if p.get("sync_sites"):
        lines += [f"    host syncs by site ({p['sync_sites']['syncs']} in all):"]
        lines += [f"    {x['calls']:5d}x  {x['site']}" for x in p["sync_sites"]["sites"]]
    lines += ["    ops:"] + [
        f"    {o['s'] * 1e3:8.2f} ms {o['calls']:5d}x  {o['op']} {o['shapes']}"[:200] for o in p.get("ops", [])[:15]
    ]
    return "\n".join(lines)
