"""Several tasks in one run (``task.mix``): prompts drawn by weight from the seed alone and resumed by index, each
labelled with its source and scored by its member (a generator runs an environment member's episodes and a text
member's single turns in one batch), per-source training metrics, the mixture in the task facts a generator must
share, the config's one-line refusals, and reasoning-gym's own ``composite`` mixtures."""

from __future__ import annotations

import collections
import dataclasses
import time

import numpy as np
import pytest

from actors.generator.config import GeneratorConfig
from actors.generator.engine import SamplingParams
from actors.generator.process import Generator
from actors.learner.config import LearnerConfig
from actors.learner.samples import source_metrics
from async_rl.config.configurable import ConfigError, load_config
from async_rl.model import toy_tokenizer as tt
from async_rl.tasks import identity
from async_rl.tasks.config import build_task
from async_rl.tasks.mixture import CHUNK, MixtureTask
from async_rl.wire.types import GroupRecord, Sample
from buffer.prompts import PromptEntry
from tests.unit.test_torch_engine import make_engine

MIX = 'task.mix=[{"name": "copy", "weight": 3}, {"name": "reverse"}, {"name": "add", "weight": 0, "source": "sum"}]'


def _learner(*overrides: str) -> LearnerConfig:
    return load_config(LearnerConfig, None, list(overrides))


def test_prompts_are_drawn_by_weight_labelled_and_resumed_by_index() -> None:
    cfg = _learner(MIX, "task.seed=5")
    assert cfg.task.name == "mix" and [m.weight for m in cfg.task.mix] == [3.0, 1.0, 0.0]
    task = build_task(cfg.task)
    assert isinstance(task, MixtureTask) and task.sources == ("copy", "reverse", "sum")
    n = CHUNK + 1000  # across a chunk boundary
    specs = [task.prompt(i) for i in range(n)]
    counts = collections.Counter(s.metadata["source"] for s in specs)
    assert counts["sum"] == 0 and abs(counts["copy"] / n - 0.75) < 0.03, counts  # weight 0: never trained on
    for source in ("copy", "reverse"):  # each member's own stream, in order, nothing skipped or repeated
        ids = [s.prompt_id for s in specs if s.metadata["source"] == source]
        assert ids == [f"{source}/{source}-5-{k}" for k in range(len(ids))]
        member = build_task(dataclasses.replace(cfg.task.mix[0 if source == "copy" else 1], seed=5))  # 5 + its 0
        mine = [s for s in specs if s.metadata["source"] == source][:50]
        assert [m.metadata["prompt"] for m in mine] == [member.prompt(k).metadata["prompt"] for k in range(50)]
    # A learner resuming at prompt i asks for it directly: the same prompt, quickly.
    fresh = build_task(cfg.task)
    t0 = time.monotonic()
    assert fresh.prompt(n - 1).prompt_id == specs[-1].prompt_id
    far = fresh.prompt(5_000_000)
    assert time.monotonic() - t0 < 5.0 and build_task(cfg.task).prompt(5_000_000).prompt_id == far.prompt_id
    other_seed = build_task(_learner(MIX, "task.seed=6").task)
    assert [other_seed.prompt(i).prompt_id for i in range(20)] != [s.prompt_id for s in specs[:20]]
    # Scored by its member; the held-out split of a weight-0 member is there for evaluation.
    spec = specs[0]
    right = np.array([*tt.encode(spec.metadata["target"]), tt.EOS_ID], dtype=np.int32)
    assert task.score(spec.metadata, right).reward == 1.0
    assert task.answer(spec.metadata, right) == spec.metadata["target"]
    held = task.eval_prompt_of("sum", 0)
    assert held.prompt_id == "sum/add-5-eval-0" and held.metadata["source"] == "sum"
    with pytest.raises(ValueError, match="no held-out split of its own"):
        task.eval_prompt(0)
    with pytest.raises(ValueError, match=r"task.mix has no source 'nope' \(its sources: copy, reverse, sum\)"):
        task.task_for({"source": "nope"})


