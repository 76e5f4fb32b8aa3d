"""The adapters on the real torch engine, in-process: a skyrl-gym environment's episodes, the text codecs, and the
config errors; real processes run them in tests/integration/test_env_adapters_e2e.py."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from actors.generator.engine import SamplingParams
from actors.generator.episodes import EpisodeConfig, run_group
from async_rl import tokenizer as tt
from async_rl.envs.config import EnvConfig
from async_rl.envs.text import ChatTemplateCodec, ToyCodec
from async_rl.tasks.config import TaskConfig, build_task
from tests.unit.test_torch_engine import make_engine

ENV = "tests.integration.adapted_envs:DigitLookupEnv"


def write_rows(path: Path, n: int = 4) -> Path:
    rows = [{"prompt": [{"role": "user", "content": ","}], "reward_spec": {"ground_truth": f"{i}{i + 1}"},
             "extra_info": {"i": i}} for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def test_skyrl_gym_episodes_run_through_the_adapter(tmp_path: Path):
    pytest.importorskip("skyrl_gym")
    from async_rl.models import build_model

    task = build_task(TaskConfig(name="skyrl_gym", jsonl_path=str(write_rows(tmp_path / "rows.jsonl")),
                                 env=EnvConfig(id=ENV), max_new_tokens=3))
    spec = task.prompt(0)
    np.testing.assert_array_equal(spec.prompt_ids, [tt.BOS_ID, *tt.encode(",")])
    engine = make_engine(build_model("tiny-moe", seed=0))
    samples = await run_group(engine, task, spec.metadata, spec.prompt_ids,
                              SamplingParams(n=6, max_new_tokens=3), EpisodeConfig())  # fmt: skip
    target = spec.metadata["extras"]["reward_spec"]["ground_truth"]
    for s in samples:
        info = s.reward_info
        assert info["episode/end_done"] == 1.0 and info["episode/turns"] == 2.0 and info["env/steps"] == 2.0
        assert "env/note" not in info  # text metadata is left out of the metrics
        called = info["env/called"] == 1.0
        reply = tt.encode((target if called else "") + "=")
        env = ~s.model_token_mask()
        np.testing.assert_array_equal(s.response_ids[env], reply)
        assert s.reward == 0.5 * called + 0.5 * info["env/correct"]
    await engine.close()


def test_adapter_config_errors_are_named(tmp_path: Path):
    with pytest.raises(ValueError, match="task.jsonl_path is required when task.name is 'skyrl_gym'"):
        TaskConfig(name="skyrl_gym")
    with pytest.raises(ValueError, match=r"task.env.id \('module:function'"):
        TaskConfig(name="verifiers")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "abc"}\n')
    with pytest.raises(ValueError, match=r"bad.jsonl:1: text 'abc' has characters outside the toy vocabulary"):
        build_task(TaskConfig(name="skyrl_gym", jsonl_path=str(bad), env=EnvConfig(id=ENV)))
    with pytest.raises(ValueError, match="task.reward cannot be set for skyrl_gym"):
        build_task(TaskConfig(name="skyrl_gym", jsonl_path=str(write_rows(tmp_path / "r.jsonl")),
                              reward="m:f"))  # fmt: skip


def test_codecs():
    toy = ToyCodec()
    np.testing.assert_array_equal(toy.prompt_ids([{"role": "user", "content": "12"}]), [tt.BOS_ID, *tt.encode("12")])
    assert toy.decode(np.array([*tt.encode("34"), tt.EOS_ID, *tt.encode("5")])) == "34"
    tok = tt.build_tokenizer()
    with pytest.raises(ValueError, match="has no chat template"):
        ChatTemplateCodec(tok)
    # A chat template in the toy vocabulary: a user message is "<content>=", a tool's "<content>>", the generation
    # prompt "," (real templates add role headers the same way).
    tok.chat_template = ("{% for m in messages %}{{ m['content'] }}{% if m['role'] == 'tool' %}>{% else %}={% endif %}"
                         "{% endfor %}{% if add_generation_prompt %},{% endif %}")  # fmt: skip
    codec = ChatTemplateCodec(tok)
    np.testing.assert_array_equal(codec.prompt_ids([{"role": "user", "content": "1"}]), tt.encode("1=,"))
    # A reply renders alone, whatever came before it.
    np.testing.assert_array_equal(codec.reply_ids([{"role": "tool", "content": "42"}]), tt.encode("42>,"))
    assert codec.decode(np.array([*tt.encode("7"), tt.EOS_ID, 9])) == "7"


async def test_verifiers_episodes_run_through_the_adapter():
    pytest.importorskip("verifiers")
    from async_rl.models import build_model

    task = build_task(TaskConfig(name="verifiers", max_new_tokens=3,
                                 env=EnvConfig(id=VF_ENV, args={"num_rows": 4})))  # fmt: skip
    assert task.num_prompts == 4
    spec = task.prompt(1)
    np.testing.assert_array_equal(spec.prompt_ids, [tt.BOS_ID, *tt.encode(",")])
    engine = make_engine(build_model("tiny-moe", seed=0))
    samples = await run_group(engine, task, spec.metadata, spec.prompt_ids,  # type: ignore[arg-type]
                              SamplingParams(n=6, max_new_tokens=3), EpisodeConfig())  # fmt: skip
    answer = spec.metadata["input"]["answer"]
    for s in samples:
        info = s.reward_info
        assert info["episode/end_done"] == 1.0 and info["episode/turns"] == 2.0, info
        called = info["env/called"] == 1.0
        np.testing.assert_array_equal(s.response_ids[~s.model_token_mask()], tt.encode((answer if called else "") + "="))
        assert s.reward == pytest.approx(0.5 * called + 0.5 * info["env/correct"])
    # An environment that fails mid-rollout ends its episode only, with the reason in the metrics.
    broken = build_task(TaskConfig(name="verifiers", max_new_tokens=3,
                                   env=EnvConfig(id=VF_ENV, args={"num_rows": 2, "broken": True})))  # fmt: skip
    spec = broken.prompt(0)
    samples = await run_group(engine, broken, spec.metadata, spec.prompt_ids,  # type: ignore[arg-type]
                              SamplingParams(n=2, max_new_tokens=3), EpisodeConfig())  # fmt: skip
    for s in samples:
        assert s.reward_info["episode/end_env_error"] == 1.0 and s.reward_info["episode/turns"] == 1.0
        assert s.reward == 0.0 and s.finish_reason == "abort" and s.loss_mask is None  # one model turn, no reply
    await engine.close()


VF_ENV = "tests.integration.verifiers_env:load_environment"
