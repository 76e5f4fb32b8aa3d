"""Every built-in task has a held-out split for evaluation, or evaluation is refused before any server is touched, in
one line: ``tool_copy`` draws it from a seed stream of its own, ``python_tool`` and ``skyrl_gym`` read
``task.eval_jsonl_path``, ``verifiers`` takes the environment's ``eval_dataset``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from actors.learner.config import LearnerConfig
from actors.learner.main import main as learner_main
from async_rl.config.configurable import ConfigError, load_config
from async_rl.tasks.config import TaskConfig, build_task
from async_rl.tasks.envs.config import EnvConfig

SERVERS = ["run.redis_url=redis://127.0.0.1:1/0", "run.nats_url=nats://127.0.0.1:1"]
"""Nothing listens there: a learner that got as far as the servers would say so instead of the config error."""


def _rows(path: Path, answers: list[str]) -> Path:
    path.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"{a}="}], "answer": a}) + "\n"
                            for a in answers))  # fmt: skip
    return path


def test_tool_copy_has_a_held_out_stream_of_its_own() -> None:
    task = build_task(TaskConfig(name="tool_copy", min_digits=5, max_digits=5))
    train = {task.prompt(i).metadata["target"] for i in range(300)}
    held_out = [task.eval_prompt(j) for j in range(300)]
    assert held_out[3].prompt_id == "tool_copy-0-eval-3" and task.eval_prompt(3).metadata == held_out[3].metadata
    assert len(train & {p.metadata["target"] for p in held_out}) < 5  # disjoint but for chance collisions
    load_config(LearnerConfig, None, ["task.name=tool_copy", "eval.interval_versions=2"])  # accepted


@pytest.mark.parametrize("name", ["python_tool", "skyrl_gym"])
def test_environments_of_rows_read_their_held_out_file(name: str, tmp_path: Path) -> None:
    train, held_out = _rows(tmp_path / "train.jsonl", ["1", "2", "3"]), _rows(tmp_path / "eval.jsonl", ["7", "8"])
    env = EnvConfig(id="m:C") if name == "skyrl_gym" else EnvConfig()
    task = build_task(TaskConfig(name=name, jsonl_path=str(train), eval_jsonl_path=str(held_out), env=env))
    answer = (lambda m: m["answer"]) if name == "python_tool" else (lambda m: m["extras"]["answer"])
    assert [answer(task.eval_prompt(j).metadata) for j in range(3)] == ["7", "8", "7"]  # in file order, cycling
    assert task.eval_prompt(1).prompt_id == f"{name}-eval-1"
    assert {answer(task.prompt(i).metadata) for i in range(6)} == {"1", "2", "3"}  # training never reads it
    without = build_task(TaskConfig(name=name, jsonl_path=str(train), env=env))
    with pytest.raises(ValueError, match=f"task '{name}' has no held-out split: set task.eval_jsonl_path"):
        without.eval_prompt(0)
    with pytest.raises(ValueError, match="task.eval_jsonl_path .* has no prompts"):
        build_task(TaskConfig(name=name, jsonl_path=str(train), eval_jsonl_path=str(_rows(tmp_path / "e", [])),
                              env=env))  # fmt: skip
    with pytest.raises(ConfigError, match=f"task.name '{name}' has no held-out split: set task.eval_jsonl_path"):
        load_config(LearnerConfig, None, [f"task.name={name}", f"task.jsonl_path={train}", "task.env.id=m:C",
                                          "eval.interval_versions=2"])  # fmt: skip


def load_with_eval(num_eval_rows: int = 0) -> Any:
    """A verifiers environment (single turn) whose ``eval_dataset`` has ``num_eval_rows`` rows (0: none)."""
    import verifiers as vf
    from datasets import Dataset

    def rows(n: int, first: int) -> Any:
        return Dataset.from_list([{"prompt": [{"role": "user", "content": f"{i}="}], "answer": str(i)}
                                  for i in range(first, first + n)])  # fmt: skip

    return vf.SingleTurnEnv(dataset=rows(4, 0), eval_dataset=rows(num_eval_rows, 100) if num_eval_rows else None,
                            rubric=vf.Rubric(funcs=[lambda completion, answer, **kw: 0.0]))  # fmt: skip


def test_verifiers_takes_the_environments_eval_dataset_or_the_learner_refuses_at_start(capsys) -> None:
    pytest.importorskip("verifiers")
    env_id = "tests.unit.test_held_out:load_with_eval"
    task = build_task(TaskConfig(name="verifiers", env=EnvConfig(id=env_id, args={"num_eval_rows": 2})))
    assert [task.eval_prompt(j).metadata["input"]["answer"] for j in range(3)] == ["100", "101", "100"]
    assert {task.prompt(i).metadata["input"]["answer"] for i in range(8)} == {"0", "1", "2", "3"}
    # Without an eval_dataset: refused in one line by the learner, at config time (before any server).
    with pytest.raises(SystemExit) as exc:
        learner_main(["task.name=verifiers", f"task.env.id={env_id}", "eval.interval_versions=2", *SERVERS])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert err == (f"async-rl learner: config error: evaluation needs held-out prompts: task "
                   f"'verifiers' has no held-out split: the environment of task.env.id '{env_id}' has no "
                   "eval_dataset"), err  # fmt: skip