@pytest.mark.parametrize(("overrides", "message"), [
    (['task.mix=[{"name": "copy"}, {"name": "copy"}]'],
     r"task.mix\[1\].source 'copy' is task.mix\[0\]'s too: give each member a source of its own"),
    (['task.mix=[{"name": "copy", "weight": 0}]'], "every member has weight 0"),
    (['task.mix=[{"name": "copy", "weight": -1}]'], r"task.mix\[0\].weight must be a finite number >= 0"),
    (['task.mix=[{"name": "jsonl"}]'], r"task.mix\[0\].jsonl_path is required when task.name is 'jsonl'"),
    (['task.mix=[{"name": "copy", "weght": 2}]'], r"task.mix\[0\]: weght \(did you mean weight\?\)"),
    (['task.mix=[{"name": "copy", "source": "a/b"}]'], r"task.mix\[0\].source 'a/b' must be letters"),
    (['task.mix=[{"name": "copy", "mix": [{"name": "reverse"}]}]'], r"task.mix\[0\].mix: a member of a mixture"),
    (['task.mix=[{"name": "copy"}]', "task.name=reverse"], "task.name 'reverse' and task.mix are both set"),
    (['task.mix=[{"name": "copy"}]', "task.max_digits=7"], r"task.max_digits applies to one task: with task.mix, set "
                                                           r"it on the members \(task.mix\[j\].max_digits\)"),
    (["task.name=mix"], "task.mix is required when task.name is 'mix'"),
    (['task.mix=[{"name": "copy"}, {"name": "jsonl", "jsonl_path": "x", "tokenizer": "tiny-moe"}]'],
     r"task.mix\[1\].tokenizer 'tiny-moe' differs from task.mix\[0\].tokenizer ''"),
    ([MIX, "eval.interval_versions=2", 'eval.sources=["copy", "nope"]'],
     r"eval.sources: 'nope' is not a source of the task \(its sources: copy, reverse, sum\)"),
    ([MIX, "eval.n=2", "eval.k=[1,4]"], r"^eval.k must each be in \[1, 2\] \(1 to eval.n\), got \[1, 4\]$"),
])  # fmt: skip
def test_mixture_config_errors_are_one_line_naming_the_member(overrides: list[str], message: str, tmp_path) -> None:
    with pytest.raises(ConfigError, match=message) as err:
        _learner(*[o.replace('"x"', f'"{tmp_path}/x.jsonl"') for o in overrides])
    assert "\n" not in str(err.value)


def test_an_evaluated_member_without_a_held_out_split_is_refused_by_source(tmp_path) -> None:
    rows = tmp_path / "rows.jsonl"
    rows.write_text('{"prompt": "12=", "answer": "12"}\n')
    mix = f'task.mix=[{{"name": "copy"}}, {{"name": "jsonl", "jsonl_path": "{rows}", "source": "mine"}}]'
    with pytest.raises(ConfigError, match=r"task.name 'jsonl' \(source 'mine' of task.mix\) has no held-out split: "
                                          r"set task.eval_jsonl_path"):  # fmt: skip
        _learner(mix, "eval.interval_versions=2")
    assert _learner(mix, "eval.interval_versions=2", 'eval.sources=["copy"]').eval.sources == ["copy"]


def test_the_mixture_is_a_fact_a_generator_must_share() -> None:
    ours = identity.task_facts(_learner('task.mix=[{"name": "copy", "weight": 3}, {"name": "reverse"}]').task)
    assert ours["task.name"] == "mix" and ours["task.mix"] == '["copy", "reverse"]'
    assert ours["task.mix[1].name"] == "reverse" and "task.mix[0].weight" not in ours  # weights: the learner's only
    same = identity.task_facts(_learner('task.mix=[{"name": "copy"}, {"name": "reverse"}]').task)
    assert identity.differences(ours, same) == []
    other = identity.task_facts(_learner('task.mix=[{"name": "copy"}, {"name": "reverse", "strict_length": false,'
                                         ' "max_new_tokens": 9}]').task)  # fmt: skip
    assert identity.differences(ours, other) == ["task.mix[1].strict_length True here, False in the run",
                                                 "task.mix[1].max_new_tokens 0 here, 9 in the run"]  # fmt: skip
    assert identity.differences(identity.task_facts(_learner("task.name=copy").task), ours)[0] == \
        "task.name 'copy' here, 'mix' in the run"  # fmt: skip
    swapped = identity.task_facts(_learner('task.mix=[{"name": "reverse"}, {"name": "copy"}]').task)
    assert identity.differences(swapped, ours)[0] == 'task.mix \'["reverse", "copy"]\' here, \'["copy", "reverse"]\' in the run'


def test_training_metrics_per_source() -> None:
    def group(source: str, rewards: list[float], exact: list[float]) -> GroupRecord:
        samples = [Sample(response_ids=np.array([5], np.int32), logprobs=np.zeros(1, np.float32),
                          versions=np.zeros(1, np.int32), reward=r, finish_reason="stop", reward_info={"exact": e})
                   for r, e in zip(rewards, exact, strict=True)]  # fmt: skip
        return GroupRecord(group_id=source, prompt_id=source, generator_id="g", created_at=0.0,
                           prompt_ids=np.array([1], np.int32), samples=samples, metadata={"source": source})  # fmt: skip

    got = source_metrics([group("copy", [1.0, 0.5], [1.0, 0.0]), group("rev", [0.0, 0.0], [0.0, 0.0]),
                          group("copy", [0.5, 0.0], [0.0, 0.0])])  # fmt: skip
    assert got == {"train/copy/reward": 0.5, "train/copy/groups": 2.0, "train/copy/reward/exact": 0.25,
                   "train/rev/reward": 0.0, "train/rev/groups": 1.0, "train/rev/reward/exact": 0.0}  # fmt: skip
    plain = group("copy", [1.0], [1.0])
    plain.metadata = {"task": "copy"}
    assert source_metrics([plain]) == {}  # a task that is not a mixture: its step metrics say it all


