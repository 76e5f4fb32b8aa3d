"""scripts/slurm on a real Slurm: ``slurmctld`` and two ``slurmd`` (nodes n1 and n2 of one host), Debian's
``slurm-wlm`` installed when absent. The run's job starts its own Valkey and NATS (``async-rl serve``, with a
password), the learner under torchrun on n1 and a generator on n2 with the tiny CPU model; ``add-generators.sh``
adds a generator in a second job while it trains; both jobs end by themselves (COMPLETED, exit 0) when the learner
reaches ``max_steps``."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from async_rl.metrics.sinks import read_metrics
from async_rl.run.names import Names
from async_rl.servers.embedded import free_port
from tests.integration.procs import GENERATOR_TEST_ARGS, LEARNER_TEST_ARGS

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SLURM = ROOT / "scripts" / "slurm"


def _ensure_slurm() -> None:
    if shutil.which("slurmctld") and shutil.which("slurmd"):
        return
    if os.geteuid() != 0 or not shutil.which("apt-get"):
        pytest.skip("Slurm is not installed and this is not a Debian machine where root can install slurm-wlm")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
    subprocess.run(["apt-get", "install", "-y", "-qq", "slurm-wlm"], check=True, env=env, timeout=900,
                   stdout=subprocess.DEVNULL)  # fmt: skip


SLURM_CONF = """\
ClusterName=asyncrltest
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation={d}/state
SlurmdSpoolDir={d}/spool-%n
SlurmctldPidFile={d}/slurmctld.pid
SlurmdPidFile={d}/slurmd-%n.pid
SlurmctldLogFile={d}/slurmctld.log
SlurmdLogFile={d}/slurmd-%n.log
ProctrackType=proctrack/pgid
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SchedulerType=sched/builtin
ReturnToService=2
MpiDefault=none
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
MinJobAge=3600
NodeName=n1 NodeHostname={host} NodeAddr=127.0.0.1 Port={n1_port} CPUs=2 RealMemory=8000 State=UNKNOWN
NodeName=n2 NodeHostname={host} NodeAddr=127.0.0.1 Port={n2_port} CPUs=2 RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes=n1,n2 Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""


class Cluster:
    """A Slurm controller and two node daemons on this host, configured in a private directory."""

    dir: Path
    env: dict[str, str]

    def __init__(self, d: Path) -> None:
        self.dir = d
        (d / "state").mkdir(parents=True)
        conf = d / "slurm.conf"
        conf.write_text(SLURM_CONF.format(host=socket.gethostname().split(".")[0], d=d, ctld_port=free_port(),
                                          n1_port=free_port(), n2_port=free_port()))  # fmt: skip
        self.env = dict(os.environ, SLURM_CONF=str(conf), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1",
                        TOKENIZERS_PARALLELISM="false")  # fmt: skip

    def start(self) -> None:
        self.run(["slurmctld", "-c"])
        self.run(["slurmd", "-N", "n1"])
        self.run(["slurmd", "-N", "n2"])
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = self.run(["sinfo", "-h", "-o", "%t %D"], check=False).stdout.split()
            if out[:2] == ["idle", "2"]:
                return
            time.sleep(0.5)
        raise AssertionError(f"slurm nodes not idle: {out}\n{self.logs()}")

    def run(self, argv: list[str], check: bool = True, **kw) -> subprocess.CompletedProcess:  # type: ignore[no-untyped-def]
        return subprocess.run(argv, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                              check=check, timeout=120, **kw)  # fmt: skip

    def job(self, job_id: str) -> dict[str, str]:
        out = self.run(["scontrol", "show", "job", "-o", job_id], check=False).stdout
        return dict(kv.split("=", 1) for kv in out.split() if "=" in kv)

    def logs(self) -> str:
        return "\n".join(f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(self.dir.glob("*.log")))

    def stop(self) -> None:
        """Cancel every job and wait for them to end (their steps die with them), then stop the daemons."""
        self.run(["scancel", "--full", "--partition=debug"], check=False)
        deadline = time.monotonic() + 60
        while self.run(["squeue", "-h"], check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)
        pids = []
        for pid_file in sorted(self.dir.glob("*.pid")):  # the daemons this test started, by their pid files
            try:
                pids.append(int(pid_file.read_text().strip()))
                os.kill(pids[-1], 15)
            except (ValueError, ProcessLookupError):
                continue
        deadline = time.monotonic() + 30
        while any(Path(f"/proc/{pid}").exists() for pid in pids) and time.monotonic() < deadline:
            time.sleep(0.2)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    _ensure_slurm()
    c = Cluster(tmp_path_factory.mktemp("slurm"))
    c.start()
    yield c
    c.stop()


