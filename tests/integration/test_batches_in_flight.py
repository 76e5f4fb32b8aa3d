"""Several batches generating at once (``generator.batches_in_flight``, actors/generator/work.py): the generator
holds the prompts of two batches at a time, and every group still reaches the learner exactly once (real learner
and generator processes, real Redis and NATS, the torch engine)."""

from __future__ import annotations

import time
from typing import Any

import msgpack
import redis

from async_rl.run.names import Names
from tests.integration.procs import Procs


def _held_by(client: redis.Redis, names: Names, consumer: str) -> int:
    """Prompts the consumer group has handed to ``consumer`` and not yet seen acked (0 before the group exists)."""
    try:
        info: Any = client.xpending_range(names.prompts_stream, names.prompts_group, "-", "+", 1000,
                                          consumername=consumer)  # fmt: skip
    except redis.ResponseError as exc:
        if "NOGROUP" not in str(exc):
            raise
        return 0
    return len(info)


def _most_held(procs: Procs, consumer: str, *extra: str) -> int:
    procs.learner("batch_groups=8", "max_steps=4", "sampling.max_new_tokens=48")
    procs.generator(consumer, "torch.max_batch_prompts=2", *extra)
    client = redis.Redis.from_url(procs.servers.redis_url)
    most = 0
    deadline = time.monotonic() + 240
    try:
        while procs.procs["learner"].poll() is None and time.monotonic() < deadline:
            most = max(most, _held_by(client, procs.names, consumer))
            time.sleep(0.01)
        assert procs.procs["learner"].poll() == 0, procs.tails()
        assert procs.stop(consumer) == 0, procs.tails()
    finally:
        client.close()
    rows = procs.metrics()
    assert [(r["step"], r["groups"]) for r in rows] == [(1, 8), (2, 8), (3, 8), (4, 8)], rows
    ckpt = procs.run_dir / "checkpoints"
    seen = msgpack.unpackb((ckpt / (ckpt / "latest").read_text().strip() / "seen_groups.msgpack").read_bytes())
    assert len(seen) == len(set(seen)) == 32, "a group trained twice or lost"
    return most


def test_two_batches_in_flight_hold_two_batches_of_prompts(procs: Procs) -> None:
    most = _most_held(procs, "gen-two", "batches_in_flight=2")
    assert most > 2, f"the generator never held more than one batch of 2 prompts ({most})"
    assert most <= 4, f"the generator held {most} prompts: more than two batches of 2"


def test_one_batch_in_flight_holds_one_batch(procs: Procs) -> None:
    assert _most_held(procs, "gen-one", "batches_in_flight=1") <= 2
