"""Run state that survives its servers (issue 37): ``async-rl serve`` keeps Valkey's data in an append-only file and
restarts a server that died, each on its own, saying which; a learner whose run's Redis state is gone or older than
its checkpoint says so in one line and refuses, or, with ``checkpoint.on_lost_state=rebuild``, goes on from the
checkpoint and records the loss, which ``async-rl audit`` prints."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from actors.commands.audit import main as audit_main
from actors.commands.serve import MAX_RESTARTS, Supervisor
from actors.learner.run_state import LOST_FIELD, _missing
from async_rl.run.names import Names
from async_rl.servers.embedded import EmbeddedServer, ServerSet
from tests.integration.procs import LEARNER_TEST_ARGS, Procs

STEP, PROMPTS_ISSUED = 3, 24


def _serve(tmp_path: Path, *extra: str) -> tuple[subprocess.Popen, dict[str, str]]:
    env_file = tmp_path / "servers.env"
    env_file.unlink(missing_ok=True)
    proc = subprocess.Popen([sys.executable, "-m", "actors.commands.cli", "serve", "--redis-port", "0", "--nats-port",
                             "0", "--no-auth", "--env-file", str(env_file), *extra], cwd=tmp_path,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    deadline = time.monotonic() + 60
    while not env_file.exists():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()
        time.sleep(0.05)
    urls = dict(line.split("=", 1) for line in env_file.read_text().split())
    return proc, {k: v.strip("'") for k, v in urls.items()}


def _child(serve: subprocess.Popen, binary: str) -> int:
    for status in Path("/proc").glob("[0-9]*/status"):
        try:
            if f"PPid:\t{serve.pid}\n" in status.read_text():
                cmd = (status.parent / "cmdline").read_bytes()
                if binary.encode() in cmd:
                    return int(status.parent.name)
        except OSError:
            continue
    raise AssertionError(f"no {binary} under serve")


def _wait(what: str, cond, timeout_s: float = 30.0) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not cond():
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.05)


def test_serve_restarts_each_server_and_valkey_keeps_its_data(tmp_path: Path) -> None:
    import nats

    serve, urls = _serve(tmp_path)
    lines: list[str] = []
    try:
        r = redis.Redis.from_url(urls["ASYNC_RL_REDIS_URL"])
        r.set("t:key", "before")
        r.xadd("t:stream", {"n": "1"})
        # appendfsync everysec: a write is in the file within a second or two (a busy disk delays it); WAITAOF returns
        # once it is, so the kill below tests what was promised, not how fast this machine's disk is today.
        assert r.execute_command("WAITAOF", 1, 0, 30_000) == [1, 0]

        async def nats_client() -> None:  # connected through both restarts: it reconnects by itself
            async def quiet(exc: Exception) -> None:  # refused connects while NATS is down: expected here
                pass

            nc = await nats.connect(urls["ASYNC_RL_NATS_URL"], reconnect_time_wait=0.2, max_reconnect_attempts=100,
                                    error_cb=quiet)  # fmt: skip
            got: list[bytes] = []

            async def on_message(msg) -> None:  # type: ignore[no-untyped-def]
                got.append(msg.data)

            await nc.subscribe("t.subject", cb=on_message)
            t0 = time.monotonic()
            os.kill(_child(serve, "valkey-server"), signal.SIGKILL)
            await asyncio.to_thread(_wait, "Valkey back", lambda: _pong(r))
            lines.append(f"Valkey back in {time.monotonic() - t0:.1f}s")
            t0 = time.monotonic()
            os.kill(_child(serve, "nats-server"), signal.SIGKILL)
            deadline = time.monotonic() + 30
            while not got and time.monotonic() < deadline:  # published until the resubscribed client hears it
                with contextlib.suppress(Exception):
                    await nc.publish("t.subject", b"after")
                    await nc.flush(timeout=1)
                await asyncio.sleep(0.2)
            lines.append(f"NATS back and heard in {time.monotonic() - t0:.1f}s")
            assert got[:1] == [b"after"], got
            await nc.close()

        asyncio.run(nats_client())
        assert r.get("t:key") == b"before" and r.xlen("t:stream") == 1  # loaded back from the append-only file
        serve.send_signal(signal.SIGTERM)
        assert serve.wait(30) == 0
    finally:
        if serve.poll() is None:
            serve.kill()
    err = serve.stderr.read() if serve.stderr else ""
    data = (tmp_path / "valkey-data").resolve()
    said = err.strip().splitlines()
    assert said[0].endswith(f"(its data in {data}: an append-only file, fsync every second), NATS "
                            f"{urls['ASYNC_RL_NATS_URL']}; URLs in {tmp_path / 'servers.env'}"), said  # fmt: skip
    port = urls["ASYNC_RL_REDIS_URL"].rsplit(":", 1)[1].split("/")[0]
    assert any(line.startswith(f"async-rl serve: Valkey at {urls['ASYNC_RL_REDIS_URL']} (pid ")
               and line.endswith(f"was killed by SIGKILL; restarting it on port {port} from its append-only file in "
                                 f"{data}") for line in said), said  # fmt: skip
    assert any(line.startswith("async-rl serve: NATS at ") and "was killed by SIGKILL" in line for line in said), said
    assert len([line for line in said if " is back at " in line]) == 2, said

    # A second serve of the same data: refused while the first holds it; after it, the run's state is there.
    serve2, urls2 = _serve(tmp_path)
    try:
        held = subprocess.run([sys.executable, "-m", "actors.commands.cli", "serve", "--redis-port", "0",
                               "--nats-port", "0", "--no-auth"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=60)  # fmt: skip
        assert held.returncode == 1 and held.stderr.strip() == (
            f"async-rl serve: the data directory '{data}' is in use by another async-rl serve (pid {serve2.pid}): "
            "give each its own --data-dir"), held.stderr
        assert redis.Redis.from_url(urls2["ASYNC_RL_REDIS_URL"]).get("t:key") == b"before"
    finally:
        serve2.send_signal(signal.SIGTERM)
        serve2.wait(30)
    print("\n" + "\n".join([*said, *lines]))


def _pong(r: redis.Redis) -> bool:
    try:
        return bool(r.ping())
    except redis.ConnectionError:
        return False


def test_a_server_that_cannot_stay_up_is_given_up(tmp_path: Path, capsys) -> None:  # type: ignore[no-untyped-def]
    argv = [sys.executable, "-c", "import sys; sys.exit(3)"]  # a "server" that exits at once, every time
    proc = subprocess.Popen(argv)
    proc.wait()
    server = EmbeddedServer("valkey", "redis://127.0.0.1:1/0", proc, tmp_path, tmp_path / "valkey.log", argv=argv,
                            port=1)  # fmt: skip
    supervisor = Supervisor("async-rl serve")
    checks = [supervisor.check(server, "Valkey", "") for _ in range(MAX_RESTARTS + 1)]
    assert checks == [True] * MAX_RESTARTS + [False]
    err = capsys.readouterr().err.strip().splitlines()
    assert err[0] == f"async-rl serve: Valkey at redis://127.0.0.1:1/0 (pid {proc.pid}) exited with 3; restarting it on port 1"
    assert "did not restart: embedded valkey exited with 3" in err[1]
    assert err[-1].endswith(f"exited with 3, the {MAX_RESTARTS + 1}th time within 60s: not restarting it again; "
                            f"stopping (see {tmp_path / 'valkey.log'})")  # fmt: skip


def _checkpoint(run_dir: Path, overrides: list[str]) -> None:
    """A checkpoint at step 3 as a learner of these overrides writes it (a real backend, saved for real)."""
    from actors.learner.build import build_backend
    from actors.learner.checkpoint import CheckpointManager, LearnerState
    from actors.learner.config import LearnerConfig
    from async_rl.config.configurable import load_config

    cfg = load_config(LearnerConfig, None, overrides)
    backend = build_backend(cfg)
    state = LearnerState(step=STEP, version=STEP, prompts_issued=PROMPTS_ISSUED, published_version=STEP)
    CheckpointManager(run_dir / "checkpoints").save(backend, state)
    backend.close()


def test_a_learner_says_its_run_state_was_lost(procs: Procs, servers: ServerSet, names: Names, capsys) -> None:  # type: ignore[no-untyped-def]
    _checkpoint(procs.run_dir, [*LEARNER_TEST_ARGS, f"run.run_dir={procs.run_dir}"])
    r = redis.Redis.from_url(servers.redis_url)
    t0 = time.monotonic()
    procs.learner()  # the checkpoint says step 3; this Redis has nothing of the run
    assert procs.procs.pop("learner").wait(60) == 1, procs.tails()  # gone, as expected
    took = time.monotonic() - t0
    last = procs.log("learner").strip().splitlines()[-1]
    assert last == (f"async-rl learner: run {names.prefix!r} at {servers.redis_url} holds none of its state (no learner "
                    f"state, no weights, no audit counters), but the checkpoint {procs.run_dir}/checkpoints/step-00000003 "
                    "is at step 3, version 3: the run's Redis state was lost (a Valkey that keeps nothing on disk "
                    "restarted, or another server or database). Point run.redis_url at the run's own server, or restore "
                    "its data (async-rl serve --data-dir keeps it), or go on from the checkpoint with the prompts in "
                    "flight lost: checkpoint.on_lost_state=rebuild"), last  # fmt: skip
    assert "Traceback" not in procs.log("learner") and not r.exists(names.learner_state)  # nothing written
    print(f"\nlost state: exit 1 in {took:.1f}s")

    procs.learner("checkpoint.on_lost_state=rebuild", name="learner-2")
    procs.wait_for("the checkpoint's version published", lambda: r.get(names.weights_latest) == b"3", 120)
    log = procs.log("learner-2")
    assert "holds none of its state" in log and "rebuilding from the checkpoint (checkpoint.on_lost_state=rebuild)" in log
    assert f"prompts are issued from #{PROMPTS_ISSUED} on" in log
    assert procs.stop("learner-2") == 0
    assert audit_main(["--prefix", names.prefix, "--redis-url", servers.redis_url]) == 0
    out = capsys.readouterr().out
    assert "state lost: at " in out and ("holds none of its state (no learner state, no weights, no audit counters); "
                                        "its learner went on from checkpoint step-00000003 (step 3, version 3, prompts "
                                        f"issued from #{PROMPTS_ISSUED})") in out, out  # fmt: skip
    assert r.hget(names.learner_state, LOST_FIELD)


def test_state_older_than_the_checkpoint_is_named(servers: ServerSet, names: Names) -> None:
    from actors.learner.config import LearnerConfig
    from async_rl.config.configurable import load_config

    cfg = load_config(LearnerConfig, None, [f"run.prefix={names.prefix}", f"run.redis_url={servers.redis_url}"])
    meta = {"step": 10, "version": 10, "published_version": 10, "prompts_issued": 80}
    r = redis.Redis.from_url(servers.redis_url)
    assert _missing(r, cfg, meta).startswith("holds none of its state")  # type: ignore[union-attr]
    assert _missing(r, cfg, {"step": 0, "version": 0, "published_version": -1, "prompts_issued": 0}) is None
    r.hset(names.learner_state, "step", 9)
    r.set(names.weights_latest, 8)  # restored from an older copy
    assert _missing(r, cfg, meta) == ("is older than the checkpoint: its newest weights there are v8, the checkpoint "
                                      "published v10; it has no audit counters, the checkpoint issued 80 prompts")
    r.hset(names.audit_counters, "issued", 80)
    r.set(names.weights_latest, 11)  # a learner killed after a publish the checkpoint does not cover: not a loss
    assert _missing(r, cfg, meta) is None


def test_a_running_loop_rides_over_valkey_killed_under_serve(tmp_path: Path, names: Names) -> None:
    """kill -9 of Valkey under serve while a learner and a generator train: Valkey is back from its append-only file
    within a second, both ride over it (their Redis clients and the weights' transport reconnect), the run ends at
    max_steps, and the audit is exact."""
    serve, urls = _serve(tmp_path)
    procs = Procs(ServerSet(urls["ASYNC_RL_REDIS_URL"], urls["ASYNC_RL_NATS_URL"]), names, tmp_path / "run")
    try:
        procs.learner("max_steps=16")
        procs.generator("gen-0")
        procs.wait_for("3 learner steps", lambda: procs.log("learner").count(" INFO actors.learner.loop: step ") >= 3,
                       240)  # fmt: skip
        os.kill(_child(serve, "valkey-server"), signal.SIGKILL)
        procs.wait_for("the end of the run", lambda: all(p.poll() is not None for p in procs.procs.values()), 240)
        assert {n: p.returncode for n, p in procs.procs.items()} == {"learner": 0, "gen-0": 0}, procs.tails()
        for name in procs.procs:
            assert "Traceback" not in procs.log(name), procs.log(name)
        out = subprocess.run([sys.executable, "-m", "actors.commands.cli", "audit", "--prefix", names.prefix,
                              "--redis-url", urls["ASYNC_RL_REDIS_URL"]], capture_output=True, text=True, timeout=60)
        assert out.returncode == 0 and "OK: every issued prompt is accounted for" in out.stdout, out
        print("\n" + out.stdout)
    finally:
        procs.close()
        serve.send_signal(signal.SIGTERM)
        serve.wait(30)
    err = serve.stderr.read() if serve.stderr else ""
    assert "was killed by SIGKILL; restarting it on port" in err and "Valkey is back at" in err, err


def test_versions_published_to_gpu_slots_count(servers: ServerSet, names: Names) -> None:
    from actors.learner.config import LearnerConfig
    from async_rl.config.configurable import load_config

    cfg = load_config(LearnerConfig, None, [f"run.prefix={names.prefix}", f"run.redis_url={servers.redis_url}"])
    r = redis.Redis.from_url(servers.redis_url)
    r.hset(names.learner_state, "step", 10)
    r.hset(names.audit_counters, "issued", 80)
    r.set(names.weights_gpu_latest, 10)  # a learner that publishes to GPU slots only (publisher.gpu_host_copies off)
    assert _missing(r, cfg, {"step": 10, "version": 10, "published_version": 10, "prompts_issued": 80}) is None
