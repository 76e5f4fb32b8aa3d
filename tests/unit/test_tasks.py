"""Tasks: deterministic prompts, verifiable rewards, JSONL prompts and user reward functions."""

from __future__ import annotations

import json
import sys
import textwrap

import numpy as np
import pytest

from async_rl.config.configurable import ConfigError, from_dict
from async_rl.model import toy_tokenizer as tt
from async_rl.tasks import TOY_TASKS, TaskConfig, build_task, load_reward_fn
from async_rl.wire import decode_prompt, encode_prompt

EOS = tt.EOS_ID


def ids(text: str, eos: bool = True) -> np.ndarray:
    return np.array([*tt.encode(text), *([EOS] if eos else [])], dtype=np.int32)


@pytest.mark.parametrize("name", TOY_TASKS)
def test_toy_prompts_are_deterministic_and_solvable(name):
    task = build_task(TaskConfig(name=name, seed=3))
    again = build_task(TaskConfig(name=name, seed=3))
    other = build_task(TaskConfig(name=name, seed=4))
    prompts = [task.prompt(i) for i in range(50)]
    assert [p.metadata for p in prompts] == [again.prompt(i).metadata for i in range(50)]
    assert [p.metadata["prompt"] for p in prompts] != [other.prompt(i).metadata["prompt"] for i in range(50)]
    assert len({p.prompt_id for p in prompts}) == 50
    for p in prompts:
        assert p.prompt_ids.dtype == np.int32 and p.prompt_ids[0] == tt.BOS_ID
        assert tt.decode(p.prompt_ids) == p.metadata["prompt"]
        target = p.metadata["target"]
        assert len(target) + 1 <= task.max_new_tokens
        perfect = task.score(p.metadata, ids(target))
        assert perfect.reward == 1.0 and perfect.info["exact"] == 1.0
        # The prompt survives the wire.
        back = decode_prompt(encode_prompt(p))
        assert back.metadata == p.metadata and np.array_equal(back.prompt_ids, p.prompt_ids)
    # Prompts stream from any start index.
    stream = task.prompts(start=10)
    assert [next(stream).prompt_id for _ in range(3)] == [prompts[i].prompt_id for i in (10, 11, 12)]


def test_toy_answers_and_partial_credit():
    copy, rev, srt, add = (build_task(TaskConfig(name=n)) for n in ("copy", "reverse", "sort", "add"))
    meta = copy.prompt(0).metadata
    digits = meta["prompt"][:-1]
    assert meta["target"] == digits
    assert rev.prompt(0).metadata["target"] == rev.prompt(0).metadata["prompt"][:-1][::-1]
    s = srt.prompt(0).metadata
    assert s["target"] == "".join(sorted(s["prompt"][:-1]))
    a = add.prompt(0).metadata
    x, y = a["prompt"][:-1].split("+")
    assert a["target"] == str(int(x) + int(y)) and len(x) == 5

    m = {"target": "12345"}
    # Positions right plus one for ending at the right place, over (longer length + 1): 1.0 only for the answer.
    assert copy.score(m, ids("12345")).reward == 1.0
    assert copy.score(m, ids("12395")).reward == pytest.approx(5 / 6)
    assert copy.score(m, ids("123")).reward == pytest.approx(3 / 6)
    assert copy.score(m, ids("123456")).reward == pytest.approx(5 / 7)  # a right prefix that does not stop
    assert copy.score(m, ids("123456")).info == {"exact": 0.0, "length_ok": 0.0}
    # Text after <eos> is never read.
    assert copy.score(m, np.array([*tt.encode("12"), EOS, *tt.encode("345")])).reward == pytest.approx(2 / 6)
    # A special token inside a response keeps its place and is never right.
    assert copy.score(m, np.array([*tt.encode("1"), tt.PAD_ID, *tt.encode("345")])).reward == pytest.approx(5 / 6)
    assert add.score({"target": "85"}, ids("85")).reward == 1.0
    assert add.score({"target": "85"}, ids("851")).reward == pytest.approx(2 / 4)
    assert add.score({"target": "85"}, ids("8")).reward == pytest.approx(1 / 3)
    # strict_length=False: the old prefix credit, where text after the answer is ignored.
    loose = build_task(TaskConfig(name="copy", strict_length=False))
    assert loose.score(m, ids("123456")).reward == 1.0
    assert loose.score(m, ids("123456")).info == {"exact": 0.0, "length_ok": 0.0}
    assert loose.score(m, ids("123")).reward == pytest.approx(0.6)
    with pytest.raises(ValueError, match="target"):
        copy.score({}, ids("1"))


