"""CPU accounting of a benchmark from /proc: seconds used by given processes, and the machine's ticks."""

from __future__ import annotations

import os


def process_cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system, every thread) used so far by the processes ``pids`` (gone ones count 0)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as fh:
                fields = fh.read().rpartition(")")[2].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime (fields 14 and 15 of proc(5))
    return total / os.sysconf("SC_CLK_TCK")


def cpu_times() -> tuple[int, int, int]:
    """Machine-wide CPU ticks: all, idle (idle + iowait), softirq (the kernel's packet processing)."""
    with open("/proc/stat") as fh:
        vals = [int(x) for x in fh.readline().split()[1:]]
    return sum(vals), vals[3] + vals[4], vals[6]
