"""The ``async-rl`` console script: one subcommand per role.

This module imports nothing heavy: each subcommand names a ``module:function`` that is
imported only when chosen and receives the remaining arguments (its own argparse parses
and validates them before anything heavy is imported).
"""

from __future__ import annotations

import importlib
import sys

COMMANDS: dict[str, tuple[str, str]] = {
    "quickstart": ("actors.commands.quickstart:main", "run the whole system on this machine on a tiny MoE and a toy task"),
    "learner": ("actors.learner.main:main", "train on the rollout stream and publish weights"),
    "generator": ("actors.generator.main:main", "turn prompts into scored groups (start any number, any time)"),
    "status": ("actors.commands.status:main", "live view of generators, streams, versions and staleness"),
    "audit": ("actors.commands.audit:main", "check that every issued prompt has a fate (trained, dropped, dead letter)"),
    "samples": ("actors.commands.samples:main", "the newest groups of a run's rollout stream as text (prompt, responses, rewards)"),
    "export": ("actors.commands.export:main", "write a checkpoint as a Hugging Face model directory (transformers, vLLM)"),
    "eval": ("actors.commands.evaluate:main", "score a checkpoint or an exported model on the task's held-out prompts"),
    "init-model": ("actors.commands.init_model:main", "write a random-init preset and an offline tokenizer as a HF directory"),
    "acl": ("actors.commands.acl:main", "write a Valkey/Redis ACL file: least privilege per role of a run"),
    "serve": ("actors.commands.serve:main", "run Valkey and NATS (with a password) for processes on other hosts"),
    "env-serve": ("actors.commands.env_serve:main", "serve an environment over HTTP to task.name=http"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "buffer": ("actors.commands.bench.buffer:main", "rollout-stream throughput vs raw bytes and JSON encodings"),
    "weights": ("actors.commands.bench.weights:main", "weight publish / fetch / swap-pause through the transport"),
    "backends": ("actors.commands.bench.backends:main", "learner backend tokens/s and MFU (Megatron vs torch, GPU)"),
    "fanout": ("actors.commands.bench.fanout:main", "one weight version to 1-16 simulated hosts: redis, direct, relay"),
    "async": ("actors.commands.bench.sync_vs_async:main", "asynchronous vs synchronous RL to a reward, real processes"),
    "loop": ("actors.commands.bench.loop:main", "the whole loop with real processes, N steps, a summary JSON (GPU too)"),
    "staleness": ("actors.commands.bench.staleness:main", "learning vs exact staleness S, per off-policy method (CPU)"),
    "generate": ("actors.commands.bench.generate:main", "engine tokens/s side by side: torch, vLLM engine, plain vLLM (GPU)"),
    "publish": ("actors.commands.bench.publish:main", "training loop waiting on weight publishing: blocking vs background + deltas"),
}


def _usage() -> str:
    lines = ["usage: async-rl COMMAND [ARGS...]   (async-rl COMMAND --help for its arguments)", "", "commands:"]
    lines += [f"  {name:<12} {help_}" for name, (_, help_) in COMMANDS.items()]
    lines += [f"  bench {name:<6} {help_}" for name, (_, help_) in BENCHES.items()]
    return "\n".join(lines)


def _call(target: str, argv: list[str], prog: str) -> int:
    module_name, func_name = target.split(":")
    func = getattr(importlib.import_module(module_name), func_name)
    result = func(argv, prog=prog)
    return int(result or 0)


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    if args[0] in ("-V", "--version"):
        from async_rl import __version__

        print(__version__)
        return 0
    cmd, rest = args[0], args[1:]
    if cmd == "bench":
        if not rest or rest[0] not in BENCHES:
            print(_usage(), file=sys.stderr)
            print(f"\nasync-rl bench: choose one of {', '.join(BENCHES)}", file=sys.stderr)
            return 2
        return _call(BENCHES[rest[0]][0], rest[1:], prog=f"async-rl bench {rest[0]}")
    if cmd not in COMMANDS:
        print(_usage(), file=sys.stderr)
        print(f"\nasync-rl: unknown command {cmd!r}", file=sys.stderr)
        return 2
    return _call(COMMANDS[cmd][0], rest, prog=f"async-rl {cmd}")


if __name__ == "__main__":
    sys.exit(main())
