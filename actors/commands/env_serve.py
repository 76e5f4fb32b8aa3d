"""``async-rl env-serve``: serve an environment over HTTP (OpenEnv's protocol) to the ``task.name=http`` adapter of
learners and generators on other processes or hosts, so that a slow or unsafe environment does not share their process.

The environment is named by the same ``task.*`` keys as for a learner (``task.name=path/to/file.py:Class``, a
built-in environment such as ``python_tool``, ``task.tokenizer``, ``task.args.*``, ``task.env.*``); a bare
``file.py:Class`` is ``task.name``. It is built once, at start (its errors end the command in one line), and served
on ``host:port`` until SIGTERM or SIGINT: ``GET /health``, ``GET /metadata``, ``POST /reset`` (a prompt by index) and
``WS /ws`` (one episode per session); ``async_rl/tasks/envs/http.py`` describes the protocol. Learners and generators
then run with ``task.name=http task.env.url=http://HOST:PORT``; the line this command prints when it listens gives the
URL. aiohttp serves it (``pip install 'async-rl[env-server]'``).
"""

from __future__ import annotations

import asyncio
import signal
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from async_rl.entry import check_task, config_parser, first_sentence, parse_config, setup_logging
from async_rl.tasks.config import TaskConfig

if TYPE_CHECKING:
    from async_rl.tasks.envs.base import EnvTask


@dataclass(kw_only=True, slots=True)
class EnvServeConfig:
    """What ``async-rl env-serve`` serves, and where."""

    task: TaskConfig = field(default_factory=TaskConfig)
    """The environment served, named as for a learner (``task.name=file.py:Class``, a built-in environment, ...)."""
    host: str = "127.0.0.1"
    """Address to listen on (``0.0.0.0``: every interface; the protocol has no authentication, so only on a network
    of the run's own)."""
    port: int = 8000
    """Port to listen on (0: a free one, printed when listening)."""

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError("port must be in [0, 65535]")
        if self.task.name == "http":
            raise ValueError("task.name=http is the client of a server: name the environment to serve")


def main(argv: list[str] | None = None, prog: str = "async-rl env-serve") -> int:
    parser = config_parser(prog, first_sentence(__doc__), EnvServeConfig)
    args = parser.parse_args(argv)
    args.overrides = [o if "=" in o or ":" not in o else f"task.name={o}" for o in args.overrides]
    cfg = parse_config(EnvServeConfig, args, prog)
    setup_logging(args.log_level, "env-serve")
    try:
        import aiohttp  # noqa: F401
    except ImportError:
        print(f"{prog}: needs aiohttp: pip install 'async-rl[env-server]'", file=sys.stderr)
        return 2
    from async_rl.tasks.envs.base import EnvTask

    task = check_task(cfg.task, prog)
    if not isinstance(task, EnvTask):
        print(f"{prog}: config error: task.name {cfg.task.name!r} is not an environment (an EnvTask): a task of one "
              "answer per prompt is scored where it is generated, nothing to serve", file=sys.stderr)  # fmt: skip
        return 2
    return asyncio.run(_run(task, cfg, prog))


async def _run(task: EnvTask, cfg: EnvServeConfig, prog: str) -> int:
    from async_rl.tasks.envs.env_server import serve

    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)

    def ready(url: str) -> None:
        print(f"{prog}: serving {task.name!r} at {url} (task.name=http task.env.url={url})", flush=True)

    try:
        await serve(task, cfg.host, cfg.port, stop, on_ready=ready)
    except OSError as exc:
        print(f"{prog}: cannot listen on {cfg.host}:{cfg.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(f"{prog}: stopped", flush=True)
    return 0
