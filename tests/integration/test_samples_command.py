"""``async-rl samples``: real groups written by the generators' writer into a real server, printed as text, and the
stream left exactly as it was (read-only); the one-line errors of an unreachable server, a wrong prefix and a run
without a rollout stream; ``--follow`` printing a group appended after it started."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis
import redis.asyncio as aioredis

from actors.commands.samples import main
from actors.learner.config import LearnerConfig
from async_rl.config.configurable import load_config
from async_rl.entry import save_resolved_config
from async_rl.model import toy_tokenizer as tt
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from async_rl.tasks.config import TaskConfig, build_task
from async_rl.tasks.transcript import ENV_CLOSE, ENV_OPEN
from async_rl.wire.types import GroupRecord, Sample
from buffer.prompts import PromptQueue
from buffer.rollout_writer import RolloutWriter, RolloutWriterConfig

ROOT = Path(__file__).resolve().parents[2]


def _sample(task: Any, meta: dict[str, Any], text: str, versions: tuple[int, int], *, env: str = "") -> Sample:
    """A response of ``text`` then ``<eos>``, scored by the task; with ``env``, an environment's reply in the middle."""
    model = tt.encode(text)
    ids = [*model[:2], *tt.encode(env), *model[2:], tt.EOS_ID] if env else [*model, tt.EOS_ID]
    mask = None
    if env:
        mask = np.array([1, 1] + [0] * len(tt.encode(env)) + [1] * (len(model) - 1), dtype=np.uint8)
    r = np.array(ids, dtype=np.int32)
    score = task.score(meta, r)
    return Sample(response_ids=r, logprobs=np.full(r.size, -0.5, np.float32),
                  versions=np.linspace(*versions, r.size).round().astype(np.int32), reward=score.reward,
                  finish_reason="stop", reward_info=score.info, loss_mask=mask)  # fmt: skip


async def _write_run(servers: ServerSet, names: Names, tmp_path: Path) -> tuple[Path, list[GroupRecord]]:
    """A run as a learner and a generator leave it: prompts issued, groups of them in the rollout stream (one
    through a payload key), the learner's config in its run directory."""
    cfg = load_config(LearnerConfig, None, [f"run.prefix={names.prefix}", f"run.redis_url={servers.redis_url}",
                                            f"run.nats_url={servers.nats_url}", "task.name=copy", "sampling.n=2",
                                            f"run.run_dir={tmp_path / 'run'}"])  # fmt: skip
    save_resolved_config(cfg, cfg.run.run_dir, "learner")
    task = build_task(TaskConfig(name="copy"))
    specs = [task.prompt(i) for i in range(3)]
    client = aioredis.Redis.from_url(servers.redis_url)
    try:
        await PromptQueue(client, names).issue(specs, 3)
        groups = []
        for i, spec in enumerate(specs):
            target = spec.metadata["target"]
            samples = [_sample(task, spec.metadata, target, (3, 4)), _sample(task, spec.metadata, "12", (4, 4))]
            if i == 2:
                samples[1] = _sample(task, spec.metadata, target, (4, 4), env="<7>")
            groups.append(GroupRecord(group_id=f"g{i}", prompt_id=spec.prompt_id, generator_id="gen-0",
                                      created_at=time.time(), prompt_ids=spec.prompt_ids, samples=samples,
                                      metadata={"task": "copy"}))  # fmt: skip
        await RolloutWriter(client, names).append(groups[0])
        await RolloutWriter(client, names, RolloutWriterConfig(inline_max_bytes=0)).append(groups[1])  # a payload key
        await RolloutWriter(client, names).append(groups[2])
    finally:
        await client.aclose()
    return cfg.run.run_dir, groups


async def _append(servers: ServerSet, names: Names, group: GroupRecord) -> None:
    client = aioredis.Redis.from_url(servers.redis_url)
    try:
        await RolloutWriter(client, names).append(group)
    finally:
        await client.aclose()


def _state(servers: ServerSet, names: Names) -> tuple[Any, ...]:
    """Everything a read could have changed: the stream's entries, its groups, the payload keys, the counters."""
    c = redis.Redis.from_url(servers.redis_url)
    try:
        groups = c.xinfo_groups(names.rollouts_stream) if c.exists(names.rollouts_stream) else []
        payloads = sorted(c.scan_iter(match=names.rollout_payload("*")))
        return (c.xrange(names.rollouts_stream), groups, payloads, c.hgetall(names.rollout_counters),
                c.xrange(names.prompts_stream))  # fmt: skip
    finally:
        c.close()


