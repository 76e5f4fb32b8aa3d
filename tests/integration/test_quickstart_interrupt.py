"""Ctrl-C on ``async-rl quickstart`` (issue 37): the learner, the generators and the servers stop, the command
exits 130 with one line and no traceback, in seconds; a SIGINT to its PID alone does the same, also when it was
started with SIGINT ignored (as a shell starts a background job)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.integration.procs import children_of, is_alive

ROOT = Path(__file__).resolve().parents[2]
STOP_WITHIN_S = 15.0
"""The roles stop in 2-4 s here (the learner commits, a generator finishes its batch); room for a loaded CI machine."""


def _start(tmp_path: Path, ignore_sigint: bool) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "actors.commands", "quickstart", "--generators", "1", "--quiet",
         "--run-dir", str(tmp_path / "run")],
        cwd=tmp_path, env=dict(os.environ, PYTHONPATH=str(ROOT)), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True, start_new_session=True,  # its own process group: a killpg is the terminal's Ctrl-C
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None,
    )  # fmt: skip


def _wait_for(what: str, check, proc: subprocess.Popen, timeout_s: float) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while not check():
        assert proc.poll() is None, f"the quickstart exited before {what}: {proc.communicate()}"
        assert time.monotonic() < deadline, f"no {what} within {timeout_s}s"
        time.sleep(0.2)


def _interrupted(proc: subprocess.Popen, send) -> tuple[str, str, float]:  # type: ignore[no-untyped-def]
    children = children_of(proc.pid)
    assert len(children) == 4, children  # learner, generator, Valkey, NATS
    t0 = time.monotonic()
    send()
    try:
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    took = time.monotonic() - t0
    assert proc.returncode == 130, (proc.returncode, err[-3000:])
    assert not [c for c in children if is_alive(c)], "a role or a server outlived the quickstart"
    return out, err, took


@pytest.mark.parametrize("how", ["pid", "group"])
def test_sigint_stops_the_quickstart(tmp_path: Path, how: str) -> None:
    log = tmp_path / "run" / "generator-0.log"
    proc = _start(tmp_path, ignore_sigint=how == "pid")
    if how == "pid":  # while it trains: every role joined, its NATS and Redis in use
        _wait_for("a generator on weights", lambda: log.exists() and "engine is on weights version" in log.read_text(),
                  proc, timeout_s=180)  # fmt: skip
        out, err, took = _interrupted(proc, lambda: os.kill(proc.pid, signal.SIGINT))
    else:  # Ctrl-C: the whole process group, right after the roles were started
        _wait_for("the roles", lambda: log.exists(), proc, timeout_s=60)
        out, err, took = _interrupted(proc, lambda: os.killpg(proc.pid, signal.SIGINT))
    last = err.strip().splitlines()[-1]
    assert last.startswith("async-rl quickstart: interrupted after "), err[-3000:]
    assert "the learner, 1 generator and the servers stopped" in last, last
    assert "Traceback" not in err and "Error" not in err, err[-3000:]
    assert took < STOP_WITHIN_S, f"stopping took {took:.1f}s"
    assert out == ""  # no table nor figures for a run cut short: the one line says it
    for role in ("learner", "generator-0"):
        assert "Traceback" not in (tmp_path / "run" / f"{role}.log").read_text(), role
    print(f"{how}: exit 130 in {took:.1f}s: {last}")
