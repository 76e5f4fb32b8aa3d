"""``async-rl generator``: join a run, turn prompts into scored groups until stopped."""

from __future__ import annotations

import sys

from async_rl.entry import config_parser, parse_config, setup_logging


def main(argv: list[str] | None = None, prog: str = "async-rl generator") -> int:
    args = config_parser(prog, "Generate scored groups of trajectories for a run.").parse_args(argv)
    from actors.generator.config import GeneratorConfig

    cfg = parse_config(GeneratorConfig, args, prog)
    if not cfg.run.redis_url or not cfg.run.nats_url:
        print(f"{prog}: config error: run.redis_url and run.nats_url (or ASYNC_RL_REDIS_URL / ASYNC_RL_NATS_URL) "
              "are required: a generator joins an existing run", file=sys.stderr)  # fmt: skip
        return 2
    setup_logging(args.log_level, f"gen[{cfg.generator_id}]")
    import asyncio

    from actors.generator.process import Generator

    async def _run() -> None:
        gen = Generator(cfg)
        gen.install_signal_handlers()
        await gen.run()

    asyncio.run(_run())
    return 0
