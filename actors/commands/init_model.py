"""``async-rl init-model OUT_DIR``: write a random-init preset model with a tokenizer as a Hugging Face directory.

Offline (nothing is downloaded): a preset (``tiny-moe``...) seeded, and the byte-level tokenizer (the default,
``--tokenizer bytes``: any text, e.g. reasoning-gym's questions, with a ChatML chat template, so text tasks render
their prompts as chats and the environment adapters take the directory as it is) or the toy char one (``chars``: the
digits of the toy tasks, no chat template). The directory is a ``model.name`` for the learner and the generators,
and ``task.tokenizer`` for text tasks.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from async_rl.model.config import DTYPE_NAMES, PRESET_NAMES


def main(argv: list[str] | None = None, prog: str = "async-rl init-model") -> int:
    p = argparse.ArgumentParser(prog=prog, description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path, metavar="OUT_DIR", help="directory to write")
    p.add_argument("--preset", default="tiny-moe", choices=PRESET_NAMES, help="model preset (default tiny-moe)")
    p.add_argument("--tokenizer", default="bytes", choices=("chars", "bytes"), help="default bytes")
    p.add_argument("--seed", type=int, default=0, help="initialisation seed")
    p.add_argument("--dtype", default="float32", choices=DTYPE_NAMES)
    args = p.parse_args(argv)
    from async_rl.model.presets import save_pretrained_dir

    out = save_pretrained_dir(args.out_dir, preset=args.preset, seed=args.seed, dtype=args.dtype,
                              tokenizer=args.tokenizer)  # fmt: skip
    template = ", with a chat template" if args.tokenizer == "bytes" else ""
    print(f"{prog}: wrote {out} ({args.preset}, {args.tokenizer} tokenizer{template}, seed {args.seed})")
    return 0
