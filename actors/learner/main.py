"""``async-rl learner``: train on the rollout stream of a run and publish weights (torchrun for Megatron)."""

from __future__ import annotations

import contextlib
import os
import sys
from typing import TYPE_CHECKING, Any

from async_rl.entry import (
    check_device,
    check_run_dir,
    check_task,
    config_parser,
    parse_config,
    save_resolved_config,
    setup_logging,
)

if TYPE_CHECKING:
    from actors.learner.config import LearnerConfig


def main(argv: list[str] | None = None, prog: str = "async-rl learner") -> int:
    from actors.learner.config import LearnerConfig  # light (dataclasses): --help lists its keys

    args = config_parser(prog, "Train on a run's rollout stream; publish versioned weights.", LearnerConfig).parse_args(argv)

    cfg = parse_config(LearnerConfig, args, prog)
    task = check_task(cfg.task, prog)  # the reward imports, the prompts encode: before any server is touched
    if cfg.eval.interval_versions:  # each source's held-out split, as built (a verifiers environment's eval_dataset)
        check_held_out(cfg, task, prog)
    if cfg.backend == "torch":
        check_device(cfg.torch.device, "torch.device", prog)
    check_run_dir(cfg.run.run_dir, prog)
    setup_logging(args.log_level, "learner")
    import asyncio

    from async_rl.servers.embedded import ensure_servers

    servers = None
    if not cfg.run.redis_url or not cfg.run.nats_url:
        # A single-host run with nothing configured: own embedded servers for the run's lifetime.
        servers = ensure_servers(cfg.run.redis_url, cfg.run.nats_url)
        cfg.run.redis_url, cfg.run.nats_url = servers.redis_url, servers.nats_url
        print(f"{prog}: started embedded servers: {servers.redis_url} {servers.nats_url}", file=sys.stderr)
    from async_rl.process.lifecycle import StartupError
    from async_rl.servers.reach import Unreachable, check_servers, describe_failure

    try:  # before anything heavy: a server that is not there is named within seconds
        check_servers(cfg.run.redis_url, cfg.run.nats_url)
    except Unreachable as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        if servers is not None:
            servers.stop()
        return 1
    lease = None
    if _takes_lease(cfg):  # one learner per run: before anything is restored or written (ranks > 0: rank 0's)
        from async_rl.run.lease import LeaseHeld, RunLease

        assert cfg.run.redis_url, "URLs are resolved above"
        lease = RunLease(cfg.run.redis_url, cfg.run.names, cfg.lease, run_dir=cfg.run.run_dir)
        try:
            lease.take()  # lease.wait: stands by until the run's learner ends
        except (LeaseHeld, KeyboardInterrupt) as exc:
            print(f"{prog}: {exc}" if isinstance(exc, LeaseHeld) else f"{prog}: stopped while standing by",
                  file=sys.stderr)  # fmt: skip
            if servers is not None:
                servers.stop()
            return 1 if isinstance(exc, LeaseHeld) else 130
    if cfg.checkpoint.resume:  # the run's Redis state against the checkpoint: lost state is said, before the model
        from actors.learner.run_state import check_run_state

        lost = check_run_state(cfg, owned_servers=servers is not None)
        if lost is not None:
            print(f"{prog}: {lost}", file=sys.stderr)
            if lease is not None:
                lease.release()
            if servers is not None:
                servers.stop()
            return 1
    if lease is not None:
        save_resolved_config(cfg, cfg.run.run_dir, "learner")

    from actors.learner.build import build_backend
    from actors.learner.loop import Learner
    from async_rl.run.lease import is_fenced

    backend = None
    line = None  # the one line of a failure, printed last
    try:
        with lease.kept_alive() if lease is not None else contextlib.nullcontext():  # renewed while it loads
            backend = build_backend(cfg)
        if not backend.is_main_rank:
            backend.follow()
            return 0

        async def _run() -> None:
            learner = Learner(cfg, backend, task=task, lease=lease)
            learner.install_signal_handlers()
            await learner.run()

        asyncio.run(_run())
    except Exception as exc:  # a server lost, another learner took the run: one line, non-zero, for the supervisor
        if lease is not None and is_fenced(exc):
            line = lease.fenced_line()
        else:
            line = describe_failure(exc, cfg.run.redis_url, cfg.run.nats_url)
            if line is None and isinstance(exc, StartupError):
                line = str(exc)
            if line is None:
                raise
            line += "; exiting"
    finally:
        if backend is not None:
            backend.close()
        if lease is not None:
            lease.release()  # a standing-by learner takes over at once
        if servers is not None:
            servers.stop()
    if line is not None:
        print(f"{prog}: {line}", file=sys.stderr)
        return 1
    return 0


def check_held_out(cfg: LearnerConfig, task: Any, prog: str) -> None:
    """Exit 2 with one line when a source evaluated has no held-out prompts (before any server is touched)."""
    from actors.learner.evaluation import eval_sources, held_out_specs

    try:
        held_out_specs(task, eval_sources(cfg.eval, cfg.task), 1)
    except ValueError as exc:
        print(f"{prog}: config error: evaluation needs held-out prompts: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def _takes_lease(cfg: LearnerConfig) -> bool:
    """Whether this process holds the run's lease: the torch backend's one process, or rank 0 under torchrun."""
    return cfg.backend == "torch" or os.environ.get("RANK", "0") == "0"
