"""Tool-call parsing: our parsers return what vLLM 0.32's of the same name return (``tool_call_cases.json``, real model
output of Qwen, Hermes, Llama 3.x and Mistral models and the edge cases), ids and the malformed count on top; the
markers survive decoding when they are special tokens; ``auto`` follows the chat template; bad names are refused."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from async_rl.model.byte_tokenizer import build_byte_tokenizer
from async_rl.tasks.envs.config import EnvConfig
from async_rl.tasks.envs.text import ChatTemplateCodec
from async_rl.tasks.envs.tool_calls import ToolParser, make_tool_parser, parse_tool_calls
from async_rl.tasks.envs.tool_formats import read_hermes, read_llama3_json, read_mistral

CASES = json.loads(Path(__file__).with_name("tool_call_cases.json").read_text())["cases"]


def _ours(parser: str, v11: bool = False) -> ToolParser:
    """Our own parser whatever is installed (no tokenizer: vLLM's need one; mistral's form given by ``v11``)."""
    p = make_tool_parser(parser)
    assert p.backend == "ours"
    if parser == "mistral":
        p.read = lambda text, tools: read_mistral(text, v11=v11)
    return p


@pytest.mark.parametrize("case", CASES, ids=[f"{c['format']}: {c['what']}" for c in CASES])
def test_our_parsers_return_what_vllm_returns(case: dict) -> None:
    reader = {"hermes": read_hermes, "llama3_json": read_llama3_json,
              "mistral": lambda t: read_mistral(t, v11=case.get("v11", False))}[case["format"]]  # fmt: skip
    content, calls = reader(case["text"])
    assert content == case["content"]
    assert [list(c) for c in calls] == case["calls"]
    turn = _ours(case["format"], case.get("v11", False)).parse(case["text"], id_prefix="call_3_")
    assert turn.content == case["content"]
    assert [(c["id"], c["function"]["name"], c["function"]["arguments"]) for c in turn.tool_calls] == \
        [(f"call_3_{i}", name, args) for i, (name, args) in enumerate(case["calls"])]  # fmt: skip
    assert all(c["type"] == "function" for c in turn.tool_calls)


def test_the_corpus_covers_each_format() -> None:
    per = {f: sum(c["format"] == f and bool(c["calls"]) for c in CASES) for f in ("hermes", "llama3_json", "mistral")}
    assert min(per.values()) >= 5, per
    assert any(c.get("v11") for c in CASES) and any(c["format"] == "mistral" and not c.get("v11") for c in CASES)


def test_a_turn_that_opened_a_call_but_made_none_is_counted() -> None:
    cut = _ours("hermes").parse('<tool_call>\n{"name": "add", "argum')
    assert cut.tool_calls == [] and cut.num_malformed == 1 and cut.content == '<tool_call>\n{"name": "add", "argum'
    assert _ours("hermes").parse("The answer is 5.").num_malformed == 0
    assert _ours("llama3_json").parse('{"name": "a"}').num_malformed == 1
    assert _ours("llama3_json").parse('It is {"t": 21}').num_malformed == 0  # JSON in prose opens no call
    assert _ours("mistral").parse("[TOOL_CALLS] not json").num_malformed == 1
    good = _ours("hermes").parse('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert good.num_malformed == 0 and len(good.tool_calls) == 1


def test_mistral_form_follows_the_vocabulary_or_the_text() -> None:
    v3, v11 = build_byte_tokenizer(), build_byte_tokenizer()
    v3.add_tokens(["[TOOL_CALLS]"])
    v11.add_tokens(["[TOOL_CALLS]", "[ARGS]"])
    text = '[TOOL_CALLS]add{"a": 1}'  # the v11 form without [ARGS]: a v3 tokenizer's parser makes nothing of it
    assert make_tool_parser("mistral", v11).parse(text).tool_calls[0]["function"]["name"] == "add"
    if make_tool_parser("mistral", v3).backend == "ours":
        assert make_tool_parser("mistral", v3).parse(text).tool_calls == []
    no_tokenizer = make_tool_parser("mistral")  # the text says which form
    assert no_tokenizer.parse('[TOOL_CALLS]add[ARGS]{"a": 1}').tool_calls[0]["function"]["arguments"] == '{"a": 1}'
    v3_text = '[TOOL_CALLS][{"name": "add", "arguments": {}}]'
    assert no_tokenizer.parse(v3_text).tool_calls[0]["function"]["name"] == "add"


def test_markers_survive_decoding_when_they_are_special_tokens() -> None:
    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]", "[ARGS]"]})
    codec = ChatTemplateCodec(tok)
    ids = np.array(tok.encode('Hi[TOOL_CALLS]add[ARGS]{"a": 1}', add_special_tokens=False) + [tok.eos_token_id, 7])
    assert codec.decode(ids) == 'Hiadd{"a": 1}'  # dropped, as skip_special_tokens does
    parser = make_tool_parser("mistral", tok)
    text = codec.decode(ids, keep=parser.keep_tokens)
    assert text == 'Hi[TOOL_CALLS]add[ARGS]{"a": 1}'
    turn = parser.parse(text)
    assert turn.content == "Hi" and turn.tool_calls[0]["function"] == {"name": "add", "arguments": '{"a": 1}'}


def test_auto_follows_the_chat_template() -> None:
    tok = build_byte_tokenizer()  # ChatML with Hermes <tool_call> blocks, as Qwen's
    assert make_tool_parser("auto", tok).name == "hermes"
    tok.chat_template = "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}[TOOL_CALLS]"
    assert make_tool_parser("auto", tok).name == "mistral"
    tok.chat_template = '{{ "<|python_tag|>" }}{% for m in messages %}{{ m.content }}{% endfor %}'
    assert make_tool_parser("auto", tok).name == "llama3_json"
    tok.chat_template = "{% for m in messages %}{{ m.content }}{% endfor %}"
    with pytest.raises(ValueError, match=r"task.env.tool_parser=auto: the chat template of task.tokenizer spells none"):
        make_tool_parser("auto", tok)


def test_parser_none_and_bad_names() -> None:
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    turn = parse_tool_calls(text, "none")
    assert turn.content == text and turn.tool_calls == [] and turn.num_malformed == 0
    with pytest.raises(ValueError, match=r"task.env.tool_parser must be one of \['hermes', 'llama3_json', 'mistral', "
                                         r"'auto', 'none'\] or 'vllm:<name>'.*, got 'json'"):  # fmt: skip
        EnvConfig(id="m:f", tool_parser="json")
    with pytest.raises(ValueError, match=r"got 'vllm:'"):
        EnvConfig(id="m:f", tool_parser="vllm:")
    EnvConfig(id="m:f", tool_parser="vllm:qwen3_coder")  # checked when the task is built, where vLLM is


def test_vllm_parser_without_vllm_is_refused_in_one_line() -> None:
    from async_rl.tasks.envs.vllm_tool_parsers import vllm_available

    if vllm_available():
        pytest.skip("vLLM is installed here (tests/vllm/test_tool_parsers.py covers it)")
    with pytest.raises(ValueError, match=r"task.env.tool_parser=vllm:pythonic needs vLLM installed"):
        make_tool_parser("vllm:pythonic", build_byte_tokenizer())
    assert make_tool_parser("hermes", build_byte_tokenizer()).backend == "ours"
