"""Our own readers of the tool-call formats, written to return what vLLM 0.32's tool parsers return for the same text.

Each reader takes a model turn's text (its marker tokens kept: see :data:`MARKERS`) and returns ``(content, calls)``,
``calls`` a list of ``(name, arguments as a JSON string)``: what ``vllm serve --tool-call-parser <format>`` puts in
the assistant message, ids aside. They are the fallback of :mod:`.tool_calls` where vLLM is not installed, so they
copy vLLM's choices, the odd ones included (``tests/vllm/test_tool_parsers.py`` runs both on the strings of
``tests/unit/tool_call_cases.json`` and requires the same answer):

* ``hermes`` (Hermes 2 Pro, Qwen2.5, Qwen3, QwQ: ``<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>``,
  any number per turn, the last one may be left open): every block must be a JSON object with a string ``name``
  and an ``arguments`` key, else the whole turn is content and no call is made. ``arguments`` is dumped as it is
  (a string stays a JSON string). ``content`` is the text before the first block, as it is, None when empty.
* ``llama3_json`` (Llama 3.1 / 3.2 / 3.3 JSON calls, ``{"name": ..., "parameters": {...}}``, optionally after
  ``<|python_tag|>``, several separated by ``;``): every top-level ``{`` of the turn must start a JSON object with
  ``name`` and ``arguments`` or ``parameters``, else the whole turn is content. With calls, ``content`` is None.
* ``mistral``: with a tokenizer whose vocabulary has ``[ARGS]`` (Mistral's v11 tokenizers and later: Mistral Small
  3.2, Magistral, Devstral), ``[TOOL_CALLS]name[ARGS]{...}`` per call, the arguments cut after their first JSON
  value; otherwise (v3 tokenizers: Mistral 7B v0.3, Mixtral 8x22B, Mistral Nemo) ``[TOOL_CALLS][{"name": ...,
  "arguments": {...}}, ...]``. ``content`` is the text before the first ``[TOOL_CALLS]`` (stripped in the v11 form).
"""

from __future__ import annotations

import json
import re
from typing import Any

Call = tuple[str, str]
"""A parsed call: the function's name and its arguments as a JSON string (as OpenAI's API carries them)."""

MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": ("<tool_call>", "</tool_call>"),
    "llama3_json": ("<|python_tag|>",),
    "mistral": ("[TOOL_CALLS]", "[ARGS]"),
}
"""Per format, the strings that mark its calls: kept when a turn is decoded (they are special tokens in some
tokenizers, which decoding would otherwise drop; vLLM keeps them for its parsers too)."""

_HERMES_BLOCK = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)", re.DOTALL)
_DECODER = json.JSONDecoder()


def _dump(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def read_hermes(text: str) -> tuple[str | None, list[Call]]:
    """The ``hermes`` format (module docstring)."""
    start = text.find("<tool_call>")
    if start < 0:
        return text, []
    calls = []
    for closed, left_open in _HERMES_BLOCK.findall(text):
        try:
            obj = json.loads(closed or left_open)
        except json.JSONDecodeError:
            return text, []
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or "arguments" not in obj:
            return text, []
        calls.append((obj["name"], _dump(obj["arguments"])))
    return text[:start] or None, calls


def read_llama3_json(text: str) -> tuple[str | None, list[Call]]:
    """The ``llama3_json`` format (module docstring)."""
    calls = []
    end = -1
    for match in re.finditer(r"\{", text):
        if match.start() <= end:  # inside an object read already
            continue
        try:
            obj, length = _DECODER.raw_decode(text[match.start() :])
        except json.JSONDecodeError:
            return text, []
        end = match.start() + length
        if not isinstance(obj, dict) or "name" not in obj or not ("arguments" in obj or "parameters" in obj):
            return text, []
        if not isinstance(obj["name"], str):
            return text, []
        calls.append((obj["name"], _dump(obj["arguments"] if "arguments" in obj else obj["parameters"])))
    return (None, calls) if calls else (text, [])


def read_mistral(text: str, *, v11: bool) -> tuple[str | None, list[Call]]:
    """The ``mistral`` format (module docstring): ``v11`` when the tokenizer's vocabulary has ``[ARGS]``."""
    if "[TOOL_CALLS]" not in text:
        return text, []
    return _read_mistral_v11(text) if v11 else _read_mistral_v3(text)


def _read_mistral_v3(text: str) -> tuple[str | None, list[Call]]:
    content, *segments = text.split("[TOOL_CALLS]")
    body = next((s.strip() for s in segments if s.strip()), "")
    try:
        parsed, _ = _DECODER.raw_decode(body)
    except json.JSONDecodeError:
        found = re.findall(r"\[{.*}\]", body, re.DOTALL)
        try:
            parsed = json.loads(found[0]) if found else None
        except json.JSONDecodeError:
            parsed = None
    items = [parsed] if isinstance(parsed, dict) else parsed if isinstance(parsed, list) else []
    calls = []
    for item in items:
        if not isinstance(item, dict) or not ("name" in item or "arguments" in item):
            continue
        arguments = item.get("arguments")
        arguments = "{}" if arguments is None else arguments if isinstance(arguments, str) else _dump(arguments)
        calls.append((item["name"] if isinstance(item.get("name"), str) else "", arguments))
    if not calls:
        return body, []
    return (content if content.strip() else None), calls


def _read_mistral_v11(text: str) -> tuple[str | None, list[Call]]:
    content, *segments = text.split("[TOOL_CALLS]")
    calls = []
    for segment in segments:
        if "[ARGS]" in segment:
            name, _, raw = segment.partition("[ARGS]")
        elif "{" in segment:
            name, raw = segment[: segment.index("{")], segment[segment.index("{") :]
        else:
            name, raw = segment, ""
            if not name.strip():
                continue  # a marker with nothing after it
        calls.append((name.strip(), _first_json_value(raw)))
    return content.strip() or None, calls


def _first_json_value(raw: str) -> str:
    """The arguments of a v11 call: the first JSON value of ``raw`` (what follows it dropped), ``{}`` when empty,
    the stripped text when it holds no JSON value."""
    stripped = raw.strip()
    if not stripped:
        return "{}"
    try:
        _, end = _DECODER.raw_decode(stripped)
    except json.JSONDecodeError:
        return stripped
    return stripped[:end]


def detect_format(chat_template: str) -> str | None:
    """The tool-call format a chat template teaches (``auto``): the first of its markers it spells, or None."""
    if "<tool_call>" in chat_template:
        return "hermes"
    if "[TOOL_CALLS]" in chat_template:
        return "mistral"
    if "<|python_tag|>" in chat_template or '"parameters": ' in chat_template:
        return "llama3_json"
    return None
