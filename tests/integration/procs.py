"""Starting learner and generator processes for end-to-end tests (real processes, real servers)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from async_rl.metrics.sinks import read_metrics
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet

LEARNER_TEST_ARGS = [
    "model.name=tiny-moe", "task.name=copy", "batch_groups=8", "sampling.n=8", "torch.lr=2e-3",
    "torch.device=cpu", "metrics.wandb_mode=disabled", "checkpoint.every=1", "read_block_ms=200",
    "rollouts.reclaim_idle_ms=3000",
]  # fmt: skip
GENERATOR_TEST_ARGS = [
    "torch.model.name=tiny-moe", "task.name=copy", "torch.num_threads=1", "torch.max_batch_prompts=8",
    "prompts.reclaim_idle_ms=3000", "read_block_ms=200", "heartbeat_interval_s=0.5",
]  # fmt: skip
TRANSPORT = os.environ.get("ASYNC_RL_TEST_TRANSPORT", "")
"""The weights data plane every learner and generator of these tests uses (empty: the default, Redis). Set
``ASYNC_RL_TEST_TRANSPORT='peer://0.0.0.0:0?fanout=2'`` to run the end-to-end and chaos tests over the peer relay."""
if TRANSPORT:
    LEARNER_TEST_ARGS.append(f"transport.url={TRANSPORT}")
    GENERATOR_TEST_ARGS.append(f"transport.url={TRANSPORT}")


class Procs:
    """Processes of one test run; everything still running is killed at the end."""

    servers: ServerSet
    names: Names
    run_dir: Path
    procs: dict[str, subprocess.Popen]

    def __init__(self, servers: ServerSet, names: Names, run_dir: Path) -> None:
        self.servers = servers
        self.names = names
        self.run_dir = run_dir
        self.procs = {}
        run_dir.mkdir(parents=True, exist_ok=True)

    def _common(self) -> list[str]:
        return [f"run.prefix={self.names.prefix}", f"run.redis_url={self.servers.redis_url}",
                f"run.nats_url={self.servers.nats_url}"]  # fmt: skip

    def start(self, name: str, role: str, args: list[str]) -> subprocess.Popen:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
        cmd = [sys.executable, "-m", "actors.commands.cli", role, *self._common(), *args]
        log = (self.run_dir / f"{name}.log").open("ab")
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env)
        self.procs[name] = proc
        return proc

    def learner(self, *extra: str, name: str = "learner") -> subprocess.Popen:
        return self.start(name, "learner", [*LEARNER_TEST_ARGS, f"run.run_dir={self.run_dir}", *extra])

    def generator(self, gen_id: str, *extra: str) -> subprocess.Popen:
        return self.start(gen_id, "generator", [*GENERATOR_TEST_ARGS, f"generator_id={gen_id}", *extra])

    def log(self, name: str) -> str:
        path = self.run_dir / f"{name}.log"
        return path.read_text(errors="replace") if path.is_file() else ""

    def wait_for(self, what: str, cond: Callable[[], bool], timeout_s: float, interval_s: float = 0.25) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if cond():
                return
            dead = {n: p.returncode for n, p in self.procs.items() if p.poll() not in (None, 0, -9, -15)}
            if dead:
                raise AssertionError(f"process failed while waiting for {what}: {dead}\n{self.tails()}")
            time.sleep(interval_s)
        raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{self.tails()}")

    def tails(self, lines: int = 25) -> str:
        return "\n".join(f"--- {n}:\n" + "\n".join(self.log(n).splitlines()[-lines:]) for n in self.procs)

    def metrics(self) -> list[dict[str, Any]]:
        return read_metrics(self.run_dir)

    def stop(self, name: str, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        proc = self.procs[name]
        if proc.poll() is None:
            proc.send_signal(sig)
        try:
            return proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            raise AssertionError(f"{name} did not exit {timeout_s}s after signal {sig}\n{self.tails()}") from None

    def close(self) -> None:
        for p in self.procs.values():
            if p.poll() is None:
                p.kill()
        for p in self.procs.values():
            p.wait()


def children_of(pid: int) -> list[int]:
    """The processes ``pid`` started (a command's roles: the learner, the generators, Valkey and NATS)."""
    out = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                status = (entry / "status").read_text()
            except OSError:
                continue
            if f"\nPPid:\t{pid}\n" in status:
                out.append(int(entry.name))
    return out


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("\nState:\t", 1)[1][0]
    except (OSError, IndexError):
        return False
    return state != "Z"
