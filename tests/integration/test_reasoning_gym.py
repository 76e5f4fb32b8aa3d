"""A reasoning-gym dataset trained by the quickstart's processes (a learner, a generator; real servers): the prompts
are the dataset's questions in a byte-level tokenizer's ids, rendered by its chat template (the learner logs the
first), the dataset's own scorer's reward reaches the learner's metrics, and held-out evaluation rounds every 2
versions reach metrics.jsonl, wandb (offline) and ``status``; the samples table shows what the model read and wrote."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
import redis

from actors.commands.status import snapshot
from async_rl.metrics.sinks import SAMPLES_FILE, read_metrics
from async_rl.model.presets import save_pretrained_dir
from async_rl.run.config import RunConfig
from async_rl.run.names import Names
from async_rl.servers.embedded import ServerSet
from tests.integration.procs import Procs

pytest.importorskip("reasoning_gym")

STEPS = 6
EVAL_EVERY = 2
EVAL_PROMPTS = 4


def rg_args(model_dir: Path) -> list[str]:
    """What the learner and the generators of a reasoning-gym run share: the task, read with the model's tokenizer."""
    return ["task.name=reasoning_gym", "task.dataset=basic_arithmetic", f"task.tokenizer={model_dir}",
            "task.dataset_config.min_terms=2", "task.dataset_config.max_terms=2", "task.dataset_config.min_digits=1",
            "task.dataset_config.max_digits=1", "task.max_new_tokens=6"]  # fmt: skip


def test_reasoning_gym_trains_with_its_scorer_and_is_evaluated_every_n_versions(
    procs: Procs, tmp_path: Path, servers: ServerSet, names: Names
) -> None:
    model_dir = save_pretrained_dir(tmp_path / "model", preset="tiny-moe", tokenizer="bytes")
    procs.learner(f"max_steps={STEPS}", "batch_groups=4", "sampling.n=4", f"model.name={model_dir}",
                  f"eval.interval_versions={EVAL_EVERY}", f"eval.num_prompts={EVAL_PROMPTS}", "eval.n=2",
                  "metrics.wandb_mode=offline", "publisher.background=false", "samples_table.every_steps=3",
                  *rg_args(model_dir))  # fmt: skip
    procs.generator("gen-0", f"torch.model.name={model_dir}", *rg_args(model_dir))
    procs.wait_for(f"{STEPS} learner steps", lambda: procs.procs["learner"].poll() is not None, timeout_s=300)
    assert procs.procs["learner"].returncode == 0, procs.tails()
    rows = procs.metrics()
    assert len(rows) == STEPS, procs.tails()
    for r in rows:  # the dataset's scorer: reward in [0, 1], "correct" when it is 1
        assert 0.0 <= r["reward"] <= 1.0 and 0.0 <= r["reward/correct"] <= r["reward"] + 1e-9, r
    # The learner said once what the model reads: the question rendered by init-model's chat template, with the
    # answer format the scorer extracts.
    [first] = [line for line in procs.log("learner").splitlines() if "first prompt" in line]
    assert "as the model reads it" in first and "'<bos><|im_start|>user\\nCalculate " in first, first
    assert "\\n\\nGive your final answer between <answer> and </answer> tags.<eos><|im_start|>assistant\\n'" in first

    key = "eval/basic_arithmetic"
    evaluated = [r for r in rows if f"{key}/reward" in r]
    rounds = [int(r[f"{key}/version"]) for r in evaluated]
    assert len(rounds) >= 2 and rounds == sorted(set(rounds)) and rounds[0] == 0, rows
    assert all(v % EVAL_EVERY == 0 for v in rounds)
    for r in evaluated:
        assert r[f"{key}/num_prompts"] == EVAL_PROMPTS and 0.0 <= r[f"{key}/reward"] <= 1.0
        # Inline publishing: the round's own version is out when it is issued, and no older one samples it.
        assert r[f"{key}/weights_version_min"] >= r[f"{key}/version"]
        assert f"{key}/correct" in r

    # Never trained on, never in training's accounting: every trained group is a training prompt.
    client = redis.Redis.from_url(servers.redis_url)
    try:
        audit = {k.decode(): int(v) for k, v in client.hgetall(names.audit_counters).items()}
        assert audit["trained"] == STEPS * 4 and audit["issued"] == audit["trained"] + client.hlen(names.audit_open) \
            + audit.get("dropped_stale", 0) + audit.get("dead_lettered", 0)  # fmt: skip
        fates = client.xrange(names.audit_fates)
        assert not any(b"@v" in f[b"pid"] for _, f in fates)
    finally:
        client.close()
    snap = asyncio.run(snapshot(RunConfig(prefix=names.prefix, redis_url=servers.redis_url), {}, 0.0))
    assert snap["eval"]["latest"][f"{key}/version"] == rounds[-1]
    assert snap["eval"]["prompts"]["evaluated"] >= len(rounds) * EVAL_PROMPTS

    # wandb (offline): every reported round is a history record of the run's file (protobuf: the key in plain bytes).
    files = sorted((procs.run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, procs.tails()
    data = files[-1].read_bytes()
    assert data.count(f"{key}/version".encode()) >= len(rounds) and data.count(b"reward/correct") >= STEPS

    # The samples table of steps 3 and 6: the prompts as the model read them, the responses decoded, in
    # samples.jsonl and as wandb tables; the entropy and the response lengths in every row.
    samples = read_metrics(procs.run_dir, SAMPLES_FILE)
    assert [s["step"] for s in samples] == [3] * 4 + [6] * 4 and len({s["group_id"] for s in samples[:4]}) == 4
    assert all(s["prompt"].startswith("<bos><|im_start|>user\nCalculate ") for s in samples), samples[0]
    assert all(isinstance(s["response"], str) and 0 < s["response_tokens"] <= 6 for s in samples)
    tables = sorted((procs.run_dir / "wandb").glob("offline-run-*/files/media/table/samples_table_*.table.json"))
    assert len(tables) == 2, tables
    assert all(r["loss/entropy_mean"] > 0 and r["response/length_max"] <= 6 for r in rows), rows[-1]
