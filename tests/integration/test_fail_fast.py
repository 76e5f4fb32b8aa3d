"""A user's mistakes end in seconds with one line naming cause and fix (issues 26, 37), against real processes: a
generator with another model or task than the run's, one on the wrong Redis database or prefix, ``status`` and ``audit`` on a
prefix with no run, and the control plane lost for good under a running learner and generator (both exit 1)."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis

from actors.commands.audit import main as audit_main
from actors.commands.status import main as status_main
from async_rl.run.listing import _with_db
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet, start_nats
from tests.integration.procs import Procs


def _wait_exit(procs: Procs, name: str, timeout_s: float = 120.0) -> tuple[int, str, float]:
    t0 = time.monotonic()
    rc = procs.procs.pop(name).wait(timeout_s)  # gone, as expected: wait_for must not count it as a failure
    return rc, procs.log(name).strip().splitlines()[-1], time.monotonic() - t0


def test_mistakes_end_with_one_line(servers: ServerSet, names: Names, tmp_path: Path, capsys) -> None:
    nats = start_nats()  # the run's own NATS: killed at the end
    try:
        procs = Procs(ServerSet(redis_url=servers.redis_url, nats_url=nats.url), names, tmp_path / "run")
        try:
            _run_mistakes(procs, servers, names, nats, capsys)
        finally:
            procs.close()
    finally:
        nats.stop()


def _run_mistakes(procs: Procs, servers: ServerSet, names: Names, nats, capsys) -> None:  # type: ignore[no-untyped-def]
    def say(line: str) -> None:  # the figures, past the capture the status/audit checks read
        with capsys.disabled():
            print(line)

    lossy = ["control.max_reconnect_attempts=2", "control.reconnect_wait_s=0.5"]
    procs.learner(*lossy, "staleness.max_staleness=1", "starved_log_interval_s=2", "scaling.heartbeat_timeout_s=3")
    procs.wait_for("weights v0", lambda: "published weights v0" in procs.log("learner"), 120)

    # Another model: refused at join (before any weight is fetched), and the learner says so too.
    procs.generator("gen-moe", "torch.model.name=small-moe")
    rc, last, took = _wait_exit(procs, "gen-moe")
    assert rc == 1, procs.tails()
    assert "model 'small-moe' does not match run" in last and "hidden_size 128 here, 64 in the run" in last, last
    assert "set torch.model.name to the learner's model.name" in last
    assert "weights version" not in procs.log("gen-moe")  # nothing was fetched
    procs.wait_for("the learner's line", lambda: "gen-moe (" in procs.log("learner")
                   and "refused to join: model 'small-moe'" in procs.log("learner"), 30)  # fmt: skip
    say(f"model mismatch: exit 1 in {took:.1f} s: {last}")

    # Another task (issue 37): it would score every sample against the wrong answer; refused the same way.
    procs.generator("gen-task", "task.name=reverse")
    rc, last, took = _wait_exit(procs, "gen-task")
    assert rc == 1, procs.tails()
    assert f"task 'reverse' does not match run {names.prefix!r}, whose learner trains on 'copy'" in last, last
    assert "task.name 'reverse' here, 'copy' in the run" in last and "weights version" not in procs.log("gen-task")
    procs.wait_for("the learner's line on the task", lambda: "gen-task (" in procs.log("learner")
                   and "refused to join: task 'reverse'" in procs.log("learner"), 30)  # fmt: skip
    say(f"task mismatch: exit 1 in {took:.1f} s: {last}")

    # The right prefix in the wrong database: one line naming the database that holds it.
    procs.generator("gen-db", f"run.redis_url={_with_db(servers.redis_url, 1)}")
    rc, last, took = _wait_exit(procs, "gen-db")
    assert rc == 1 and f"no run {names.prefix!r} at" in last and "is in database 0 of that server" in last, last
    say(f"wrong database: exit 1 in {took:.1f} s: {last}")

    # A typo in the prefix: a generator may start before its learner, so it waits, but says at once what exists.
    procs.generator("gen-typo", f"run.prefix={names.prefix}x", "weight_sync.first_version_timeout_s=3")
    procs.wait_for("the listing", lambda: f"no run '{names.prefix}x'" in procs.log("gen-typo"), 60)
    assert f"(did you mean run.prefix={names.prefix}?)" in procs.log("gen-typo")
    rc, last, _ = _wait_exit(procs, "gen-typo")  # and when its learner never comes: one line, exit 1
    assert rc == 1 and "no usable weight version of prefix" in last and "within 3.0s" in last, last
    assert "Traceback" not in procs.log("gen-typo")

    # status and audit on a prefix with no run: exit 1 and the same line, not an empty table or "OK".
    for main in (status_main, audit_main):
        argv = ["--prefix", f"{names.prefix}x", "--redis-url", servers.redis_url]
        assert main(argv) == 1
        err = capsys.readouterr().err.strip()
        assert err.endswith(f"(did you mean --prefix={names.prefix}?)") and f"no run '{names.prefix}x'" in err, err

    # No generator at work: the learner says what it waits for instead of nothing.
    procs.wait_for("the starved line", lambda: "waiting for rollouts for" in procs.log("learner"), 30)
    assert "8 prompts issued and not yet returned; 0 generators alive" in procs.log("learner")

    # A generator killed with prompts in hand: the learner says how many it left pending and when they are reclaimed.
    client = redis.Redis.from_url(servers.redis_url)
    procs.generator("gen-kill")

    def holding() -> bool:
        return any(c["name"] == b"gen-kill" and c["pending"] > 0
                   for c in client.xinfo_consumers(names.prompts_stream, names.prompts_group))  # fmt: skip

    victim = procs.procs.pop("gen-kill")
    try:
        for _ in range(50):  # frozen while it holds prompts (it acks a batch within ms of finishing it), then killed
            procs.wait_for("prompts held by gen-kill", holding, 120)
            victim.send_signal(signal.SIGSTOP)
            if holding():
                break
            victim.send_signal(signal.SIGCONT)
    finally:
        victim.send_signal(signal.SIGKILL)
    procs.wait_for("the lost line", lambda: "generator gen-kill (" in procs.log("learner")
                   and " lost: " in procs.log("learner"), 60)  # fmt: skip
    lost = next(line for line in procs.log("learner").splitlines() if "generator gen-kill (" in line and " lost" in line)
    m = re.search(r"it left (\d+) prompts? pending, which other generators reclaim (now|in \d+s) "
                  r"\(prompts.reclaim_idle_ms=3000\)", lost)  # fmt: skip
    assert m and int(m.group(1)) >= 1, lost
    client.close()
    say(f"lost generator: {lost.split(': ', 1)[1]}")

    # NATS lost for good under a working learner and generator: both exit 1 with one line.
    procs.generator("gen-ok", *lossy)
    procs.wait_for("a step", lambda: "generator gen-ok joined" in procs.log("learner") and any(
        r.get("step", 0) >= 1 for r in procs.metrics()), 120)  # fmt: skip
    nats.stop()
    for name in ("gen-ok", "learner"):
        rc, last, took = _wait_exit(procs, name, 60)
        assert rc == 1 and "lost NATS at" in last, (name, rc, last)
        assert "Traceback" not in procs.log(name)
        say(f"NATS lost: {name} exit 1 after {took:.1f} s: {last}")
    assert procs.log("gen-ok").count("heartbeat failed") <= 2, procs.log("gen-ok")


def test_serve_names_a_port_in_use(servers: ServerSet, tmp_path: Path) -> None:
    from urllib.parse import urlsplit

    port = urlsplit(servers.redis_url).port
    t0 = time.monotonic()
    out = subprocess.run([sys.executable, "-m", "actors.commands.cli", "serve", "--no-auth", "--redis-port", str(port),
                          "--nats-port", "0"], capture_output=True, text=True, timeout=60, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 1, out
    assert out.stderr.strip() == (f"async-rl serve: port {port} in use on 127.0.0.1: cannot start valkey there "
                                  "(--redis-port picks another; 0 takes a free one)"), out.stderr  # fmt: skip
    print(f"\nport in use: exit 1 in {time.monotonic() - t0:.1f} s")


def test_bench_loop_refuses_a_run_dir_that_holds_a_run(tmp_path: Path, capsys) -> None:
    from actors.commands.bench.loop import main

    (tmp_path / "checkpoints" / "step-40").mkdir(parents=True)
    (tmp_path / "checkpoints" / "latest").write_text("step-40")
    assert main(["--run-dir", str(tmp_path), "--steps", "1", "--json", str(tmp_path / "s.json")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"async-rl bench loop: --run-dir {tmp_path} holds a run already (checkpoint step-40); a benchmark starts "
        "fresh: give a new --run-dir, or leave it out for runs/bench-loop-<time>")


class _Listener:
    """A TCP port that counts who connects: where a role is told its Redis and NATS are, to show it never came."""

    def __init__(self) -> None:
        import socket
        import threading

        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.accepted = 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.close()

    def close(self) -> None:
        self.sock.close()


def _cuda_device_not_here() -> str:
    import torch

    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return f"cuda:{count}" if count else "cuda"  # a GPU this host does not have


def test_config_mistakes_are_refused_before_any_server(tmp_path: Path) -> None:
    """``torch.device=cuda`` without that GPU (learner and generator) and a ``run.run_dir`` that cannot be created:
    exit 2 with one line within seconds, and neither server is contacted (issue 37)."""
    listener = _Listener()
    try:
        urls = [f"run.redis_url=redis://127.0.0.1:{listener.port}/0", f"run.nats_url=nats://127.0.0.1:{listener.port}"]
        device = _cuda_device_not_here()
        (tmp_path / "a-file").write_text("")
        cases = [
            (["generator", f"torch.device={device}", *urls],
             f"async-rl generator: config error: torch.device={device}, but "),
            (["learner", f"torch.device={device}", f"run.run_dir={tmp_path / 'run'}", *urls],
             f"async-rl learner: config error: torch.device={device}, but "),
            (["learner", "torch.device=cpu", f"run.run_dir={tmp_path / 'a-file' / 'run'}", *urls],
             f"async-rl learner: config error: run.run_dir '{tmp_path / 'a-file' / 'run'}' cannot be created: "
             f"'{tmp_path / 'a-file'}' is a file, not a directory (set run.run_dir to a directory this user can write)"),
        ]  # fmt: skip
        for argv, expected in cases:
            t0 = time.monotonic()
            out = subprocess.run([sys.executable, "-m", "actors.commands.cli", *argv], capture_output=True, text=True,
                                 timeout=60, cwd=tmp_path)  # fmt: skip
            took = time.monotonic() - t0
            assert out.returncode == 2, out
            assert out.stderr.startswith(expected) and len(out.stderr.strip().splitlines()) == 1, out.stderr
            assert "(set torch.device=cpu, or run on a host with that GPU)" in out.stderr or "run_dir" in expected
            assert listener.accepted == 0, f"{argv[0]} contacted a server before refusing"
            print(f"\n{argv[0]} {argv[1]}: exit 2 in {took:.1f} s: {out.stderr.strip()}")
        assert not (tmp_path / "run").exists()  # the device is refused before the run directory is made
    finally:
        listener.close()
