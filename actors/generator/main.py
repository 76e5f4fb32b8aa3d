"""``async-rl generator``: join a run, turn prompts into scored groups until stopped."""

from __future__ import annotations

import logging
import signal
import sys

from async_rl.entry import check_device, check_task, config_parser, parse_config, setup_logging


def main(argv: list[str] | None = None, prog: str = "async-rl generator") -> int:
    from actors.generator.config import GeneratorConfig  # light (dataclasses): --help lists its keys

    args = config_parser(prog, "Generate scored groups of trajectories for a run.", GeneratorConfig).parse_args(argv)

    cfg = parse_config(GeneratorConfig, args, prog)
    task = check_task(cfg.task, prog)  # the reward imports, the prompts encode: before any server is touched
    if cfg.engine == "torch":
        check_device(cfg.torch.device, "torch.device", prog)
    if not cfg.run.redis_url or not cfg.run.nats_url:
        print(f"{prog}: config error: run.redis_url and run.nats_url (or ASYNC_RL_REDIS_URL / ASYNC_RL_NATS_URL) "
              "are required: a generator joins an existing run", file=sys.stderr)  # fmt: skip
        return 2
    from async_rl.servers.reach import Unreachable, check_servers, describe_failure

    try:  # before the engine is built: a server that is not there is named within seconds
        check_servers(cfg.run.redis_url, cfg.run.nats_url)
    except Unreachable as exc:
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    setup_logging(args.log_level, f"gen[{cfg.generator_id}]")
    import asyncio

    from actors.generator.process import Generator
    from actors.generator.scoring import ScoringFailed
    from async_rl.process.lifecycle import StartupError, first_task_failure

    async def _run() -> None:
        gen = Generator(cfg, task=task)
        gen.install_signal_handlers()
        await gen.run()

    try:
        asyncio.run(_run())
    except Exception as exc:  # a lost server or a failed long-lived task: one line, exit 1, the supervisor restarts us
        line = describe_failure(exc, cfg.run.redis_url, cfg.run.nats_url)
        if line is None and isinstance(exc, (StartupError, TimeoutError)) and str(exc):  # no weights in time, ...
            line = str(exc)
        if line is None and isinstance(exc, BaseExceptionGroup):
            failed = first_task_failure(exc)
            line = None if failed is None else str(failed)
        if line is None:  # every sample of too many groups in a row failed to score: its own line names task.reward
            scoring = exc.subgroup(ScoringFailed) if isinstance(exc, BaseExceptionGroup) else exc
            while isinstance(scoring, BaseExceptionGroup):
                scoring = scoring.exceptions[0]
            line = str(scoring) if isinstance(scoring, ScoringFailed) else None
        if line is None:
            raise
        logging.getLogger("actors.generator").debug("exiting on", exc_info=exc)
        print(f"{prog}: {cfg.generator_id}: {line}; exiting", file=sys.stderr)
        return 1
    finally:
        # Already on the way out (the event loop and its signal handlers are gone; an engine's worker processes
        # may still take seconds to wind down): a SIGTERM now must not turn a clean exit into death by signal.
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    return 0
