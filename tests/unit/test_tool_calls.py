"""The Hermes tool-call parser: what an OpenAI-compatible server with vLLM's ``hermes`` parser returns for a turn."""

from __future__ import annotations

import json

import pytest

from async_rl.tasks.envs.tool_calls import parse_tool_calls


def _call(i: int, name: str, arguments: dict, prefix: str = "call_") -> dict:
    return {"id": f"{prefix}{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(arguments)}}


def test_one_call_with_text_around_it():
    text = 'Let me add.\n<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    turn = parse_tool_calls(text, "hermes", id_prefix="call_7_")
    assert turn.content == "Let me add."
    assert turn.tool_calls == [_call(0, "add", {"a": 2, "b": 3}, "call_7_")]
    assert turn.num_malformed == 0
    assert json.loads(turn.tool_calls[0]["function"]["arguments"]) == {"a": 2, "b": 3}  # a JSON string


def test_several_calls_and_only_calls():
    text = ('<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>\n'
            '<tool_call>\n{"name": "mul", "arguments": {"x": "é"}}\n</tool_call>')  # fmt: skip
    turn = parse_tool_calls(text, "hermes")
    assert turn.content is None  # nothing but calls, as a server returns it
    assert [c["function"]["name"] for c in turn.tool_calls] == ["add", "mul"]
    assert [c["id"] for c in turn.tool_calls] == ["call_0", "call_1"]
    assert turn.tool_calls[1]["function"]["arguments"] == '{"x": "é"}'  # not escaped to ASCII


def test_arguments_as_a_json_string_or_an_object_give_the_same_call():
    as_object = parse_tool_calls('<tool_call>{"name": "f", "arguments": {"q": [1, 2]}}</tool_call>', "hermes")
    as_string = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"q\\": [1, 2]}"}</tool_call>', "hermes")
    assert as_object.tool_calls == as_string.tool_calls == [_call(0, "f", {"q": [1, 2]})]


@pytest.mark.parametrize("body", [
    '{"name": "add", "arguments": {"a": 2,',          # JSON cut short
    '{"name": "add"}',                                # no arguments
    '{"arguments": {}}',                              # no name
    '{"name": "add", "arguments": [1, 2]}',           # arguments not an object
    '{"name": "add", "arguments": "not json"}',       # a string that holds no JSON object
    '[1, 2]',
])  # fmt: skip
def test_a_malformed_call_stays_text_and_is_counted(body: str):
    text = f"Try: <tool_call>{body}</tool_call> ok"
    turn = parse_tool_calls(text, "hermes")
    assert turn.tool_calls == [] and turn.num_malformed == 1
    assert turn.content == text  # the turn as written


def test_malformed_next_to_valid_calls():
    text = ('<tool_call>{"name": "add", oops}</tool_call>\n'
            '<tool_call>{"name": "add", "arguments": {"a": 1, "b": 1}}</tool_call>')  # fmt: skip
    turn = parse_tool_calls(text, "hermes")
    assert turn.tool_calls == [_call(0, "add", {"a": 1, "b": 1})] and turn.num_malformed == 1
    assert turn.content == '<tool_call>{"name": "add", oops}</tool_call>'


def test_open_last_block_and_plain_text():
    turn = parse_tool_calls('Sure.\n<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 1}}\n', "hermes")
    assert turn.content == "Sure." and turn.tool_calls == [_call(0, "add", {"a": 1, "b": 1})]
    cut = parse_tool_calls('<tool_call>\n{"name": "add", "argum', "hermes")  # a turn that ran out of tokens
    assert cut.tool_calls == [] and cut.num_malformed == 1 and cut.content == '<tool_call>\n{"name": "add", "argum'
    plain = parse_tool_calls("  The answer is 5.\n", "hermes")
    assert plain.content == "  The answer is 5.\n" and plain.tool_calls == [] and plain.num_malformed == 0


def test_parser_none_and_unknown():
    text = '<tool_call>{"name": "add", "arguments": {}}</tool_call>'
    turn = parse_tool_calls(text, "none")
    assert turn.content == text and turn.tool_calls == [] and turn.num_malformed == 0
    with pytest.raises(ValueError, match=r"tool parser must be one of \['hermes', 'none'\], got 'json'"):
        parse_tool_calls(text, "json")
