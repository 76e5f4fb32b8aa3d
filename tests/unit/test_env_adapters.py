"""The adapters on the real torch engine, in-process: a skyrl-gym environment's episodes, the text codecs, and the
config errors; real processes run them in tests/integration/test_env_adapters_e2e.py. A ``vf.ToolEnv`` runs its
tool through the adapter on scripted model turns (a tiny model does not write tool calls)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pytest
import torch

from actors.generator.engine import Completion, Engine, SamplingParams
from actors.generator.episodes import EpisodeConfig, run_group
from async_rl.model import toy_tokenizer as tt
from async_rl.model.byte_tokenizer import build_byte_tokenizer
from async_rl.tasks.config import TaskConfig, build_task
from async_rl.tasks.envs.config import EnvConfig
from async_rl.tasks.envs.text import ChatTemplateCodec, ToyCodec
from tests.unit.test_torch_engine import make_engine

ENV = "tests.integration.adapted_envs:DigitLookupEnv"


def write_rows(path: Path, n: int = 4) -> Path:
    rows = [{"prompt": [{"role": "user", "content": ","}], "reward_spec": {"ground_truth": f"{i}{i + 1}"},
             "extra_info": {"i": i}} for i in range(n)]  # fmt: skip
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


async def test_skyrl_gym_episodes_run_through_the_adapter(tmp_path: Path):
    pytest.importorskip("skyrl_gym")
    from async_rl.model.presets import build_model

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
    with pytest.raises(ValueError, match=r"task.env.tool_parser must be one of \['hermes', 'llama3_json', "
                                         r"'mistral', 'auto', 'none'\] or 'vllm:<name>'.*, got 'qwen'"):  # fmt: skip
        EnvConfig(id="m:f", tool_parser="qwen")


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
    from async_rl.model.presets import build_model

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


VF_TOOL_ENV = "tests.integration.verifiers_tool_env:load_environment"

# A chat template in the Hermes / Qwen format, with the byte-level tokenizer's <eos> ending each message: tools
# listed in a system message, a tool result as a user turn in <tool_response>, and, as Qwen3 does, an empty
# <think> block on a last assistant message (so a reply cannot be cut after a base ending with one).
HERMES_TEMPLATE = (
    "{%- if tools %}{{- '<|im_start|>system\\n# Tools\\n<tools>' }}{%- for tool in tools %}{{- '\\n' }}"
    "{{- tool | tojson }}{%- endfor %}{{- '\\n</tools>\\nCall a tool with <tool_call>\\n{\"name\": <function-name>, "
    "\"arguments\": <args-json-object>}\\n</tool_call><eos>\\n' }}{%- endif %}"
    "{%- for m in messages %}{%- if m.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + m.content + '\\n</tool_response><eos>\\n' }}"
    "{%- elif m.role == 'assistant' and loop.last %}"
    "{{- '<|im_start|>assistant\\n<think>\\n\\n</think>\\n\\n' + m.content + '<eos>\\n' }}"
    "{%- else %}{{- '<|im_start|>' + m.role + '\\n' + m.content + '<eos>\\n' }}{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)  # fmt: skip


def hermes_tokenizer_dir(path: Path) -> Path:
    tok = build_byte_tokenizer()
    tok.chat_template = HERMES_TEMPLATE
    tok.save_pretrained(str(path))
    return path


class ScriptedTurns(Engine):
    """An engine whose model turns are given texts (each followed by <eos>), in order; it keeps every context."""

    def __init__(self, tokenizer, texts: Sequence[str]) -> None:  # type: ignore[no-untyped-def]
        self.turns = [np.array([*tokenizer.encode(t, add_special_tokens=False), tokenizer.eos_token_id], np.int32)
                      for t in texts]  # fmt: skip
        self.contexts: list[np.ndarray] = []

    @property
    def version(self) -> int:
        return 0

    @property
    def max_batch_prompts(self) -> int:
        return 1

    async def generate(self, prompts: Sequence[np.ndarray], params: SamplingParams) -> list[list[Completion]]:
        [context] = prompts
        self.contexts.append(np.asarray(context))
        ids = self.turns[len(self.contexts) - 1]
        return [[Completion(token_ids=ids, logprobs=np.zeros(ids.size, np.float32),
                            versions=np.zeros(ids.size, np.int32), finish_reason="stop")]]  # fmt: skip

    def stage_weights(self, tensors: Mapping[str, torch.Tensor], version: int) -> None:
        raise NotImplementedError

    async def wait_applied(self, version: int, timeout_s: float | None = None) -> bool:
        return True


async def _tool_episode(tmp_path: Path, texts: Sequence[str], tool_parser: str = "hermes"):  # type: ignore[no-untyped-def]
    task = build_task(TaskConfig(name="verifiers", tokenizer=str(hermes_tokenizer_dir(tmp_path / "tok")),
                                 env=EnvConfig(id=VF_TOOL_ENV, args={"num_rows": 2}, tool_parser=tool_parser)))
    spec = task.prompt(0)
    engine = ScriptedTurns(task.codec.tokenizer, texts)  # type: ignore[attr-defined]
    [sample] = await run_group(engine, task, spec.metadata, spec.prompt_ids,  # type: ignore[arg-type]
                               SamplingParams(n=1, max_new_tokens=64), EpisodeConfig())  # fmt: skip
    return task, spec, engine, sample


async def test_verifiers_tool_env_runs_its_tool_through_the_adapter(tmp_path: Path):
    pytest.importorskip("verifiers")
    call = 'I will add them.\n<tool_call>\n{"name": "add", "arguments": {"a": A, "b": B}}\n</tool_call>'
    probe = build_task(TaskConfig(name="verifiers", env=EnvConfig(id=VF_TOOL_ENV, args={"num_rows": 2}),
                                  tokenizer=str(hermes_tokenizer_dir(tmp_path / "probe"))))  # fmt: skip
    question = probe.prompt(0).metadata["input"]["prompt"][0]["content"]
    a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", question).groups()  # type: ignore[union-attr]
    answer = str(int(a) + int(b))
    task, spec, engine, s = await _tool_episode(tmp_path, [call.replace("A", a).replace("B", b),
                                                           f"The sum is {answer}"])  # fmt: skip
    tok = task.codec.tokenizer  # type: ignore[attr-defined]
    # The model was shown the tool list: the schema verifiers made of add() in the system message.
    prompt = tok.decode(spec.prompt_ids)
    assert prompt.startswith("<|im_start|>system\n# Tools\n<tools>\n{") and prompt.endswith("<|im_start|>assistant\n")
    listed = json.loads(prompt.split("<tools>\n")[1].split("\n</tools>")[0])
    assert listed["function"]["name"] == "add" and set(listed["function"]["parameters"]["properties"]) == {"a", "b"}
    # The tool ran: its result is rendered (after the model's call) into the sequence, masked out of the loss.
    turn1, turn2 = engine.turns
    reply = f"<|im_start|>user\n<tool_response>\n{answer}\n</tool_response><eos>\n<|im_start|>assistant\n"
    reply_ids = np.array(tok.encode(reply, add_special_tokens=False), np.int32)
    np.testing.assert_array_equal(s.response_ids, np.concatenate([turn1, reply_ids, turn2]))
    np.testing.assert_array_equal(s.model_token_mask(), [True] * turn1.size + [False] * reply_ids.size
                                  + [True] * turn2.size)  # fmt: skip
    np.testing.assert_array_equal(engine.contexts[1], np.concatenate([spec.prompt_ids, turn1, reply_ids]))
    # The rubric's reward came back, with the ToolEnv's own metrics.
    info = s.reward_info
    assert s.reward == 1.0 and info["env/correct"] == 1.0, info
    assert info["env/total_tool_calls"] == 1.0 and info["env/add_calls"] == 1.0 and info["env/num_turns"] == 2.0
    assert info["tool_calls/malformed"] == 0.0 and info["episode/end_done"] == 1.0 and info["episode/turns"] == 2.0


async def test_verifiers_tool_env_without_a_parsed_call(tmp_path: Path):
    pytest.importorskip("verifiers")
    # A call whose JSON does not parse stays text and is counted: no tool runs, the ToolEnv ends the rollout.
    bad = '<tool_call>\n{"name": "add", "arguments": {"a": 1,\n</tool_call>'
    _, _, engine, s = await _tool_episode(tmp_path, [bad])
    info = s.reward_info
    assert len(engine.contexts) == 1 and info["episode/end_done"] == 1.0 and info["episode/env_tokens"] == 0.0
    assert info["tool_calls/malformed"] == 1.0 and info["env/total_tool_calls"] == 0.0 and s.reward == 0.0
    # tool_parser = none: a well-formed call is left as text too (environments that read the text themselves).
    good = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
    _, _, engine, s = await _tool_episode(tmp_path / "none", [good], tool_parser="none")
    assert len(engine.contexts) == 1 and s.reward_info["env/total_tool_calls"] == 0.0
    assert "tool_calls/malformed" not in s.reward_info
    # The toy tokenizer has no template to list tools in: refused when the prompts are built.
    with pytest.raises(ValueError, match=r"dataset row 0: the toy tokenizer cannot show the model 1 tool\(s\)"):
        build_task(TaskConfig(name="verifiers", env=EnvConfig(id=VF_TOOL_ENV, args={"num_rows": 2})))


def test_chat_template_codec_cuts_replies_where_the_base_is_a_prefix():
    tok = build_byte_tokenizer()
    tok.chat_template = HERMES_TEMPLATE
    codec = ChatTemplateCodec(tok)
    # The template renders the base's last assistant message with a <think> block only while it is last, so the
    # base ending in a user message is cut instead; the reply comes out whole.
    for message, text in [({"role": "tool", "content": "5", "tool_call_id": "call_0_0"},
                           "<|im_start|>user\n<tool_response>\n5\n</tool_response><eos>\n"),
                          ({"role": "user", "content": "next"}, "<|im_start|>user\nnext<eos>\n")]:  # fmt: skip
        assert tok.decode(codec.reply_ids([message])) == text + "<|im_start|>assistant\n"
    assert codec.lists_tools()
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert not ChatTemplateCodec(tok).lists_tools()


@pytest.mark.parametrize("tool_parser, call", [
    ("llama3_json", '{"name": "add", "parameters": {"a": <a>, "b": <b>}}'),
    ("mistral", '[TOOL_CALLS][{"name": "add", "arguments": {"a": <a>, "b": <b>}}]'),
])  # fmt: skip
async def test_verifiers_tool_env_in_other_call_formats(tmp_path: Path, tool_parser: str, call: str):
    pytest.importorskip("verifiers")
    probe = build_task(TaskConfig(name="verifiers", env=EnvConfig(id=VF_TOOL_ENV, args={"num_rows": 2}),
                                  tokenizer=str(hermes_tokenizer_dir(tmp_path / "probe"))))  # fmt: skip
    question = probe.prompt(0).metadata["input"]["prompt"][0]["content"]
    a, b = re.fullmatch(r"What is (\d+) \+ (\d+)\?", question).groups()  # type: ignore[union-attr]
    answer = str(int(a) + int(b))
    _, _, engine, s = await _tool_episode(tmp_path, [call.replace("<a>", a).replace("<b>", b), f"The sum is {answer}"],
                                          tool_parser=tool_parser)  # fmt: skip
    info = s.reward_info
    assert len(engine.contexts) == 2 and info["env/add_calls"] == 1.0 and info["tool_calls/malformed"] == 0.0
    assert s.reward == 1.0 and info["env/correct"] == 1.0


def test_verifiers_without_its_classic_api_is_refused_in_one_line():
    vf = pytest.importorskip("verifiers")
    from async_rl.tasks.envs.verifiers import classic_api_missing

    assert classic_api_missing(vf.__version__, hasattr(vf, "MultiTurnEnv")) is None  # the installed 0.3.x
    # verifiers 0.4.0's package root: only verifiers.v1 beside it (checked by hand with the 0.4.0 wheel installed)
    said = classic_api_missing("0.4.0", False)
    assert said is not None and said.startswith("task.name=verifiers drives verifiers' classic API")
    assert "the installed verifiers 0.4.0 has only the verifiers.v1 stack" in said
    assert said.endswith("pip install 'verifiers>=0.3.1,<0.4'")