def test_random_responses_score_low_on_copy():
    task = build_task(TaskConfig(name="copy"))
    rng = np.random.default_rng(0)
    rewards = [
        task.score(task.prompt(i).metadata, rng.integers(0, tt.VOCAB_SIZE, size=task.max_new_tokens)).reward
        for i in range(300)
    ]
    assert 0.0 < float(np.mean(rewards)) < 0.2


@pytest.fixture
def reward_module(tmp_path, monkeypatch):
    mod = tmp_path / "my_rewards_mod.py"
    mod.write_text(
        textwrap.dedent(
            """
            def length_reward(text, metadata):
                return {"reward": len(text) / 10, "has_answer": float("answer" in metadata)}

            def bad(text, metadata):
                return "high"

            NOT_CALLABLE = 3
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_rewards_mod"
    sys.modules.pop("my_rewards_mod", None)


def test_jsonl_prompts_and_rewards(tmp_path, reward_module):
    path = tmp_path / "p.jsonl"
    rows = [{"prompt": "12+3=", "answer": "15", "id": "a"}, {"prompt": "2*4=", "answer": "8"}, {"prompt_ids": [1, 5]}]
    path.write_text("\n".join(json.dumps(r) for r in rows[:2]) + "\n\n")
    task = build_task(TaskConfig(name="jsonl", jsonl_path=str(path), seed=1))
    assert task.num_prompts == 2
    epoch0 = {task.prompt(i).metadata["row"] for i in range(2)}
    assert epoch0 == {"a", "2"}
    p = next(task.prompt(i) for i in range(2) if task.prompt(i).metadata["row"] == "a")
    assert p.prompt_ids.tolist() == [tt.BOS_ID, *tt.encode("12+3=")]
    assert task.score(p.metadata, ids("15")).reward == 1.0
    assert task.score(p.metadata, ids("16")).reward == 0.0

    positional = build_task(TaskConfig(name="jsonl", jsonl_path=str(path), reward="positional"))
    assert positional.score({"answer": "15"}, ids("16")).reward == pytest.approx(2 / 3)

    path2 = tmp_path / "q.jsonl"
    path2.write_text(json.dumps(rows[2]) + "\n")
    user = build_task(TaskConfig(name="jsonl", jsonl_path=str(path2), reward=f"{reward_module}:length_reward"))
    s = user.score(user.prompt(0).metadata, ids("1234"))
    assert s.reward == pytest.approx(0.4) and s.info == {"has_answer": 0.0}
    # A user's reward also replaces a toy task's.
    toy = build_task(TaskConfig(name="copy", reward=f"{reward_module}:length_reward"))
    assert toy.score(toy.prompt(0).metadata, ids("12")).reward == pytest.approx(0.2)
    bad = build_task(TaskConfig(name="copy", reward=f"{reward_module}:bad"))
    with pytest.raises(ValueError, match="must be a number"):
        bad.score(bad.prompt(0).metadata, ids("1"))


def test_bad_input_is_named(tmp_path, reward_module):
    with pytest.raises(ValueError, match="module:function"):
        load_reward_fn("nocolon")
    with pytest.raises(ValueError, match="cannot import module"):
        load_reward_fn("no_such_module_xyz:f")
    with pytest.raises(ValueError, match="no attribute"):
        load_reward_fn(f"{reward_module}:missing")
    with pytest.raises(ValueError, match="not callable"):
        load_reward_fn(f"{reward_module}:NOT_CALLABLE")
    with pytest.raises(ConfigError, match="task.name"):
        from_dict(TaskConfig, {"name": "chess"})
    with pytest.raises(ConfigError, match="task.max_digits"):
        from_dict(TaskConfig, {"min_digits": 4, "max_digits": 3})
    with pytest.raises(ConfigError, match="task.jsonl_path"):
        from_dict(TaskConfig, {"name": "jsonl"})
    with pytest.raises(ConfigError, match="task.reward"):
        from_dict(TaskConfig, {"name": "copy", "reward": "exact_match"})
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "12="}\n{"prompt": "1x="}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: .*outside the toy vocabulary"):
        build_task(TaskConfig(name="jsonl", jsonl_path=str(bad), reward=f"{reward_module}:length_reward"))
    bad.write_text('{"prompt": "12="}\nnot json\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:2: not valid JSON"):
        build_task(TaskConfig(name="jsonl", jsonl_path=str(bad), reward=f"{reward_module}:length_reward"))
    bad.write_text('{"prompt": "12="}\n')
    with pytest.raises(ValueError, match="needs an 'answer' field; row 1"):
        build_task(TaskConfig(name="jsonl", jsonl_path=str(bad)))
    bad.write_text('{"text": "12="}\n')
    with pytest.raises(ValueError, match="needs a 'prompt'"):
        build_task(TaskConfig(name="jsonl", jsonl_path=str(bad)))
