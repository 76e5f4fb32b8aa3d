"""``/metrics`` scraped from a live learner and a live generator, and the learner's scaling signal on NATS and in
``async-rl status`` (real processes, real Redis and NATS)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from async_rl.run.names import Names
from async_rl.servers.control import ControlPlane, Message, ScalingSignal
from async_rl.servers.embedded import ServerSet, free_port
from tests.integration.procs import Procs

pytestmark = pytest.mark.slow


def scrape(port: int) -> dict[str, float]:
    """Every sample of ``/metrics`` as ``name{sorted labels but run/generator}`` -> value."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        assert resp.status == 200
        text = resp.read().decode()
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            extra = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k not in ("run", "generator"))
            out[s.name + (f"{{{extra}}}" if extra else "")] = s.value
    return out


def _scaling_signals(servers: ServerSet, names: Names, listen_s: float) -> list[ScalingSignal]:
    got: list[ScalingSignal] = []

    async def listen() -> None:
        plane = await ControlPlane(servers.nats_url, name="test").connect()

        async def on_signal(msg: Message) -> None:
            assert isinstance(msg, ScalingSignal)
            got.append(msg)

        await plane.subscribe(names.scaling_subject, on_signal, kinds=(ScalingSignal,))
        await asyncio.sleep(listen_s)
        await plane.close()

    asyncio.run(listen())
    return got


def test_metrics_and_the_scaling_signal_of_a_live_run(procs: Procs, servers: ServerSet, names: Names) -> None:
    learner_port, gen_port = free_port(), free_port()
    procs.learner("max_steps=200", f"prometheus.port={learner_port}", "prometheus.host=127.0.0.1")
    procs.generator("gen-0", f"prometheus.port={gen_port}", "prometheus.host=127.0.0.1")

    def learner_steps() -> float:
        try:
            return scrape(learner_port).get("async_rl_learner_steps_total", 0.0)
        except OSError:
            return 0.0

    procs.wait_for("3 learner steps on /metrics", lambda: learner_steps() >= 3, timeout_s=300, interval_s=1.0)
    lm = scrape(learner_port)
    step = lm["async_rl_learner_step"]
    assert step >= 3 and lm["async_rl_learner_version"] >= step and lm["async_rl_learner_published_version"] >= step
    # 8 groups per step, each observed once in the staleness histogram; the copy task is near on-policy here.
    groups = lm["async_rl_learner_group_staleness_versions_count"]
    assert groups >= 8 * 3 and groups % 8 == 0
    assert lm['async_rl_learner_group_staleness_versions_bucket{le=+Inf}'] == groups
    assert lm['async_rl_learner_group_staleness_versions_bucket{le=4.0}'] == groups  # max_staleness 4, drop mode
    assert lm["async_rl_learner_tokens_total"] > 0 and lm["async_rl_learner_tokens_per_second"] > 0
    assert 0.0 <= lm["async_rl_learner_wait_share"] <= 1.0
    assert lm["async_rl_learner_generators_alive"] == 1
    assert lm["async_rl_learner_suggested_generators"] >= 1
    for name in ("rollout_backlog_groups", "dead_letters", "prompts_dropped_stale", "prompts_in_flight",
                 "step_seconds", "reward"):  # fmt: skip
        assert f"async_rl_learner_{name}" in lm, name

    # The generator reports the version it uses at each heartbeat: wait for one after it applied a learner version
    # (the learner can take 3 steps on what the generator sampled with the first version, S = 4).
    def generator_version() -> float:
        return scrape(gen_port).get("async_rl_generator_version", 0.0)

    procs.wait_for("the generator on a learner version", lambda: generator_version() >= 1, timeout_s=120,
                   interval_s=0.5)  # fmt: skip
    gm = scrape(gen_port)
    assert gm["async_rl_generator_prompts_total"] >= 8 * 3
    assert gm["async_rl_generator_tokens_total"] > 0
    assert gm["async_rl_generator_heartbeats_total"] >= 1
    assert gm["async_rl_generator_version"] >= 1
    assert gm["async_rl_generator_weight_fetch_seconds_count"] >= 1  # every staged version after the first
    assert gm["async_rl_generator_weight_fetch_seconds_sum"] > 0
    assert 0.0 <= gm["async_rl_generator_weight_swap_pause_seconds"] < 1.0
    assert gm["async_rl_generator_weight_failures"] == 0
    for name in ("tokens_per_second", "in_flight_prompts"):
        assert f"async_rl_generator_{name}" in gm, name

    # The scaling signal: on NATS after every step, and in `async-rl status`.
    signals = _scaling_signals(servers, names, listen_s=15.0)
    assert signals, procs.tails()
    last = signals[-1]
    assert last.generators == 1 and last.suggested_generators >= 1 and last.decision in ("up", "down", "hold")
    assert 0.0 <= last.wait_share <= 1.0 and last.reason
    assert [s.step for s in signals] == sorted(s.step for s in signals)
    out = subprocess.run([sys.executable, "-m", "actors.commands.cli", "status", "--prefix", names.prefix,
                          "--redis-url", servers.redis_url, "--nats-url", servers.nats_url, "--listen-s", "1",
                          "--json"], capture_output=True, text=True, timeout=60)  # fmt: skip
    assert out.returncode == 0, out.stderr
    scaling = json.loads(out.stdout)["scaling"]
    assert scaling["step"] >= last.step and scaling["generators"] == 1
    assert set(scaling) >= {"wait_share", "backlog_groups", "backlog_batches", "suggested_generators", "decision"}
    human = subprocess.run([sys.executable, "-m", "actors.commands.cli", "status", "--prefix", names.prefix,
                            "--redis-url", servers.redis_url, "--nats-url", servers.nats_url, "--listen-s", "1"],
                           capture_output=True, text=True, timeout=60, env=dict(os.environ, COLUMNS="200"))  # fmt: skip
    assert "scaling signal" in human.stdout and "suggested" in human.stdout, human.stdout + human.stderr

    t0 = time.monotonic()
    procs.stop("learner")
    procs.stop("gen-0")
    print(f"stopped in {time.monotonic() - t0:.1f}s")


def test_a_port_in_use_is_named(servers: ServerSet, names: Names, tmp_path: Path) -> None:
    """The learner refuses to start when its /metrics port is taken, saying which."""
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        p = Procs(servers, names, tmp_path / "run")
        try:
            proc = p.learner("max_steps=1", f"prometheus.port={port}", "prometheus.host=127.0.0.1")
            assert proc.wait(120) != 0
        finally:
            p.close()
        log = p.log("learner")
        assert f"async-rl learner: cannot serve /metrics on 127.0.0.1:{port}" in log and "Traceback" not in log, log
