"""Text tasks with no download: the byte-level tokenizer and model directory, reasoning-gym datasets with their held-out
split and scorers, math-verify as a JSONL reward."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from async_rl.model.byte_tokenizer import BOS_ID, EOS_ID, VOCAB_SIZE, build_byte_tokenizer
from async_rl.model.presets import save_pretrained_dir
from async_rl.model.token_mask import masked_token_ids
from async_rl.tasks import TaskConfig, build_task
from async_rl.tasks.reasoning_gym import ANSWER_FORMAT, HELD_OUT_START, ReasoningGymTask

pytest.importorskip("reasoning_gym")
pytest.importorskip("math_verify")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_pretrained_dir(tmp_path_factory.mktemp("bytes") / "m", preset="tiny-moe", tokenizer="bytes")


def test_byte_tokenizer_round_trips_any_text_and_the_directory_loads_offline(model_dir: Path) -> None:
    tok = build_byte_tokenizer()
    text = "Calculate 5 - 3 * (2 / 7).\néß 日本 \t<b>"
    ids = tok(text, add_special_tokens=False).input_ids
    assert ids == [4 + b for b in text.encode()]  # one token per byte, in byte order
    assert tok.decode([BOS_ID, *ids, EOS_ID], skip_special_tokens=True) == text
    loaded = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    assert loaded(text, add_special_tokens=False).input_ids == ids
    model = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    assert model.config.vocab_size == VOCAB_SIZE == len(loaded)
    assert EOS_ID not in masked_token_ids(str(model_dir)) and BOS_ID in masked_token_ids(str(model_dir))


def test_reasoning_gym_task_splits_scores_and_rebuilds_entries(model_dir: Path) -> None:
    cfg = TaskConfig(name="reasoning_gym", dataset="basic_arithmetic", tokenizer=str(model_dir), seed=3,
                     dataset_config={"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 1})  # fmt: skip
    task = build_task(cfg)
    assert isinstance(task, ReasoningGymTask) and task.num_prompts is None
    tok = build_byte_tokenizer()
    train = [task.prompt(i) for i in range(20)]
    held_out = [task.eval_prompt(i) for i in range(20)]
    assert {p.metadata["entry"] for p in train}.isdisjoint({p.metadata["entry"] for p in held_out})
    assert all(p.metadata["entry"] >= HELD_OUT_START for p in held_out)
    assert task.prompt(5).prompt_ids.tolist() == train[5].prompt_ids.tolist()  # deterministic by index
    p = train[0]  # the directory's tokenizer has a chat template: the question is a user message, then the format
    assert p.metadata["prompt"].startswith("Calculate") and p.metadata["prompt"].endswith("\n")
    assert tok.decode(p.prompt_ids) == (f"<bos><|im_start|>user\n{p.metadata['prompt'].rstrip()}\n\n{ANSWER_FORMAT}"
                                        "<eos><|im_start|>assistant\n")  # fmt: skip
    json.dumps(p.metadata)  # small and plain: it travels in the prompt record
    # A second task from the same config (the generator's) scores the learner's prompt with the dataset's scorer.
    scorer = build_task(cfg)
    answer = task._data[p.metadata["entry"]]["answer"]  # the oracle answer
    right = tok(answer, add_special_tokens=False).input_ids + [EOS_ID, 7, 7]
    tagged = tok(f"think <answer>{answer}</answer>", add_special_tokens=False).input_ids
    wrong = tok(answer + "1", add_special_tokens=False).input_ids
    assert scorer.score(p.metadata, right).reward == 1.0 and scorer.score(p.metadata, right).info == {"correct": 1.0}
    assert scorer.score(p.metadata, tagged).reward == 1.0
    assert scorer.score(p.metadata, wrong).info["correct"] == 0.0
    other = build_task(TaskConfig(name="reasoning_gym", dataset="chain_sum", tokenizer=str(model_dir)))
    with pytest.raises(ValueError, match="scored by task.dataset"):
        other.score(p.metadata, right)


def test_reasoning_gym_config_errors_name_the_field(model_dir: Path) -> None:
    with pytest.raises(ValueError, match="task.dataset is required"):
        TaskConfig(name="reasoning_gym", tokenizer=str(model_dir))
    with pytest.raises(ValueError, match="task.tokenizer is required"):
        TaskConfig(name="reasoning_gym", dataset="basic_arithmetic")
    with pytest.raises(ValueError, match="not a reasoning-gym dataset"):
        build_task(TaskConfig(name="reasoning_gym", dataset="no_such_thing", tokenizer=str(model_dir)))
    with pytest.raises(ValueError, match="task.dataset_config"):
        build_task(TaskConfig(name="reasoning_gym", dataset="basic_arithmetic", tokenizer=str(model_dir),
                              dataset_config={"no_such_key": 1}))  # fmt: skip


def test_math_verify_reward_for_jsonl(tmp_path: Path, model_dir: Path) -> None:
    path = tmp_path / "math.jsonl"
    rows = [{"prompt": "What is 1/2 as a decimal?", "answer": "0.5"}, {"prompt": "x^2=4, x>0?", "answer": "2"}]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    task = build_task(TaskConfig(name="jsonl", jsonl_path=str(path), tokenizer=str(model_dir), reward="math_verify",
                                 shuffle=False))  # fmt: skip
    tok = build_byte_tokenizer()
    p0, p1 = task.prompt(0), task.prompt(1)
    assert task.score(p0.metadata, tok("so it is \\boxed{\\frac{1}{2}}", add_special_tokens=False).input_ids).reward == 1.0
    assert task.score(p0.metadata, tok("0.25", add_special_tokens=False).input_ids).reward == 0.0
    assert task.score(p1.metadata, tok("x = 2", add_special_tokens=False).input_ids).info == {"correct": 1.0,
                                                                                            "unparsable_reference": 0.0}


def test_toy_tasks_have_a_held_out_stream() -> None:
    task = build_task(TaskConfig(name="copy"))
    train = {task.prompt(i).metadata["prompt"] for i in range(200)}
    held_out = [task.eval_prompt(i) for i in range(200)]
    assert held_out[0].prompt_id == "copy-0-eval-0" and task.eval_prompt(0).metadata == held_out[0].metadata
    assert len(train & {p.metadata["prompt"] for p in held_out}) < 5  # a stream of its own (collisions by chance)


def test_jsonl_held_out_file_and_the_learner_config_asks_for_one(tmp_path: Path) -> None:
    from actors.learner.config import LearnerConfig
    from async_rl.config.configurable import ConfigError, load_config

    train, held_out = tmp_path / "train.jsonl", tmp_path / "eval.jsonl"
    train.write_text('{"prompt": "12=", "answer": "12"}\n')
    held_out.write_text('{"prompt": "34=", "answer": "34"}\n{"prompt": "56=", "answer": "56"}\n')
    task = build_task(TaskConfig(name="jsonl", jsonl_path=str(train), eval_jsonl_path=str(held_out)))
    assert [task.eval_prompt(j).metadata["answer"] for j in range(3)] == ["34", "56", "34"]
    assert task.eval_prompt(2).prompt_id == "jsonl-eval-2"
    with pytest.raises(ValueError, match="task.eval_jsonl_path"):
        build_task(TaskConfig(name="jsonl", jsonl_path=str(train))).eval_prompt(0)
    with pytest.raises(ConfigError, match="task.eval_jsonl_path"):
        load_config(LearnerConfig, None, ["task.name=jsonl", f"task.jsonl_path={train}", "eval.interval_versions=5"])
    for name in ("python_tool", "skyrl_gym"):  # environments of rows: a held-out file, else refused in one line
        with pytest.raises(ConfigError, match=f"task.name '{name}' has no held-out split: set task.eval_jsonl_path"):
            load_config(LearnerConfig, None, [f"task.name={name}", f"task.jsonl_path={train}", "task.env.id=m:f",
                                              "eval.interval_versions=5"])  # fmt: skip
        load_config(LearnerConfig, None, [f"task.name={name}", f"task.jsonl_path={train}", "task.env.id=m:f",
                                          f"task.eval_jsonl_path={held_out}", "eval.interval_versions=5"])  # fmt: skip
