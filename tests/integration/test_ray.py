"""scripts/ray/generators.py on a local autoscaling Ray cluster (Ray's fake multi-node provider: worker "nodes"
are raylets on this host): the controller starts one generator actor for a running learner, follows the learner's
scaling signal up to two, Ray's autoscaler launches a node for each actor (only worker nodes have the ``generator``
resource), both generators train with the tiny CPU model, and when the learner reaches max_steps they exit 0 and so
does the controller."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet, free_port
from tests.integration.procs import GENERATOR_TEST_ARGS, Procs

pytestmark = pytest.mark.slow
ray = pytest.importorskip("ray")

ROOT = Path(__file__).resolve().parents[2]
MAX_STEPS = 1500
"""Long enough for the controller to add the second generator: with weights published in the background a learner
step here takes ~0.06 s, and at 300 steps the run ended 20 s in, before the autoscaled node came up."""


def _autoscaling_config(gcs_address: str) -> dict:  # type: ignore[type-arg]
    """A fake multi-node cluster: a head without the ``generator`` resource, up to two nodes that have it."""
    return {
        "cluster_name": "async-rl-test", "max_workers": 2, "upscaling_speed": 1.0, "idle_timeout_minutes": 0.1,
        "provider": {"type": "fake_multinode", "use_node_id_as_ip": True, "disable_node_updaters": True,
                     "disable_launch_config_check": True, "gcs_address": gcs_address},
        "available_node_types": {
            "ray.head.default": {"resources": {"CPU": 1}, "node_config": {}, "max_workers": 0},
            "generator-node": {"resources": {"CPU": 1, "generator": 1}, "node_config": {}, "min_workers": 0,
                               "max_workers": 2},
        },
        "head_node_type": "ray.head.default", "auth": {}, "docker": {}, "file_mounts": {}, "cluster_synced_files": [],
        "file_mounts_sync_continuously": False, "rsync_exclude": [], "rsync_filter": [],
        "initialization_commands": [], "setup_commands": [], "head_setup_commands": [], "worker_setup_commands": [],
        "head_start_ray_commands": [], "worker_start_ray_commands": [],
    }  # fmt: skip


def _marked_pids(marker: str) -> list[int]:
    """Processes whose environment carries this test's marker: the Ray processes it started, and nothing else."""
    pids = []
    for environ in Path("/proc").glob("[0-9]*/environ"):
        try:
            if marker.encode() in environ.read_bytes():
                pids.append(int(environ.parent.name))
        except (OSError, ValueError):
            continue
    return [p for p in pids if p != os.getpid()]


@pytest.fixture
def ray_cluster(tmp_path: Path) -> Iterator[tuple[str, Path]]:
    port = free_port()
    address = f"127.0.0.1:{port}"
    config = tmp_path / "autoscaling.json"
    config.write_text(json.dumps(_autoscaling_config(address)))
    marker = f"ASYNC_RL_RAY_TEST={uuid.uuid4().hex}"
    env = dict(os.environ, RAY_FAKE_CLUSTER="1", AUTOSCALER_UPDATE_INTERVAL_S="1", RAY_USAGE_STATS_ENABLED="0")
    env[marker.split("=")[0]] = marker.split("=")[1]
    log = tmp_path / "ray-head.log"
    temp_dir = tempfile.mkdtemp(prefix="ray-", dir="/tmp")  # short: Ray's socket paths must fit in 107 bytes
    with log.open("wb") as out:
        head = subprocess.Popen(["ray", "start", "--head", "--block", f"--port={port}", "--num-cpus=1",
                                 "--include-dashboard=false", f"--autoscaling-config={config}",
                                 f"--temp-dir={temp_dir}"], stdout=out, stderr=subprocess.STDOUT,
                                env=env, start_new_session=True)  # fmt: skip
    try:
        deadline = time.monotonic() + 120
        while "Ray runtime started" not in log.read_text(errors="replace"):
            assert head.poll() is None and time.monotonic() < deadline, log.read_text(errors="replace")
            time.sleep(0.5)
        yield address, log
    finally:
        head.send_signal(signal.SIGTERM)
        try:
            head.wait(60)
        except subprocess.TimeoutExpired:
            head.kill()
        for sig in (signal.SIGTERM, signal.SIGKILL):  # fake worker nodes outlive the head: ours, by the marker
            for pid in _marked_pids(marker):
                try:
                    os.kill(pid, sig)
                except ProcessLookupError:
                    continue
            time.sleep(2)
        shutil.rmtree(temp_dir, ignore_errors=True)


