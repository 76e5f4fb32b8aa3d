"""``async-rl export RUN_DIR OUT_DIR [--step N]``: a learner checkpoint as a Hugging Face model directory.

OUT_DIR gets config.json, generation_config.json, model.safetensors, the tokenizer and async_rl_export.json;
``transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)`` and vLLM load it offline. Either backend's
checkpoint (torch, Megatron); the weights are the ones the learner published for that version, bit for bit.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("run_dir", type=Path, metavar="RUN_DIR", help="the learner's run.run_dir")
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="directory to write the model into")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest)")
    args = p.parse_args(argv)
    if args.step is not None and args.step < 0:
        p.error("--step must be >= 0")
    if not args.run_dir.is_dir():
        p.error(f"RUN_DIR {str(args.run_dir)!r} is not a directory")
    return args


def main(argv: list[str] | None = None, prog: str = "async-rl export") -> int:
    args = parse_args(argv, prog)
    from actors.learner.hf_export import EXPORT_FILE, export_checkpoint

    try:
        out = export_checkpoint(args.run_dir, args.out_dir, step=args.step)
    except ValueError as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    info = json.loads((out / EXPORT_FILE).read_text())
    print(f"{prog}: wrote {out} (step {info['step']}, version {info['version']}, {info['backend']} backend, "
          f"{info['dtype']})")  # fmt: skip
    return 0
