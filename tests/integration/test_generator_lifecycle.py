"""A generator process's lifecycle: a failing background task ends it with a clear error, and SIGTERM is
honoured while it still waits for its first weights (real processes, real Redis and NATS)."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import redis.asyncio as aioredis

from async_rl.model.presets import build_model
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.weights import PublisherConfig, WeightPublisher
from async_rl.weights.redis_transport import RedisTransport
from tests.integration.procs import GENERATOR_TEST_ARGS

# The generator's own entry point, with its weight-fetch loop broken the way a bug would break it: the first
# wake-up raises. Nothing else is changed: servers, engine, prompts and heartbeats are the real ones.
_BROKEN_FETCH = """
import sys
from actors.generator import weight_sync
from actors.generator.main import main

async def broken_fetch_loop(self):
    await self._wake.wait()
    raise RuntimeError("injected: the fetch loop broke")

weight_sync.WeightSync._fetch_loop = broken_fetch_loop
sys.exit(main(sys.argv[1:]))
"""


def _args(servers: ServerSet, names: Names, *extra: str) -> list[str]:
    own = [a for a in GENERATOR_TEST_ARGS if not a.startswith("transport.url=")]  # these tests publish through Redis
    return [f"run.prefix={names.prefix}", f"run.redis_url={servers.redis_url}", f"run.nats_url={servers.nats_url}",
            *own, "generator_id=lifecycle", *extra]  # fmt: skip


def _env() -> dict[str, str]:
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")


def _publish(servers: ServerSet, names: Names, version: int) -> None:
    async def publish() -> None:
        client = aioredis.Redis.from_url(servers.redis_url)
        pub = WeightPublisher(client, RedisTransport(servers.redis_url, names), names, PublisherConfig())
        weights = {k: t.clone() for k, t in build_model("tiny-moe", seed=version).state_dict().items()}
        await pub.publish(weights, version)
        await pub.transport.close()
        await client.aclose()

    asyncio.run(publish())


def test_a_failing_weight_fetch_task_ends_the_process_with_its_error(servers: ServerSet, names: Names,
                                                                     tmp_path: Path) -> None:  # fmt: skip
    _publish(servers, names, 0)
    log = tmp_path / "gen.log"
    args = _args(servers, names, "weight_sync.poll_interval_s=0.2")
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-c", _BROKEN_FETCH, *args], stdout=out, stderr=subprocess.STDOUT,
                                env=_env())  # fmt: skip
        try:
            # The first version loads (start); the fetch loop, woken by it, breaks at once.
            code = proc.wait(120)
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert code == 1, text
    # One line naming the process, the task and the error; no traceback for the user to dig through.
    assert "async-rl generator: lifecycle: the weights task failed: RuntimeError: injected: the fetch loop broke" in text
    assert "Traceback" not in text
    assert "generator lifecycle exited: 0 prompts done, released 0 prompts" in text


def test_sigterm_while_waiting_for_the_first_weights_exits_promptly(servers: ServerSet, names: Names,
                                                                    tmp_path: Path) -> None:  # fmt: skip
    log = tmp_path / "gen.log"
    with log.open("wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "actors.commands", "generator",
                                 *_args(servers, names, "weight_sync.wait_log_interval_s=0.5")],
                                stdout=out, stderr=subprocess.STDOUT, env=_env())  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while "still waiting for weights of prefix" not in log.read_text() and time.monotonic() < deadline:
                assert proc.poll() is None, log.read_text()
                time.sleep(0.2)
            assert f"still waiting for weights of prefix '{names.prefix}' at {servers.redis_url}" in log.read_text()
            proc.send_signal(signal.SIGTERM)
            t0 = time.monotonic()
            code = proc.wait(30)
            took_s = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
    text = log.read_text()
    assert code == 0, text
    assert took_s < 10, f"SIGTERM took {took_s:.1f}s\n{text}"
    assert "stopped before the first weights arrived" in text and "released 0 prompts" in text


def test_a_generator_waiting_for_weights_exits_when_its_redis_goes_away(servers: ServerSet, tmp_path: Path) -> None:
    """No silent waiting: Redis lost while the generator waits for its first weights gives bounded retries (the
    client's, then weight_sync.max_retries reads in a row), then exit 1 with one line naming the URL."""
    import uuid

    from async_rl.servers.embedded import start_redis

    own = start_redis()
    names = Names(prefix=f"t-lostgen-{uuid.uuid4().hex[:8]}")
    args = [f"run.prefix={names.prefix}", f"run.redis_url={own.url}", f"run.nats_url={servers.nats_url}",
            *GENERATOR_TEST_ARGS, "generator_id=lostgen", "weight_sync.poll_interval_s=0.2",
            "weight_sync.max_retries=2"]  # fmt: skip
    log = tmp_path / "gen.log"
    try:
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "actors.commands", "generator", *args], stdout=out,
                                    stderr=subprocess.STDOUT, env=_env())  # fmt: skip
        try:
            deadline = time.monotonic() + 120
            while "loading the newest weight version" not in log.read_text():
                assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.2)
            own.stop()
            t0 = time.monotonic()
            code = proc.wait(120)
            took_s = time.monotonic() - t0
        finally:
            if proc.poll() is None:
                proc.kill()
    finally:
        own.stop()
    text = log.read_text()
    last = text.strip().splitlines()[-1]
    assert code == 1, text
    assert last.startswith(f"async-rl generator: lostgen: lost Redis at {own.url}"), last
    assert "Traceback" not in text
    print(f"\nRedis lost while waiting for weights: exit 1 after {took_s:.1f} s: {last}")
