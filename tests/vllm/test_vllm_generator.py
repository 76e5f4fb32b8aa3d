"""A vLLM generator process feeding a torch learner, end to end, against real Redis and NATS.

The learner (tiny MoE preset, copy task, R3 replay of the generator's routes) trains a few steps on
groups a single ``async-rl generator`` with ``engine=vllm`` produced, following the learner's weight
versions (published under transformers' in-memory names) as it goes. Then the same in synchronous mode
(``staleness.sync``, the baseline of ``bench async``): every group sampled by the version its prompt names.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.wire import decode_group
from tests.integration.procs import Procs

pytestmark = pytest.mark.vllm

NUM_STEPS = 3
VLLM_GENERATOR_ARGS = [
    "engine=vllm", "vllm.model.name=tiny-moe", "vllm.kv_cache_mib=64", "vllm.max_batch_prompts=8",
    "task.name=copy", "prompts.reclaim_idle_ms=3000", "read_block_ms=200", "heartbeat_interval_s=0.5",
]  # fmt: skip


class _Heartbeats:
    """The run's generator heartbeats, heard on NATS in a thread of their own while the processes run."""

    def __init__(self, url: str, subject: str) -> None:
        self.beats: list[Any] = []
        self._ready, self._stop = threading.Event(), threading.Event()
        self._thread = threading.Thread(target=lambda: asyncio.run(self._listen(url, subject)), daemon=True)
        self._thread.start()
        assert self._ready.wait(30), "no NATS subscription for the heartbeats"

    async def _listen(self, url: str, subject: str) -> None:
        from async_rl.servers.control import ControlPlane, Heartbeat

        async def put(m: Any) -> None:
            self.beats.append(m)

        async with ControlPlane(url) as control:
            await control.subscribe(subject, put, kinds=(Heartbeat,))
            await control.flush()
            self._ready.set()
            await asyncio.to_thread(self._stop.wait)

    def close(self) -> None:
        self._stop.set()
        self._thread.join(10)


@pytest.mark.parametrize("follow", ["front", "core"])
def test_vllm_generator_feeds_the_learner(servers: ServerSet, names: Names, tmp_path: Path, follow: str) -> None:
    """``vllm.follow``: the generator's process follows the learner's versions, or vLLM's engine core does
    (actors/generator/vllm_follow.py: its thread fetches each version and the scheduler loads it between steps)."""
    procs = Procs(servers, names, tmp_path / "run")
    beats = _Heartbeats(servers.nats_url, names.heartbeat_subject)
    try:
        procs.learner(f"max_steps={NUM_STEPS}", "batch_groups=4")
        # on_run_end=wait: the generator outlives the learner's run end, so that it is stopped by SIGTERM below
        # (with the default, exit, it races its own exit against that signal).
        procs.start("gen-vllm", "generator", [*VLLM_GENERATOR_ARGS, "generator_id=gen-vllm", "on_run_end=wait",
                                              f"vllm.follow={follow}"])  # fmt: skip
        procs.wait_for("the learner's steps", lambda: procs.procs["learner"].poll() is not None, timeout_s=420)
        assert procs.procs["learner"].returncode == 0, procs.tails()
        rows = procs.metrics()
        assert [int(r["step"]) for r in rows] == list(range(1, NUM_STEPS + 1)), procs.tails()

        client = redis.Redis.from_url(servers.redis_url)
        try:
            groups = []
            for _, f in client.xrange(names.rollouts_stream):
                data = f.get(b"rec") or client.get(f[b"ref"])
                groups.append(decode_group(data))
        finally:
            client.close()
        assert groups, "no rollout record left in the stream to inspect"
        versions = set()
        for g in groups:
            assert g.generator_id == "gen-vllm"
            for s in g.samples:
                versions.update(int(v) for v in s.versions)
                assert np.all(np.isfinite(s.logprobs)) and np.all(s.logprobs <= 0)
                assert s.routes is not None and s.routes.dtype == np.uint8
                assert s.routes.shape[1:] == (2, 2)  # tiny-moe: 2 MoE layers, top-2
                assert s.routes.shape[0] == g.prompt_ids.size + s.response_ids.size - 1
        print(f"{len(groups)} groups left in the stream, token versions {sorted(versions)}")
        assert min(versions) >= 0, versions  # generated only with the learner's weights, never the init ones
        assert procs.stop("gen-vllm") == 0, procs.tails()
        log = procs.log("gen-vllm")
        if follow == "front":
            assert "vLLM engine: version" in log and "in use" in log, procs.tails()
        else:
            assert "the engine core follows versions" in log and "vLLM engine: version" not in log, procs.tails()
            assert max(versions) >= 1, versions  # versions after the first were taken by the engine core too
        # What bench loop's version_to_applied_s and version_to_staged_s read, either way.
        applied = [x for b in beats.beats for x in b.applied_latency_s]
        staged = [x for b in beats.beats for x in b.staged_latency_s]
        assert applied and staged and all(0 <= x < 60 for x in applied + staged), (applied, staged)
        assert max(b.version for b in beats.beats) >= 1
    finally:
        beats.close()
        procs.close()


def test_vllm_generator_in_synchronous_mode(servers: ServerSet, names: Names, tmp_path: Path) -> None:
    procs = Procs(servers, names, tmp_path / "run")
    try:
        procs.learner(f"max_steps={NUM_STEPS}", "batch_groups=4", "staleness.max_staleness=0", "staleness.sync=true",
                      "admission_lag_versions=0")  # fmt: skip
        procs.start("gen-vllm", "generator", [*VLLM_GENERATOR_ARGS, "generator_id=gen-vllm", "on_run_end=wait"])
        procs.wait_for("the learner's steps", lambda: procs.procs["learner"].poll() is not None, timeout_s=420)
        assert procs.procs["learner"].returncode == 0, procs.tails()
        rows = procs.metrics()
        assert [int(r["step"]) for r in rows] == list(range(1, NUM_STEPS + 1)), procs.tails()
        for r in rows:  # every trained token sampled by the version the step trained from
            stale = {k: float(v) for k, v in r.items() if k.startswith("loss/staleness_hist_") and k.endswith("_count")}
            assert stale and sum(stale.values()) == stale.get("loss/staleness_hist_0_count"), (r["step"], stale)
        assert "dropped" not in procs.log("learner"), procs.tails()  # and nothing was sampled in vain
        assert procs.stop("gen-vllm") == 0, procs.tails()
    finally:
        procs.close()
