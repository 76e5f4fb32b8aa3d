"""Shared plumbing of the process entry points: argument parsing, config loading, logging.

May import: config, process, tasks.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import sys
from pathlib import Path
from typing import Any, TypeVar

from async_rl.config.configurable import ConfigError, load_config, to_dict

T = TypeVar("T")


def first_sentence(doc: str | None) -> str:
    """The first sentence of a module's docstring, over as many lines as it takes (a command's ``--help``
    description: its first line alone may stop mid-sentence)."""
    text = " ".join((doc or "").split("\n\n")[0].split())
    m = re.search(r"(?<!e\.g)(?<!i\.e)\.(\s|$)", text)
    return text[: m.start() + 1] if m else text


class _KeysHelpParser(argparse.ArgumentParser):
    """An entry point's parser whose ``--help`` lists every key of ``keys_cls``: built only when help is printed
    (reading every config class's docstrings costs about 0.1 s, which a process that starts should not pay)."""

    keys_cls: type | None = None

    def format_help(self) -> str:
        if self.keys_cls is not None:
            from async_rl.config.keys import keys_overview

            self.epilog = (f"config keys, by section (KEY=VALUE, or [section] tables in --config):\n"
                           f"{keys_overview(self.keys_cls)}\n\n{self.prog} --help-keys lists each with its type, default "
                           f"and meaning.")  # fmt: skip
        return super().format_help()


def config_parser(prog: str, description: str, cls: type | None = None) -> argparse.ArgumentParser:
    """The parser of a role's entry point; with the role's config class ``cls`` its ``--help`` lists every key."""
    epilog = (f"Overrides are dotted config keys, e.g. run.redis_url=redis://host:6379/0 task.name=reverse; "
              f"{prog} --help-keys lists every key with its type, default and meaning.")  # fmt: skip
    parser = _KeysHelpParser(prog=prog, description=description, epilog=epilog,
                             formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.keys_cls = cls
    parser.add_argument("--config", type=Path, default=None, help="TOML config file")
    parser.add_argument("--help-keys", action="store_true",
                        help="list every config key (type, default, description) by section and exit")  # fmt: skip
    parser.add_argument("--print-config", action="store_true", help="print the resolved config as JSON and exit")
    parser.add_argument("--log-level", default="INFO", help="logging level (DEBUG, INFO, WARNING)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="config overrides")
    return parser


def public_config(cfg: Any) -> dict[str, Any]:
    """``to_dict(cfg)`` with the credentials of every URL field (``*_url``) redacted: what is printed, saved with
    the run and sent to wandb (passwords and tokens never are)."""
    from async_rl.process.lifecycle import redact_url

    def walk(d: Any) -> Any:
        if isinstance(d, dict):
            return {k: redact_url(v) if k.endswith("_url") and isinstance(v, str) else walk(v) for k, v in d.items()}
        return d

    return walk(to_dict(cfg))


def parse_config(cls: type[T], args: argparse.Namespace, prog: str) -> T:
    """Load and validate the config; a mistake exits with a one-line message naming the field."""
    if getattr(args, "help_keys", False):
        from async_rl.config.keys import render_keys

        print(render_keys(cls, prog))
        raise SystemExit(0)
    try:
        cfg = load_config(cls, args.config, args.overrides)
    except ConfigError as exc:
        hint = f" ({prog} --help-keys lists every key)" if str(exc).startswith("unknown config key") else ""
        print(f"{prog}: config error: {exc}{hint}", file=sys.stderr)
        raise SystemExit(2) from None
    if args.print_config:
        print(json.dumps(public_config(cfg), indent=2))
        raise SystemExit(0)
    return cfg


def check_task(task_cfg: Any, prog: str) -> Any:
    """Build the task once at config time: a reward that does not import, a JSONL file that does not parse, or text
    the tokenizer cannot encode exits 2 with one line, before any server is touched. Returns the task, which the
    process then uses (a dataset is loaded or generated once)."""
    from async_rl.tasks.config import build_task

    try:
        return build_task(task_cfg)
    except ValueError as exc:
        print(f"{prog}: config error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def check_device(device: str, key: str, prog: str) -> None:
    """A CUDA ``device`` on a host where torch sees no such GPU exits 2 with one line, at config time: before any
    server is contacted or a model loaded (else: ``AssertionError: Torch not compiled with CUDA enabled``, after
    joining the run). Only for devices torch itself will use in this process (not vLLM's, not Megatron's)."""
    if not device.startswith("cuda"):
        return
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    index = int(device.split(":", 1)[1]) if ":" in device else 0
    if index < count:
        return
    if count:
        why = f"torch sees {count} GPU{'s' if count > 1 else ''} here ({'cuda:0' if count == 1 else f'cuda:0 to cuda:{count - 1}'})"
    elif torch.version.cuda is None:
        why = f"this torch ({torch.__version__}) is built without CUDA"
    else:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES")
        why = "torch sees no GPU here" + (f" (CUDA_VISIBLE_DEVICES={visible!r})" if visible is not None else "")
    print(f"{prog}: config error: {key}={device}, but {why} (set {key}=cpu, or run on a host with that GPU)",
          file=sys.stderr)  # fmt: skip
    raise SystemExit(2)


def check_run_dir(run_dir: Path, prog: str, key: str = "run.run_dir") -> None:
    """Check now, before any server is contacted, that ``run_dir`` is or can be made a directory this user writes:
    one that cannot (a file in the way, no permission) exits 2 with one line naming the reason, instead of a
    traceback after the run's Redis state was touched. Nothing is created here (a learner refused later, e.g. by
    another learner's lease, leaves no trace)."""
    existing = next(p for p in [run_dir, *run_dir.parents] if p.exists() or p == p.parent)
    blocker = next((p for p in [existing, *existing.parents] if p.exists() and not p.is_dir()), None)
    if blocker is not None:
        why = f"{str(blocker)!r} is a file, not a directory"
    elif not os.access(existing, os.W_OK | os.X_OK):
        why = f"Permission denied: {existing}"
    else:
        return
    print(f"{prog}: config error: {key} {str(run_dir)!r} cannot be created: {why} (set {key} to a directory "
          "this user can write)", file=sys.stderr)  # fmt: skip
    raise SystemExit(2)


def setup_logging(level: str, name: str) -> None:
    logging.basicConfig(
        level=getattr(logging, str(level).upper(), logging.INFO),
        format=f"%(asctime)s {name} %(levelname)s %(name)s: %(message)s", datefmt="%H:%M:%S", stream=sys.stderr,
    )  # fmt: skip
    for noisy in ("httpx", "urllib3", "nats", "filelock"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


def resolved_config_path(run_dir: Path, name: str) -> Path:
    """Where :func:`save_resolved_config` keeps role ``name``'s config in a run directory (``learner-config.json``)."""
    return run_dir / f"{name}-config.json"


def save_resolved_config(cfg: Any, run_dir: Path, name: str) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = resolved_config_path(run_dir, name)
    path.write_text(json.dumps(public_config(cfg), indent=2))
    return path