def test_samples_prints_the_newest_groups_and_touches_nothing(servers: ServerSet, names: Names, tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    run_dir, groups = asyncio.run(_write_run(servers, names, tmp_path))
    before = _state(servers, names)
    assert main([str(run_dir), "--n", "2"]) == 0
    out = capsys.readouterr().out
    after = _state(servers, names)
    assert after == before and len(before[2]) == 1  # nothing acked, claimed, deleted or counted; the payload stays
    assert "group g0" not in out and out.index("== group g1") < out.index("== group g2")  # the newest 2, oldest first
    g1, g2 = groups[1], groups[2]
    text = tt.decode(np.asarray(g1.prompt_ids).tolist(), skip_special=False)
    assert text.startswith("<bos>") and f"prompt ({g1.prompt_ids.size} tokens):\n    {text}\n" in out
    target = g1.samples[0]
    assert f"    {tt.decode(target.response_ids.tolist(), skip_special=False)}\n" in out
    # Rewards and components as the task scored them; the advantage the learner gives (GRPO of the group's rewards).
    assert target.reward == 1.0 and g1.samples[1].reward < 1.0
    rewards = np.array([s.reward for s in g1.samples])
    adv = (rewards - rewards.mean()) / (rewards.std(ddof=1) + 1e-6)
    line = next(line for line in out.splitlines() if line.startswith("sample 0:") and "v3-4" in line)
    assert "reward 1.000 (exact 1.000" in line and f"advantage {adv[0]:+.3f} (grpo)" in line and "stop" in line
    # The episode's environment turn is marked, and counted.
    env_line = out.split("== group g2")[1].split("sample 1:")[1].splitlines()
    assert "(3 environment's)" in env_line[0]
    assert env_line[1].startswith(f"    {tt.decode(g2.samples[1].response_ids[:2].tolist())}{ENV_OPEN}<7>{ENV_CLOSE}")

    # A TOML config names the same run; the printout is the same.
    toml = tmp_path / "learner.toml"
    toml.write_text(f'[run]\nprefix = "{names.prefix}"\nredis_url = "{servers.redis_url}"\n'
                    '[task]\nname = "copy"\n[sampling]\nn = 2\n')  # fmt: skip
    assert main([str(toml), "--n", "2"]) == 0
    assert capsys.readouterr().out == out


def test_samples_says_what_is_wrong_in_one_line(servers: ServerSet, names: Names, tmp_path: Path,
                                                      capsys: pytest.CaptureFixture[str]) -> None:  # fmt: skip
    run_dir, _ = asyncio.run(_write_run(servers, names, tmp_path))
    assert main([str(run_dir), "--redis-url", "redis://127.0.0.1:1/0"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("async-rl samples: cannot reach Redis at redis://127.0.0.1:1/0") and "\n" not in err
    empty = tmp_path / "not-a-run"
    empty.mkdir()
    assert main([str(empty)]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"async-rl samples: {str(empty)!r} has no learner-config.json") and "\n" not in err
    other = Names(prefix=f"{names.prefix}-nope")
    toml = tmp_path / "other.toml"
    toml.write_text(f'[run]\nprefix = "{other.prefix}"\nredis_url = "{servers.redis_url}"\n[task]\nname = "copy"\n')
    assert main([str(toml)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"async-rl samples: no run {other.prefix!r} at {servers.redis_url}") and "\n" not in err
    c = redis.Redis.from_url(servers.redis_url)  # a run whose prompts went out and no group came back yet
    try:
        c.delete(names.rollouts_stream)
    finally:
        c.close()
    assert main([str(run_dir)]) == 1
    err = capsys.readouterr().err.strip()
    assert err == (f"async-rl samples: run {names.prefix!r} at {servers.redis_url} has no rollout stream "
                   f"({names.rollouts_stream}): no generator has written a group yet")  # fmt: skip


def test_follow_prints_groups_as_they_come(servers: ServerSet, names: Names, tmp_path: Path) -> None:
    run_dir, groups = asyncio.run(_write_run(servers, names, tmp_path))
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-m", "actors.commands.cli", "samples", str(run_dir), "--n", "1",
                             "--follow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        assert proc.stdout is not None
        seen = []
        while not any("== group g2" in line for line in seen):
            seen.append(proc.stdout.readline())
            assert seen[-1] or proc.poll() is None, proc.stderr.read() if proc.stderr else ""
        late = GroupRecord(group_id="g-late", prompt_id=groups[0].prompt_id, generator_id="gen-1",
                           created_at=time.time(), prompt_ids=groups[0].prompt_ids, samples=groups[0].samples)  # fmt: skip
        asyncio.run(_append(servers, names, late))
        while not any("== group g-late" in line for line in seen):
            seen.append(proc.stdout.readline())
            assert seen[-1], proc.stderr.read() if proc.stderr else ""
        assert "generator gen-1" in seen[-1]
        proc.send_signal(signal.SIGINT)
        assert proc.wait(30) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
