"""What a learner step shows beyond its loss: the policy's entropy (reported without changing the update), response
lengths, and a table of trained samples as text written beside the metrics (samples.jsonl, a wandb table)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.learner.batching import make_micro_batches
from actors.learner.config import BatchingConfig, LearnerConfig, TorchBackendConfig
from actors.learner.samples import build_samples, response_metrics
from actors.learner.samples_table import SamplesTableConfig, table_rows
from actors.learner.torch_backend import TorchBackend
from async_rl.algorithms import AlgorithmConfig, make_loss_fn
from async_rl.metrics.sinks import SAMPLES_FILE, SAMPLES_KEY, MetricsConfig, MetricsLogger, read_metrics
from async_rl.model import toy_tokenizer as tt
from async_rl.tasks.config import TaskConfig, build_task
from async_rl.tasks.transcript import ENV_CLOSE, ENV_OPEN
from async_rl.wire.sampling import Sampling
from async_rl.wire.types import GroupRecord, Sample
from tests.unit.test_torch_backend import _dense_model, _samples


def _groups() -> list[GroupRecord]:
    """Three copy-task groups of 3 samples, scored by the task; the last sample of group 1 an episode (``<7>`` the
    environment's) and the last of group 2 cut at the token budget."""
    task = build_task(TaskConfig(name="copy"))
    groups = []
    for gi in range(3):
        spec = task.prompt(gi)
        target = spec.metadata["target"]
        samples = []
        for i, text in enumerate((target, target[:3], "1")):
            ids = [*tt.encode(text), tt.EOS_ID]
            mask = None
            if gi == 1 and i == 2:
                ids, mask = [*tt.encode("1<7>2"), tt.EOS_ID], np.array([1, 0, 0, 0, 1, 1], dtype=np.uint8)
            r = np.array(ids, dtype=np.int32)
            samples.append(Sample(response_ids=r, logprobs=np.full(r.size, -1.0, np.float32),
                                  versions=np.full(r.size, 5 + i, np.int32), reward=task.score(spec.metadata, r).reward,
                                  finish_reason="length" if gi == 2 and i == 2 else "stop",
                                  reward_info=task.score(spec.metadata, r).info, loss_mask=mask))  # fmt: skip
        groups.append(GroupRecord(group_id=f"g{gi}", prompt_id=spec.prompt_id, generator_id="gen", created_at=1.0,
                                  prompt_ids=spec.prompt_ids, samples=samples))  # fmt: skip
    return groups


def test_response_metrics_are_the_lengths_of_the_batch() -> None:
    groups = _groups()
    lengths = [s.response_ids.size for g in groups for s in g.samples]
    m = response_metrics(groups)
    assert m == {"response/length_mean": pytest.approx(np.mean(lengths)), "response/length_max": max(lengths),
                 "response/length_p50": np.percentile(lengths, 50), "response/length_p90": np.percentile(lengths, 90),
                 "response/truncated_frac": pytest.approx(1 / 9)}  # fmt: skip
    assert sorted(set(lengths)) == [2, 4, 6] and response_metrics([]) == {}


def test_the_table_takes_samples_across_groups_with_the_advantage_they_were_trained_with() -> None:
    groups, task = _groups(), build_task(TaskConfig(name="copy"))
    cfg = LearnerConfig(batch_groups=3, sampling=Sampling(n=3))
    rows = table_rows(groups, task, cfg.algorithm, version=7, num_samples=5)
    assert [(r["group_id"], r["sample"]) for r in rows] == [("g0", 0), ("g1", 0), ("g2", 0), ("g0", 1), ("g1", 1)]
    trained, _, _ = build_samples(groups, cfg)
    by_sample = {(t.group_id, i): float(t.advantages[0]) for g in groups
                 for i, t in enumerate(t for t in trained if t.group_id == g.group_id)}  # fmt: skip
    for r in rows:
        assert r["advantage"] == pytest.approx(by_sample[(r["group_id"], r["sample"])], abs=1e-6)
        assert r["version"] == 7 and r["min_version"] == r["max_version"] == 5 + r["sample"]
    first = rows[0]
    assert first["prompt"] == tt.decode(groups[0].prompt_ids.tolist(), skip_special=False)
    assert first["response"] == task.prompt(0).metadata["target"] + "<eos>"
    assert first["reward"] == 1.0 and first["reward_info"]["exact"] == 1.0 and first["advantage"] > 0
    episode = table_rows(groups[1:2], task, cfg.algorithm, version=7, num_samples=3)[2]
    assert episode["response"] == f"1{ENV_OPEN}<7>{ENV_CLOSE}2<eos>" and episode["env_tokens"] == 3
    assert json.loads(json.dumps(rows)) == rows  # what the checkpoint keeps until the step's commit


def test_samples_table_config_errors_name_the_field() -> None:
    assert SamplesTableConfig().due(10) and not SamplesTableConfig().due(9)
    assert not SamplesTableConfig(every_steps=0).due(10)
    with pytest.raises(ValueError, match="learner.samples_table.every_steps must be >= 0"):
        SamplesTableConfig(every_steps=-1)
    with pytest.raises(ValueError, match="learner.samples_table.num_samples must be >= 1"):
        SamplesTableConfig(num_samples=0)


@pytest.mark.parametrize("wandb_mode", ["disabled", "offline"])
def test_a_rows_samples_go_to_samples_jsonl_and_a_wandb_table(tmp_path: Path, wandb_mode: str) -> None:
    if wandb_mode == "offline":
        pytest.importorskip("wandb")
    groups, task = _groups(), build_task(TaskConfig(name="copy"))
    rows = table_rows(groups, task, AlgorithmConfig(), version=3, num_samples=2)
    m = MetricsLogger(MetricsConfig(wandb_mode=wandb_mode), tmp_path, config={}, name="t")  # type: ignore[arg-type]
    m.log(2, {"reward": 0.5, "samples": 9})
    m.log(3, {"reward": 0.6, "samples": 9, SAMPLES_KEY: rows})
    m.close()
    assert read_metrics(tmp_path) == [{"step": 2, "time": pytest.approx(0, abs=1e10), "reward": 0.5, "samples": 9},
                                      {"step": 3, "time": pytest.approx(0, abs=1e10), "reward": 0.6, "samples": 9}]  # fmt: skip
    assert read_metrics(tmp_path, SAMPLES_FILE) == [{"step": 3, **r} for r in rows]
    if wandb_mode == "offline":
        tables = list((tmp_path / "wandb").glob(f"offline-run-*/files/media/table/{SAMPLES_KEY}_*.table.json"))
        assert len(tables) == 1, sorted(p.name for p in (tmp_path / "wandb").rglob("*"))
        table = json.loads(tables[0].read_text())
        assert table["columns"][:6] == ["step", "version", "group_id", "prompt_id", "sample", "prompt"]
        assert [row[2] for row in table["data"]] == ["g0", "g1"] and table["data"][0][6] == rows[0]["response"]


def test_entropy_is_reported_and_the_update_is_the_same() -> None:
    """The learner asks for the entropy every step (``learner.entropy_metric``): ``entropy_mean`` is the mean over the
    trained tokens of the policy's entropy, and with ``entropy_coef`` 0 the weights after the step are bit for bit
    those of a step without it, on the chunked path and on the full logits."""
    mbs = make_micro_batches(_samples(5, seed=3), BatchingConfig(micro_batch_tokens=40))
    assert len(mbs) > 1
    loss_fn = make_loss_fn(AlgorithmConfig(), learner_version=0)
    for chunk in (4096, 0):
        after = []
        for with_entropy in (False, True):
            backend = TorchBackend(_dense_model(), TorchBackendConfig(lr=1e-2, device="cpu",
                                                                      logprob_chunk_tokens=chunk))  # fmt: skip
            outs = [backend.forward_logprobs(mb, with_entropy=True, replay_routes=False) for mb in mbs]
            res = backend.train_step(mbs, loss_fn, replay_routes=False, with_entropy=with_entropy)
            after.append({n: p.detach().clone() for n, p in backend.model.named_parameters()})
            if with_entropy:
                ent = torch.cat([o.entropy[mb.loss_mask] for o, mb in zip(outs, mbs, strict=True)])
                assert res.metrics["entropy_mean"] == pytest.approx(float(ent.mean()), rel=1e-5)
                assert 0 < res.metrics["entropy_mean"] < np.log(32)
            else:
                assert "entropy_mean" not in res.metrics
        assert all(torch.equal(after[0][n], after[1][n]) for n in after[0]), chunk
    assert LearnerConfig().entropy_metric
