"""Chat templates: ``async-rl init-model`` writes a tokenizer with one (transformers applies it); text tasks render
their prompts through it (a system prompt, the answer format the scorer reads) or as raw text when asked; the
environment adapters (skyrl_gym, verifiers, python_tool) run on a fresh init-model directory with no hand edits."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from actors.commands.init_model import main as init_model
from actors.generator.engine import SamplingParams
from actors.generator.episodes import EpisodeConfig, run_group
from async_rl.model.byte_tokenizer import BOS_ID, build_byte_tokenizer
from async_rl.tasks import TaskConfig, build_task
from async_rl.tasks.envs.config import EnvConfig
from async_rl.tasks.envs.text import ChatTemplateCodec
from async_rl.tasks.jsonl import MATH_ANSWER_FORMAT
from tests.unit.test_env_adapters import VF_TOOL_ENV, ScriptedTurns


@pytest.fixture(scope="module")
def fresh(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A model directory exactly as ``async-rl init-model DIR`` writes it."""
    path = tmp_path_factory.mktemp("init") / "model"
    assert init_model([str(path)]) == 0
    return path


def _rows(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_init_model_writes_a_chat_template_that_transformers_applies(fresh: Path) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(fresh), local_files_only=True)
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"}]
    text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert text == "<bos><|im_start|>system\nBe brief.<eos><|im_start|>user\nWhat is 2+2?<eos><|im_start|>assistant\n"
    ids = tok.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    ids = ids if isinstance(ids, list) else ids["input_ids"]
    assert ids[0] == BOS_ID and tok.decode(ids) == text  # bytes, special tokens whole
    # A turn ends at <eos>, where generation stops: a conversation is its turns concatenated, nothing in between.
    turns = [*messages, {"role": "assistant", "content": "4"}]
    assert tok.apply_chat_template(turns, tokenize=False) == text + "4<eos>"
    codec = ChatTemplateCodec(tok)
    assert codec.lists_tools()
    assert tok.decode(codec.reply_ids([{"role": "tool", "content": "5"}])) == \
        "<|im_start|>user\n<tool_response>\n5\n</tool_response><eos><|im_start|>assistant\n"  # fmt: skip


def test_text_prompts_render_through_the_chat_template(fresh: Path, tmp_path: Path) -> None:
    from async_rl.tasks.reasoning_gym import ANSWER_FORMAT

    tok = build_byte_tokenizer()
    math = _rows(tmp_path / "math.jsonl", [{"prompt": "What is 1/2 as a decimal?\n", "answer": "0.5"}])
    task = build_task(TaskConfig(name="jsonl", jsonl_path=str(math), tokenizer=str(fresh), reward="math_verify",
                                 system_prompt="You are a careful mathematician."))  # fmt: skip
    spec = task.prompt(0)
    assert task.prompt_text(spec.prompt_ids) == (
        "<bos><|im_start|>system\nYou are a careful mathematician.<eos><|im_start|>user\nWhat is 1/2 as a decimal?"
        f"\n\n{MATH_ANSWER_FORMAT}<eos><|im_start|>assistant\n")  # fmt: skip
    assert spec.metadata["prompt"] == "What is 1/2 as a decimal?\n"  # the reward still sees the row's text
    # Raw text when asked: the bos and the text, as before chat templates.
    raw = build_task(TaskConfig(name="jsonl", jsonl_path=str(math), tokenizer=str(fresh), reward="math_verify",
                                chat_template=False))  # fmt: skip
    assert raw.prompt(0).prompt_ids.tolist() == [BOS_ID, *tok("What is 1/2 as a decimal?\n").input_ids]
    # exact_match says nothing of a format; answer_format is the user's own.
    plain = build_task(TaskConfig(name="jsonl", jsonl_path=str(math), tokenizer=str(fresh)))
    assert tok.decode(plain.prompt(0).prompt_ids).endswith("decimal?<eos><|im_start|>assistant\n")
    rg = build_task(TaskConfig(name="reasoning_gym", dataset="basic_arithmetic", tokenizer=str(fresh),
                               answer_format="Answer with a number only."))  # fmt: skip
    question = rg.prompt(3).metadata["prompt"].rstrip()
    assert rg.prompt_text(rg.prompt(3).prompt_ids) == (
        f"<bos><|im_start|>user\n{question}\n\nAnswer with a number only.<eos><|im_start|>assistant\n")
    assert rg.prompt_text(rg.eval_prompt(0).prompt_ids).endswith("number only.<eos><|im_start|>assistant\n")
    default = build_task(TaskConfig(name="reasoning_gym", dataset="basic_arithmetic", tokenizer=str(fresh)))
    assert default.prompt_text(default.eval_prompt(0).prompt_ids).endswith(
        f"\n\n{ANSWER_FORMAT}<eos><|im_start|>assistant\n")
    # The toy tasks are as they were: no template, nothing added.
    copy = build_task(TaskConfig(name="copy", seed=1))
    assert copy.prompt_text(copy.prompt(0).prompt_ids) == "<bos>" + copy.prompt(0).metadata["prompt"]


