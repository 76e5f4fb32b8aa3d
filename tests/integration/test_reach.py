"""Fail fast, name the URL: probes against real servers (nothing listening, each other's port, refused
credentials), and the learner and generator processes exiting non-zero with one line within 5 s."""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from async_rl.servers.embedded import EmbeddedServer, ServerSet, _spawn, free_port, nats_binary, valkey_binary
from async_rl.servers.reach import Unreachable, probe_nats, probe_redis

SECRET = "s3cret-never-printed"


@pytest.fixture(scope="module")
def locked_servers() -> Iterator[tuple[str, str]]:
    """A Valkey with a password and a NATS server with a user/password, each on a free loopback port."""
    import tempfile

    work = Path(tempfile.mkdtemp(prefix="async-rl-reach-"))
    rport, nport = free_port(), free_port()
    valkey = _spawn("valkey", [str(valkey_binary()), "--port", str(rport), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no", "--dir", str(work), "--requirepass", SECRET], rport, work)  # fmt: skip
    nats = _spawn("nats", [str(nats_binary()), "-a", "127.0.0.1", "-p", str(nport), "--user", "gen",
                           "--pass", SECRET], nport, work)  # fmt: skip
    servers = [EmbeddedServer("valkey", f"redis://127.0.0.1:{rport}/0", valkey, work, work / "valkey.log"),
               EmbeddedServer("nats", f"nats://127.0.0.1:{nport}", nats, work, work / "nats.log")]  # fmt: skip
    yield f"127.0.0.1:{rport}", f"127.0.0.1:{nport}"
    for s in servers:
        s.stop()


def _probe(fn, url: str) -> tuple[str, float]:  # type: ignore[no-untyped-def]
    t0 = time.monotonic()
    with pytest.raises(Unreachable) as info:
        fn(url)
    return str(info.value), time.monotonic() - t0


def test_probes_name_the_url_and_what_they_found(servers: ServerSet, locked_servers: tuple[str, str]) -> None:
    dead = f"127.0.0.1:{free_port()}"
    redis_hostport = servers.redis_url.split("://", 1)[1].split("/", 1)[0]
    nats_hostport = servers.nats_url.split("://", 1)[1]
    rlock, nlock = locked_servers
    cases = [
        (probe_redis, f"redis://{dead}/0", "nothing is listening"),
        (probe_nats, f"nats://{dead}", "nothing is listening"),
        (probe_redis, f"redis://{nats_hostport}/0", "a NATS server answered there, not Redis"),
        (probe_nats, f"nats://{redis_hostport}", "a Redis server answered there, not NATS"),
        (probe_redis, f"redis://:wrong-{SECRET}@{rlock}/0", "credentials refused"),
        (probe_redis, f"redis://{rlock}/0", "credentials refused"),  # none given: NOAUTH
        (probe_nats, f"nats://gen:wrong-{SECRET}@{nlock}", "credentials refused"),
        (probe_nats, f"nats://{nlock}", "credentials refused"),
        (probe_redis, "redis://no-such-host.invalid:6379/0", "does not resolve"),
    ]
    for fn, url, found in cases:
        msg, took = _probe(fn, url)
        assert found in msg, (url, msg)
        assert "\n" not in msg and SECRET not in msg, msg
        assert url.split("@")[-1].split("/")[0] in msg  # the host:port is named
        assert took < 3.0, (url, took)
    probe_redis(f"redis://:{SECRET}@{rlock}/0")  # the right credentials pass
    probe_nats(f"nats://gen:{SECRET}@{nlock}")


def _start(role: str, redis_url: str, nats_url: str, tmp_path: Path) -> tuple[int, str, float]:
    extra = ["model.name=tiny-moe", f"run.run_dir={tmp_path}"] if role == "learner" else ["torch.model.name=tiny-moe"]
    cmd = [sys.executable, "-m", "actors.commands.cli", role, f"run.redis_url={redis_url}", f"run.nats_url={nats_url}",
           *extra]  # fmt: skip
    t0 = time.monotonic()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=60, stdin=subprocess.DEVNULL)
    return proc.returncode, proc.stderr.strip(), time.monotonic() - t0


def test_processes_exit_within_5_s_with_one_line(servers: ServerSet, locked_servers: tuple[str, str],
                                                 tmp_path: Path) -> None:  # fmt: skip
    dead = f"127.0.0.1:{free_port()}"
    redis_hostport = servers.redis_url.split("://", 1)[1].split("/", 1)[0]
    nats_hostport = servers.nats_url.split("://", 1)[1]
    rlock, nlock = locked_servers
    cases = [
        ("learner", f"redis://{dead}/0", servers.nats_url, f"cannot reach Redis at redis://{dead}/0: nothing"),
        ("learner", servers.redis_url, f"nats://{dead}", f"cannot reach NATS at nats://{dead}: nothing"),
        ("learner", f"redis://{nats_hostport}/0", servers.nats_url, "a NATS server answered there, not Redis"),
        ("learner", servers.redis_url, f"nats://{redis_hostport}", "a Redis server answered there, not NATS"),
        ("learner", f"redis://:{SECRET}-x@{rlock}/0", servers.nats_url, f"Redis at redis://***@{rlock}/0: credentials"),
        ("learner", servers.redis_url, f"nats://gen:{SECRET}-x@{nlock}", f"NATS at nats://***@{nlock}: credentials"),
        ("generator", f"redis://{dead}/0", servers.nats_url, f"cannot reach Redis at redis://{dead}/0: nothing"),
        ("generator", servers.redis_url, f"nats://{redis_hostport}", "a Redis server answered there, not NATS"),
    ]
    timings = []
    for role, redis_url, nats_url, expected in cases:
        rc, err, took = _start(role, redis_url, nats_url, tmp_path)
        assert rc == 1, (role, redis_url, nats_url, rc, err)
        assert len(err.splitlines()) == 1 and expected in err, (role, err)
        assert SECRET not in err  # the password is never printed
        timings.append(took)
        assert took < 5.0, (role, redis_url, nats_url, took, err)
    print(f"\nstart-up errors in {min(timings):.1f}-{max(timings):.1f} s")


def test_learner_exits_with_one_line_when_a_server_goes_away(servers: ServerSet, tmp_path: Path) -> None:
    """A server lost at run time: bounded retries, then exit 1 naming the URL (a supervisor restarts the process)."""
    import uuid

    from async_rl.servers.embedded import start_nats, start_redis

    for lost in ("redis", "nats"):
        own = start_redis() if lost == "redis" else start_nats()
        redis_url = own.url if lost == "redis" else servers.redis_url
        nats_url = own.url if lost == "nats" else servers.nats_url
        prefix = f"t-lost-{uuid.uuid4().hex[:8]}"
        cmd = [sys.executable, "-m", "actors.commands.cli", "learner", f"run.redis_url={redis_url}",
               f"run.nats_url={nats_url}", f"run.prefix={prefix}", "model.name=tiny-moe",
               f"run.run_dir={tmp_path / lost}", "metrics.wandb_mode=disabled", "read_block_ms=200",
               "control.max_reconnect_attempts=2", "control.reconnect_wait_s=0.5"]  # fmt: skip
        log = tmp_path / f"{lost}.log"
        with log.open("wb") as fh:
            proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        try:
            deadline = time.monotonic() + 120
            while "published weights v0" not in log.read_text(errors="replace"):
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            own.stop()
            t0 = time.monotonic()
            rc = proc.wait(60)
            took = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
            own.stop()
            if lost == "nats":  # the run's keys live on the shared Redis
                import redis

                r = redis.Redis.from_url(servers.redis_url)
                keys = list(r.scan_iter(match=f"{prefix}:*"))
                if keys:
                    r.delete(*keys)
                r.close()
        last = log.read_text(errors="replace").strip().splitlines()[-1]
        assert rc == 1, (lost, rc, last)
        assert last.startswith(f"async-rl learner: lost {'Redis' if lost == 'redis' else 'NATS'} at {own.url}"), last
        assert "Traceback" not in log.read_text(errors="replace")
        assert took < 30, (lost, took)
        print(f"\nlost {lost}: exit 1 after {took:.1f} s: {last}")


def test_status_and_audit_name_an_unreachable_server(capsys) -> None:
    from actors.commands.audit import main as audit_main
    from actors.commands.status import main as status_main

    dead = f"127.0.0.1:{free_port()}"
    t0 = time.monotonic()
    assert status_main(["--prefix", "x", "--redis-url", f"redis://{dead}/0", "--nats-url", f"nats://{dead}"]) == 1
    assert audit_main(["--prefix", "x", "--redis-url", f"redis://{dead}/0"]) == 1
    assert time.monotonic() - t0 < 5
    err = capsys.readouterr().err.splitlines()
    assert err == [f"async-rl status: cannot reach Redis at redis://{dead}/0: nothing is listening on {dead} "
                   "(connection refused)",
                   f"async-rl audit: cannot reach Redis at redis://{dead}/0: nothing is listening on {dead} "
                   "(connection refused)"]  # fmt: skip