async def test_a_generator_runs_an_environment_member_and_a_text_member_in_one_batch() -> None:
    from async_rl.model.presets import build_model

    cfg = load_config(GeneratorConfig, None, ['task.mix=[{"name": "copy", "max_digits": 3, "min_digits": 3}, '
                                              '{"name": "tool_copy", "max_digits": 3, "min_digits": 3}]'])  # fmt: skip
    task = build_task(cfg.task)
    gen = Generator(cfg, task=task)
    gen._engine = make_engine(build_model("tiny-moe", seed=0))
    try:
        specs = [task.prompt(i) for i in range(12)]
        kinds = [s.metadata["source"] for s in specs]
        assert set(kinds) == {"copy", "tool_copy"}
        entries = [PromptEntry(entry_id=f"{i}-0", spec=s, issued_version=0, issued_at=0.0) for i, s in enumerate(specs)]
        scored = await gen._generate(entries, SamplingParams(n=2, max_new_tokens=4))
    finally:
        await gen._engine.close()
    assert len(scored) == len(specs)
    for spec, group in zip(specs, scored, strict=True):
        assert not group.failed and len(group.samples) == 2
        for s in group.samples:
            if spec.metadata["source"] == "tool_copy":  # an episode: two model turns, the tool's reply masked out
                assert "episode/turns" in s.reward_info and s.loss_mask is not None and "called" in s.reward_info
            else:  # one turn, scored by copy's reward
                assert s.loss_mask is None and set(s.reward_info) == {"exact", "length_ok"}
    # As evaluation results: under their source, with the answers a text member extracts (an environment has none).
    for entry, group in zip(entries, scored, strict=True):
        result = gen._scoring.eval_result(task, entry, group.samples, "g")
        source = entry.spec.metadata["source"]
        assert result.label == source and result.rewards == [s.reward for s in group.samples]
        want = [None, None] if source == "tool_copy" else [task.answer(entry.spec.metadata, s.response_ids)
                                                            for s in group.samples]  # fmt: skip
        assert result.answers == want and (source == "tool_copy" or all(isinstance(a, str) for a in want))


def test_reasoning_gym_composite_datasets_work(tmp_path) -> None:
    pytest.importorskip("reasoning_gym")
    from async_rl.model.byte_tokenizer import EOS_ID, build_byte_tokenizer
    from async_rl.model.presets import save_pretrained_dir
    from async_rl.tasks.config import TaskConfig

    model_dir = save_pretrained_dir(tmp_path / "m", preset="tiny-moe", tokenizer="bytes")
    # As TOML or an override writes it: a list of tables (reasoning-gym wants DatasetSpec objects: this used to raise
    # AttributeError: 'dict' object has no attribute 'name').
    cfg = _learner("task.name=reasoning_gym", "task.dataset=composite", f"task.tokenizer={model_dir}",
                   'task.dataset_config={"datasets": [{"name": "chain_sum", "weight": 1}, {"name": "basic_arithmetic",'
                   ' "weight": 2, "config": {"min_terms": 2, "max_terms": 2}}]}', "eval.interval_versions=2").task
    assert cfg.dataset_config["datasets"][0] == {"name": "chain_sum", "weight": 1}  # the facts stay plain JSON
    task = build_task(cfg)
    tok = build_byte_tokenizer()
    sources = collections.Counter()
    for spec in [task.prompt(i) for i in range(30)] + [task.eval_prompt(j) for j in range(5)]:
        entry = task._data[spec.metadata["entry"]]  # type: ignore[attr-defined]
        sources[entry["metadata"]["source_dataset"]] += 1
        right = tok(f"<answer>{entry['answer']}</answer>", add_special_tokens=False).input_ids + [EOS_ID]
        assert task.score(spec.metadata, np.array(right)).reward == 1.0  # the scorer of the dataset it came from
        assert task.score(spec.metadata, np.array(tok("x", add_special_tokens=False).input_ids)).reward < 1.0
        assert task.answer(spec.metadata, np.array(right)) == str(entry["answer"])
    assert set(sources) == {"chain_sum", "basic_arithmetic"}
    for bad, message in [({"datasets": []}, "non-empty list"), ({"datasets": [{"weight": 1}]}, r"datasets\[0\] must be"),
                         ({"datasets": [{"name": "nope"}]}, r"datasets\[0\].name 'nope' is not a reasoning-gym dataset")]:
        with pytest.raises(ValueError, match=message):
            build_task(TaskConfig(name="reasoning_gym", dataset="composite", tokenizer=str(model_dir),
                                  dataset_config=bad))  # fmt: skip
