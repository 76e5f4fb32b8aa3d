"""Shared steps of the chaos tests: killing a publishing process in the middle of a version, and a generator (a
thread) that answers every issued prompt at once, so that all the time goes to the learner processes under test."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import threading
import time

import redis
import redis.asyncio as aioredis

from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.wire import encode_group
from buffer.entry_checks import ModelFacts
from tests.integration.poison import ack_prompt, fields_of, take_prompts, valid_record

TINY_MOE = ModelFacts(vocab_size=22, max_seq_len=256, num_moe_layers=2, top_k=2, num_experts=4)
"""The facts of the ``tiny-moe`` preset, which the learners of these tests train."""


async def kill_mid_version(script: str, servers: ServerSet, names: Names, redis_client: aioredis.Redis,
                           lines: tuple[bytes, ...], version: int = 1, bucket: int = 3) -> int:  # fmt: skip
    """Run ``script`` (``python -c``, argv: the Redis URL and the run prefix); once it has printed ``lines`` in
    order and bucket ``bucket`` of ``version`` is written (the version is going out), SIGKILL it. Returns its
    exit code."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", script, servers.redis_url, names.prefix, stdout=asyncio.subprocess.PIPE
    )
    try:
        assert proc.stdout is not None
        for line in lines:
            assert (await asyncio.wait_for(proc.stdout.readline(), 120)).strip() == line
        deadline = time.monotonic() + 60
        while await redis_client.exists(names.weights_bucket(version, bucket)) == 0:
            assert time.monotonic() < deadline and proc.returncode is None, f"v{version} never started going out"
            await asyncio.sleep(0.005)
        os.kill(proc.pid, signal.SIGKILL)
        return await asyncio.wait_for(proc.wait(), 10)
    finally:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()


def answer_prompts(url: str, names: Names, stop: threading.Event, errors: list[BaseException], batch: int) -> None:
    """A thread's target: until ``stop``, answer each issued prompt at once with a valid tiny-moe group of 2 samples
    sampled (it says) with the newest published version; errors go to ``errors`` for the test to report."""
    r = redis.Redis.from_url(url)
    seed = 0
    try:
        while not stop.is_set():
            for eid, spec in take_prompts(r, names, batch, block_ms=100):
                version = int(r.get(names.weights_latest) or 0)
                seed += 1
                rec = valid_record(spec.prompt_id, spec.prompt_ids, TINY_MOE, version=version, num_samples=2,
                                   seed=seed)  # fmt: skip
                r.xadd(names.rollouts_stream, fields_of(encode_group(rec), spec.prompt_id))
                ack_prompt(r, names, eid)
    except BaseException as exc:  # reported by the test
        errors.append(exc)
    finally:
        r.close()