def _status(servers: ServerSet, names: Names) -> dict:  # type: ignore[type-arg]
    """``async-rl status --json`` of the run; no generators yet while the learner has not written its state (status
    then says there is no run there, and exits 1)."""
    out = subprocess.run([sys.executable, "-m", "actors.commands.cli", "status", "--prefix", names.prefix,
                          "--redis-url", servers.redis_url, "--nats-url", servers.nats_url, "--listen-s", "2",
                          "--json"], capture_output=True, text=True, timeout=60)  # fmt: skip
    if out.returncode != 0 and f"no run {names.prefix!r}" in out.stderr:
        return {"generators": []}
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_ray_generators_follow_the_learner_and_leave_with_the_run(ray_cluster: tuple[str, Path], servers: ServerSet,
                                                                  names: Names, tmp_path: Path) -> None:  # fmt: skip
    address, head_log = ray_cluster
    procs = Procs(servers, names, tmp_path / "run")
    try:
        # The learner suggests more generators whenever it waits for rollouts at all (wait_share_high=0: whether
        # one CPU generator starves it depends on the machine, and this test is about Ray following the signal;
        # the thresholds have their unit tests), capped at two.
        procs.learner(f"max_steps={MAX_STEPS}", "scaling.window_steps=3", "scaling.max_generators=2",
                      "scaling.wait_share_high=0", "scaling.wait_share_low=0")
        ctl_log = tmp_path / "controller.log"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", RAY_USAGE_STATS_ENABLED="0")
        with ctl_log.open("wb") as out:
            ctl = subprocess.Popen([sys.executable, str(ROOT / "scripts" / "ray" / "generators.py"), "--address",
                                    address, "--prefix", names.prefix, "--redis-url", servers.redis_url,
                                    "--nats-url", servers.nats_url, "--min", "1", "--max", "2", "--num-cpus", "1",
                                    "--resources", '{"generator": 1}', "--interval-s", "1", "--",
                                    *GENERATOR_TEST_ARGS], stdout=out, stderr=subprocess.STDOUT, env=env)  # fmt: skip

        def tails() -> str:
            return f"{procs.tails()}\n--- controller\n{ctl_log.read_text()[-3000:]}\n--- head\n" + head_log.read_text(
                errors="replace")[-2000:]

        def two_ray_generators_alive() -> bool:
            assert ctl.poll() is None, tails()
            gens = [g for g in _status(servers, names)["generators"] if g["id"].startswith("ray-") and g["alive"]]
            return len(gens) == 2 and all(g["version"] >= 1 for g in gens)

        procs.wait_for("two generator actors on autoscaled nodes", two_ray_generators_alive, timeout_s=300,
                       interval_s=2.0)  # fmt: skip
        assert ctl.wait(300) == 0, tails()
        assert procs.procs["learner"].wait(60) == 0, tails()
        text = ctl_log.read_text()
        assert "scaling up 1 -> 2 (learner's suggestion)" in text, tails()
        exits = [line for line in text.splitlines() if "exited with 0" in line]
        assert len(exits) == 2, tails()
        nodes = {line.split(" on node ")[1].split()[0] for line in exits}
        assert len(nodes) == 2, exits  # one autoscaled node per actor: the head has no 'generator' resource
        assert f"run {names.prefix} ended at step {MAX_STEPS} (max_steps); every generator has exited" in text
    finally:
        procs.close()
        if "ctl" in locals() and ctl.poll() is None:
            ctl.kill()
