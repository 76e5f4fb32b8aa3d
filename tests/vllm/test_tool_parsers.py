"""vLLM's own tool parsers and ours agree (``tests/unit/tool_call_cases.json``: real model output in the Hermes / Qwen,
Llama 3 JSON and Mistral formats, and the edge cases), and where vLLM is installed the tasks read turns with vLLM's:
``make_tool_parser`` picks vLLM's parser, ``vllm:<name>`` reaches the rest of its registry, and a name it lacks is
refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from async_rl.model.byte_tokenizer import build_byte_tokenizer
from async_rl.tasks.envs.tool_calls import make_tool_parser
from async_rl.tasks.envs.tool_formats import read_hermes, read_llama3_json, read_mistral
from async_rl.tasks.envs.vllm_tool_parsers import vllm_parser_names

pytestmark = pytest.mark.vllm

CASES = json.loads((Path(__file__).parents[1] / "unit" / "tool_call_cases.json").read_text())["cases"]


def _tokenizer(v11: bool):  # type: ignore[no-untyped-def]
    """The byte tokenizer with the markers vLLM's parsers look up in the vocabulary ([ARGS]: a v11 Mistral one)."""
    tok = build_byte_tokenizer()
    tok.add_tokens(["<|python_tag|>", "[TOOL_CALLS]", *(["[ARGS]"] if v11 else [])])
    return tok


@pytest.mark.parametrize("case", CASES, ids=[f"{c['format']}: {c['what']}" for c in CASES])
def test_vllm_and_ours_read_the_same(case: dict) -> None:
    tok = _tokenizer(case.get("v11", False))
    vllm_parser = make_tool_parser(case["format"], tok)
    assert vllm_parser.backend == "vllm"
    turn = vllm_parser.parse(case["text"], id_prefix="c")
    vllm_read = (turn.content, [[c["function"]["name"], c["function"]["arguments"]] for c in turn.tool_calls])
    ours = {"hermes": read_hermes, "llama3_json": read_llama3_json,
            "mistral": lambda t: read_mistral(t, v11=case.get("v11", False))}[case["format"]](case["text"])  # fmt: skip
    assert vllm_read == (ours[0], [list(c) for c in ours[1]])
    assert vllm_read == (case["content"], case["calls"])  # and both what the file recorded from vLLM 0.32
    assert [c["id"] for c in turn.tool_calls] == [f"c{i}" for i in range(len(case["calls"]))]


def test_any_parser_of_vllms_registry_by_name() -> None:
    names = vllm_parser_names()
    assert {"hermes", "llama3_json", "mistral", "pythonic"} <= set(names)
    pythonic = make_tool_parser("vllm:pythonic", _tokenizer(False))
    turn = pythonic.parse('[get_weather(city="Paris"), add(a=1, b=2)]')
    assert [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in turn.tool_calls] == \
        [("get_weather", {"city": "Paris"}), ("add", {"a": 1, "b": 2})]  # fmt: skip
    with pytest.raises(ValueError, match=r"task.env.tool_parser=vllm:nope: vLLM has no tool parser 'nope' \(it has: "):
        make_tool_parser("vllm:nope", _tokenizer(False))


def test_a_tokenizer_vllm_refuses_falls_back_to_ours() -> None:
    tok = build_byte_tokenizer()  # no [TOOL_CALLS] in its vocabulary: vLLM's mistral parser refuses it
    parser = make_tool_parser("mistral", tok)
    assert parser.backend == "ours"
    assert parser.parse('[TOOL_CALLS][{"name": "a", "arguments": {}}]').tool_calls[0]["function"]["name"] == "a"
