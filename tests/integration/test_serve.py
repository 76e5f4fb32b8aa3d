"""``async-rl serve``: Valkey and NATS for other hosts, with a password that is required, kept off every command
line, and handed out in a 0600 env file that disappears when the servers stop."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import redis


def _children_cmdlines(pid: int) -> list[str]:
    out = []
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"PPid:\t{pid}\n" in status.read_text():
                out.append((status.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode())
        except OSError:
            continue
    return out


def test_serve_requires_its_password_and_cleans_up(tmp_path: Path) -> None:
    import nats
    from nats.errors import NoServersError

    # docs/gpus.md's own command: secrets/ does not exist yet, and is made (0700) for the password (issue 37).
    env_file, password_file = tmp_path / "servers.env", tmp_path / "secrets" / "password"
    proc = subprocess.Popen([sys.executable, "-m", "actors.commands.cli", "serve", "--host", "127.0.0.1",
                             "--redis-port", "0", "--nats-port", "0", "--password-file", str(password_file),
                             "--env-file", str(env_file)], stderr=subprocess.PIPE, text=True,
                            cwd=tmp_path)  # fmt: skip
    try:
        deadline = time.monotonic() + 60
        while not env_file.exists():
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read() if proc.stderr else ""
            time.sleep(0.1)
        assert oct(env_file.stat().st_mode)[-3:] == "600" and oct(password_file.stat().st_mode)[-3:] == "600"
        assert oct(password_file.parent.stat().st_mode)[-3:] == "700"
        password = password_file.read_text().strip()
        urls = dict(line.split("=", 1) for line in env_file.read_text().split())
        redis_url, nats_url = (urls[k].strip("'") for k in ("ASYNC_RL_REDIS_URL", "ASYNC_RL_NATS_URL"))
        assert f":{password}@127.0.0.1:" in redis_url and f"async-rl:{password}@127.0.0.1:" in nats_url
        assert redis.Redis.from_url(redis_url).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(redis_url.replace(password, "wrong")).ping()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis.from_url(redis_url.replace(f":{password}@", "")).set("k", "v")

        async def nats_roundtrip(url: str) -> None:
            nc = await nats.connect(url, max_reconnect_attempts=0, allow_reconnect=False, connect_timeout=3)
            await nc.close()

        asyncio.run(nats_roundtrip(nats_url))
        with pytest.raises((NoServersError, nats.errors.Error, OSError)):
            asyncio.run(nats_roundtrip(nats_url.replace(password, "wrong")))
        cmdlines = _children_cmdlines(proc.pid)
        assert len(cmdlines) == 2 and not any(password in c for c in cmdlines), cmdlines
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    assert not env_file.exists()
    assert "redis://***@127.0.0.1" in (proc.stderr.read() if proc.stderr else "")
    # The password file is kept: the same password serves the run when its job is started again.
    assert password_file.read_text().strip() == password


def test_serve_names_a_password_file_it_cannot_write(tmp_path: Path) -> None:
    (tmp_path / "secrets").write_text("")  # a file where the password's directory should be
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "actors.commands.cli", "serve", "--redis-port", "0", "--nats-port", "0",
                          "--password-file", "secrets/password"], capture_output=True, text=True, timeout=60,
                         cwd=tmp_path)  # fmt: skip
    assert out.returncode == 1 and time.monotonic() - t0 < 10, out
    assert out.stderr.strip() == ("async-rl serve: cannot create the directory of --password-file 'secrets/password': "
                                  "'secrets' is a file"), out.stderr  # fmt: skip