def test_prompt_format_errors_name_the_field(fresh: Path, tmp_path: Path) -> None:
    rows = _rows(tmp_path / "rows.jsonl", [{"prompt": "12", "answer": "21"}])
    with pytest.raises(ValueError, match="task.system_prompt is set, but task.chat_template is false"):
        TaskConfig(name="jsonl", jsonl_path=str(rows), chat_template=False, system_prompt="hi")
    with pytest.raises(ValueError, match=r"task.chat_template applies to the text tasks \['jsonl', 'reasoning_gym'\], "
                                         "not to 'copy'"):  # fmt: skip
        TaskConfig(name="copy", chat_template=True)
    with pytest.raises(ValueError, match="task.answer_format applies to the text tasks"):
        TaskConfig(name="tool_copy", answer_format="")
    # The toy tokenizer (no task.tokenizer) has no template: asked for one, or given a system prompt, it says so.
    with pytest.raises(ValueError, match="task.chat_template is true, but the tokenizer of task.tokenizer has no"):
        build_task(TaskConfig(name="jsonl", jsonl_path=str(rows), chat_template=True))
    with pytest.raises(ValueError, match=r"task.system_prompt is set, but prompts are raw text \(the tokenizer has no"):
        build_task(TaskConfig(name="jsonl", jsonl_path=str(rows), system_prompt="hi"))
    # A tokenizer without a template (a directory written before templates) keeps raw prompts, unasked.
    old = build_byte_tokenizer()
    old.chat_template = None
    old.save_pretrained(str(tmp_path / "old"))
    task = build_task(TaskConfig(name="jsonl", jsonl_path=str(rows), tokenizer=str(tmp_path / "old")))
    assert task.prompt_text(task.prompt(0).prompt_ids) == "<bos>12"


async def test_the_adapters_run_on_a_fresh_init_model_directory(fresh: Path, tmp_path: Path) -> None:
    """skyrl_gym, verifiers and python_tool refused this directory before ("the tokenizer has no chat template"):
    each builds on it and runs an episode of scripted model turns (a random model writes no tool calls)."""
    tok = build_byte_tokenizer()
    params = SamplingParams(n=1, max_new_tokens=64)

    async def episode(task, turns: list[str]):  # type: ignore[no-untyped-def]
        spec = task.prompt(0)
        assert tok.decode(spec.prompt_ids).startswith("<bos><|im_start|>")  # rendered by the template
        [sample] = await run_group(ScriptedTurns(tok, turns), task, spec.metadata, spec.prompt_ids, params,
                                   EpisodeConfig())  # fmt: skip
        return spec, sample

    pytest.importorskip("skyrl_gym")
    rows = _rows(tmp_path / "skyrl.jsonl", [{"prompt": [{"role": "user", "content": "Look it up."}],
                                             "reward_spec": {"ground_truth": "42"}}])  # fmt: skip
    skyrl = build_task(TaskConfig(name="skyrl_gym", jsonl_path=str(rows), tokenizer=str(fresh),
                                  env=EnvConfig(id="tests.integration.adapted_envs:DigitLookupEnv")))  # fmt: skip
    _, s = await episode(skyrl, ["*", "42"])
    assert s.reward == 1.0 and s.reward_info["episode/end_done"] == 1.0
    assert tok.decode(s.response_ids[~s.model_token_mask()]).startswith("<|im_start|>user\n<tool_response>\n42=")

    questions = _rows(tmp_path / "q.jsonl", [{"prompt": "What is 6 * 7?", "answer": "42"}])
    python = build_task(TaskConfig(name="python_tool", jsonl_path=str(questions), tokenizer=str(fresh)))
    _, s = await episode(python, ["```python\nprint(6 * 7)\n```", "<answer>42</answer>"])
    assert s.reward == 1.0 and s.reward_info["tool_calls"] == 1.0
    assert "<output>42\n</output>" in tok.decode(s.response_ids[~s.model_token_mask()])

    pytest.importorskip("verifiers")
    verifiers = build_task(TaskConfig(name="verifiers", tokenizer=str(fresh),
                                      env=EnvConfig(id=VF_TOOL_ENV, args={"num_rows": 1})))  # fmt: skip
    question = verifiers.prompt(0).metadata["input"]["prompt"][0]["content"]
    a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", question).groups()  # type: ignore[union-attr]
    call = f'<tool_call>\n{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call>'
    spec, s = await episode(verifiers, [call, f"The sum is {int(a) + int(b)}"])
    assert '"name": "add"' in tok.decode(spec.prompt_ids)  # the template lists the environment's tool
    assert s.reward == 1.0 and s.reward_info["env/total_tool_calls"] == 1.0
    assert np.count_nonzero(~s.model_token_mask()) > 0
