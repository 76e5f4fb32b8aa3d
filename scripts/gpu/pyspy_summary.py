"""Summarise a py-spy raw profile (``py-spy record -f raw --threads``) into a few KB of text: a device call brings back
at most 8 files of 16 MiB, and 25 s of a busy process is already 17 MB raw.
  python3 scripts/gpu/pyspy_summary.py RAW [--top 120] > SUMMARY.txt
Prints the samples per thread, the functions by inclusive and by own samples (line numbers dropped), and the most
frequent stacks (their innermost frames)."""

from __future__ import annotations

import argparse
import collections
import re

LINE = re.compile(r" \(([^()]*?):\d+\)$")


def frame_name(frame: str) -> str:
    """``func (path/to/file.py:123)`` as ``func (file.py)``."""
    m = LINE.search(frame)
    return f"{frame[: m.start()]} ({m.group(1).rsplit('/', 1)[-1]})" if m else frame


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("raw")
    p.add_argument("--top", type=int, default=120)
    p.add_argument("--depth", type=int, default=12, help="innermost frames kept of each stack in the stack table")
    args = p.parse_args()
    threads: collections.Counter[str] = collections.Counter()
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    stacks: collections.Counter[str] = collections.Counter()
    total = 0
    with open(args.raw) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            n = int(count)
            total += n
            frames = stack.split(";")
            head = [fr for fr in frames if fr.startswith(("thread ", "process "))]
            body = [frame_name(fr) for fr in frames if not fr.startswith(("thread ", "process "))]
            threads[" ".join(head)] += n
            for name in set(body):
                inclusive[name] += n
            if body:
                own[body[-1]] += n
            stacks[" <- ".join(reversed(body[-args.depth :]))] += n
    print(f"samples {total}")
    for title, table, k in (("threads", threads, 40), ("inclusive", inclusive, args.top), ("own", own, args.top),
                            ("stacks (innermost first)", stacks, args.top // 2)):  # fmt: skip
        print(f"== {title}")
        for name, n in table.most_common(k):
            print(f"{n:7d} {100 * n / max(total, 1):5.1f}%  {name}")


if __name__ == "__main__":
    main()
