"""Tool calls parsed out of a model turn's text, as an OpenAI-compatible server with a tool parser returns them.

A chat template shows the model its tools and the format to call them in; the model's turn is text in that
format, and a server's tool parser turns it into the message's ``tool_calls``. The environments of the adapters
expect that message. Parsers, chosen by name (``task.env.tool_parser``):

* ``hermes``: the Hermes / Qwen2.5 / Qwen3 format (vLLM's ``hermes`` parser reads the same), any number of calls
  per turn, each ``<tool_call>\\n{"name": "add", "arguments": {"a": 2, "b": 3}}\\n</tool_call>``. A call is
  ``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` a JSON string of an object
  (given as an object or as a string holding one). A block whose JSON does not parse, or lacks a string ``name``
  or an object ``arguments``, stays in the text and is counted (vLLM drops every call of such a turn instead);
  a last ``<tool_call>`` left open is read to the end, as vLLM does. ``content`` is the text outside the calls,
  stripped, None when empty; a turn without a call keeps its text as it is.
* ``none``: nothing is parsed; the text is the content (for environments that read the text themselves).

Pure functions: ids are ``<id_prefix><index>``, the caller makes the prefix unique within its conversation.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any

TOOL_PARSERS = ("hermes", "none")
"""The values of ``task.env.tool_parser``."""

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)
"""A closed block, or the last one left open (the turn ended inside it)."""


@dataclass(slots=True)
class ParsedTurn:
    """A model turn as the assistant message a server returns."""

    content: str | None
    """The text outside the parsed calls (None: nothing but calls)."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI-style calls: ``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``."""
    num_malformed: int = 0
    """Call blocks that did not parse (left in ``content``)."""


def parse_tool_calls(text: str, parser: str, *, id_prefix: str = "call_") -> ParsedTurn:
    """``text`` read by ``parser`` (one of :data:`TOOL_PARSERS`; ValueError otherwise)."""
    if parser == "none":
        return ParsedTurn(content=text)
    if parser == "hermes":
        return parse_hermes(text, id_prefix=id_prefix)
    raise ValueError(f"tool parser must be one of {list(TOOL_PARSERS)}, got {parser!r}")


def parse_hermes(text: str, *, id_prefix: str = "call_") -> ParsedTurn:
    """The ``<tool_call>`` blocks of ``text`` (see the module docstring)."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    malformed = 0
    end = 0
    for match in _HERMES_BLOCK.finditer(text):
        body = match.group(1) if match.group(1) is not None else match.group(2)
        call = _hermes_call(body)
        kept.append(text[end : match.start()])
        if call is None:
            malformed += 1
            kept.append(match.group(0))
        else:
            name, arguments = call
            calls.append({"id": f"{id_prefix}{len(calls)}", "type": "function",
                          "function": {"name": name, "arguments": arguments}})  # fmt: skip
        end = match.end()
    if not calls:
        return ParsedTurn(content=text, num_malformed=malformed)
    kept.append(text[end:])
    content = "".join(kept).strip()
    return ParsedTurn(content=content or None, tool_calls=calls, num_malformed=malformed)


def _hermes_call(body: str) -> tuple[str, str] | None:
    """(name, arguments as a JSON string) of one block's JSON, or None when it is not a call."""
    try:
        obj = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
        return None
    arguments = obj["arguments"]
    if isinstance(arguments, str):  # the arguments' JSON as a string, as OpenAI's API carries them
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return obj["name"], json.dumps(arguments, ensure_ascii=False)