def _wait(what: str, cond, timeout_s: float, tails) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if cond():
            return
        time.sleep(1.0)
    raise AssertionError(f"timed out after {timeout_s}s waiting for {what}\n{tails()}")


def test_a_two_node_slurm_run_trains_and_an_added_generator_joins(cluster: Cluster, names: Names,
                                                                   tmp_path: Path) -> None:  # fmt: skip
    run_dir = tmp_path / "run"
    max_steps = 200  # 0.1-0.3 s a step here: the added generator (~20 s to start) joins well before the end
    env = {
        "RUN_PREFIX": names.prefix, "RUN_DIR": str(run_dir), "RDZV_PORT": str(free_port()),
        "LEARNER_ARGS": " ".join([*LEARNER_TEST_ARGS, f"max_steps={max_steps}"]),
        "GENERATOR_ARGS": " ".join(GENERATOR_TEST_ARGS),
    }  # fmt: skip
    main = cluster.run(["sbatch", "--parsable", "--nodes=2", f"--chdir={tmp_path}", str(SLURM / "async-rl.sbatch")],
                       env=env).stdout.strip()  # fmt: skip

    def tails() -> str:
        logs = sorted((run_dir / "logs").glob("*.log")) + sorted(tmp_path.glob("*.out"))
        text = "\n".join(f"--- {p.name}\n" + "\n".join(p.read_text(errors="replace").splitlines()[-20:]) for p in logs)
        return text + f"\n{cluster.job(main)}"

    def steps() -> int:
        rows = read_metrics(run_dir)
        return int(rows[-1]["step"]) if rows else 0

    def running_and(cond):  # type: ignore[no-untyped-def]
        def check() -> bool:
            state = cluster.job(main).get("JobState")
            assert state in ("PENDING", "RUNNING"), f"the run's job is {state}\n{tails()}"
            return bool(cond())

        return check

    # As soon as the job has written where its servers are: one more job, one more generator for the same run.
    _wait("the job's servers", running_and(lambda: (run_dir / "run.env").is_file()), 120, tails)
    servers_env = (run_dir / "servers.env").read_text()
    assert "redis://:" in servers_env and oct((run_dir / "servers.env").stat().st_mode)[-3:] == "600"
    added = cluster.run([str(SLURM / "add-generators.sh"), str(run_dir), "1", "1", f"--chdir={tmp_path}"],
                        env={"EXTRA_GENERATOR_ARGS": "heartbeat_interval_s=0.5"}).stdout.strip()  # fmt: skip
    added_log = run_dir / "logs" / f"generators-{added}-0.log"
    _wait("3 learner steps", running_and(lambda: steps() >= 3), 300, tails)
    job = cluster.job(main)
    assert job["JobState"] == "RUNNING" and job["NodeList"] == "n[1-2]", job

    def joined() -> bool:
        return added_log.is_file() and "engine is on weights version" in added_log.read_text()

    _wait("the added generator to load the run's weights", running_and(joined), 240, tails)
    status = _status(cluster, run_dir, names)
    ids = {g["id"] for g in status["generators"] if g["alive"]}
    assert {f"slurm-{main}-0", f"slurm-{added}-0"} <= ids, status["generators"]
    _wait("both jobs to end by themselves",
          lambda: all(cluster.job(j).get("JobState") not in ("PENDING", "RUNNING", "COMPLETING", None)
                      for j in (main, added)), 400, tails)  # fmt: skip
    for j in (main, added):
        job = cluster.job(j)
        assert (job["JobState"], job["ExitCode"]) == ("COMPLETED", "0:0"), (job, tails())
    assert steps() == max_steps
    added_text = added_log.read_text()
    assert "draining and exiting" in added_text, added_text[-2000:]
    done = int(added_text.split(f"generator slurm-{added}-0 exited: ")[1].split(" prompts done")[0])
    assert done > 0, added_text[-2000:]  # it took prompts of the run, not only its heartbeats
    main_gen = (run_dir / "logs" / f"generators-{main}-0.log").read_text()
    assert "draining and exiting" in main_gen
    assert not (run_dir / "servers.env").exists()  # the servers stopped with the job


def _status(cluster: Cluster, run_dir: Path, names: Names) -> dict:  # type: ignore[type-arg]
    urls = dict(line.split("=", 1) for line in (run_dir / "servers.env").read_text().split())
    out = cluster.run([sys.executable, "-m", "actors.commands.cli", "status", "--prefix", names.prefix,
                       "--redis-url", urls["ASYNC_RL_REDIS_URL"].strip("'"), "--nats-url",
                       urls["ASYNC_RL_NATS_URL"].strip("'"), "--listen-s", "2", "--json"])  # fmt: skip
    return json.loads(out.stdout)
