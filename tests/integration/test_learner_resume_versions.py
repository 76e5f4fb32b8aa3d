"""A learner SIGKILLed between a publish and the checkpoint covering it resumes (issue 21).

With ``checkpoint.every`` > 1 the published weights run ahead of the checkpoint; the restarted learner used to
crash on its first publish ("weights version 11 is not newer than the latest published version 17", the
quickstart's checkpoint.every=10). Now the versions of the lost steps are skipped: the restored weights go out as
the next version and training goes on.
"""

from __future__ import annotations

import re
import signal

import pytest
import redis

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from tests.integration.procs import Procs

pytestmark = pytest.mark.slow


def test_killed_between_publish_and_checkpoint_resumes_on_a_new_version(procs: Procs, servers: ServerSet,
                                                                        names: Names) -> None:  # fmt: skip
    client = redis.Redis.from_url(servers.redis_url)

    def published() -> int:
        return int(client.get(names.weights_latest) or -1)

    try:
        # No checkpoint before the kill (every 100 steps), so the published versions are surely ahead of it.
        procs.learner("max_steps=14", "checkpoint.every=100")
        procs.generator("gen-0")
        procs.wait_for("a few versions published", lambda: published() >= 5, timeout_s=240)
        procs.stop("learner", signal.SIGKILL)
        lost = published()
        procs.learner("max_steps=14", "checkpoint.every=100", name="learner-2")
        procs.wait_for("restarted learner done", lambda: procs.procs["learner-2"].poll() is not None, timeout_s=300)
        assert procs.procs["learner-2"].returncode == 0, procs.tails()
        assert "came from steps lost with the previous learner" in procs.log("learner-2")
        rows = procs.metrics()
        assert [r["step"] for r in rows] == list(range(1, 15))  # every committed step logged once
        # The restored (here: initial) weights went out as lost + 1, or past a version the killed learner was still
        # writing (staged, never committed: its number is never reused, actors/learner/publishing.py); each step adds
        # one.
        writing = re.search(r"weights v(\d+) were being written when the previous learner left", procs.log("learner-2"))
        restored = (int(writing.group(1)) if writing else lost) + 1
        assert restored >= lost + 1
        assert [r["version"] for r in rows] == [restored + r["step"] for r in rows]
        assert published() == rows[-1]["version"]
    finally:
        client.close()


def test_restart_over_peer_transport_publishes_the_restored_weights_again(procs: Procs, servers: ServerSet,
                                                                          names: Names) -> None:  # fmt: skip
    """peer:// keeps a version's bytes in the processes that hold it: after the learner (and every generator) went
    away, the visible version had no source. The restarted learner publishes its restored weights again as a new
    version, and a generator started after it gets on weights."""
    peer = "transport.url=peer://127.0.0.1:0?fanout=2"
    client = redis.Redis.from_url(servers.redis_url)

    def published() -> int:
        return int(client.get(names.weights_latest) or -1)

    try:
        procs.learner("max_steps=6", peer)
        procs.generator("gen-0", peer)
        procs.wait_for("the run to end", lambda: procs.procs["learner"].poll() is not None, timeout_s=240)
        assert procs.procs["learner"].returncode == 0, procs.tails()
        procs.stop("gen-0")
        before = published()
        procs.learner("max_steps=40", peer, name="learner-2")
        again = f"weights v{before} were served by the previous learner (transport peer keeps no bytes)"
        procs.wait_for("the restored weights out again", lambda: again in procs.log("learner-2"), timeout_s=240)
        procs.wait_for("a version past the visible one", lambda: published() > before, timeout_s=60)
        procs.generator("gen-1", peer)
        procs.wait_for("gen-1 on weights", lambda: "engine is on weights version" in procs.log("gen-1"), timeout_s=120)
        assert procs.procs["learner-2"].poll() is None, procs.tails()
    finally:
        client.close()
