"""Tool calls parsed out of a model turn's text, as an OpenAI-compatible server with a tool parser returns them.

A chat template shows the model its tools and the format to call them in; the model's turn is text in that
format, and a server's tool parser turns it into the message's ``tool_calls``. The environments of the adapters
expect that message. The parser is chosen by name (``task.env.tool_parser``, :data:`TOOL_PARSERS`):

* ``hermes``, ``llama3_json``, ``mistral``: the formats of Qwen2.5/Qwen3 (and Hermes), Llama 3.x and Mistral
  (:mod:`.tool_formats` describes each). Where vLLM is installed its own parser of that name reads the turn
  (``ToolParserManager``, :mod:`.vllm_tool_parsers`); elsewhere our reader of :mod:`.tool_formats`, which returns
  the same for the same text (checked against vLLM's on real model output in ``tests/vllm/test_tool_parsers.py``).
* ``auto``: the format the tokenizer's chat template teaches (the first of ``<tool_call>``, ``[TOOL_CALLS]``,
  ``<|python_tag|>`` it spells), decided once when the task is built; a template that spells none is refused.
* ``vllm:<name>``: any other parser of vLLM's registry (``vllm:qwen3_coder``, ``vllm:pythonic``,
  ``vllm:deepseek_v31``, ... 54 in vLLM 0.32); needs vLLM installed.
* ``none``: nothing is parsed; the text is the content (for environments that read the text themselves).

A call is ``{"id", "type": "function", "function": {"name", "arguments"}}`` with ``arguments`` a JSON string. A turn
whose calls do not parse is, as vLLM returns it, content with no call; it is counted (:attr:`ParsedTurn.num_malformed`)
when it opened a call (the format's marker, or a ``{`` first for ``llama3_json``). Ids are ``<id_prefix><index>``
(vLLM's random ids are replaced), the caller makes the prefix unique within its conversation.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from async_rl.tasks.envs.tool_formats import (
    MARKERS,
    Call,
    detect_format,
    read_hermes,
    read_llama3_json,
    read_mistral,
)

log = logging.getLogger(__name__)

TOOL_FORMATS = ("hermes", "llama3_json", "mistral")
"""The formats read by our own parsers (and by vLLM's of the same name where it is installed)."""
TOOL_PARSERS = (*TOOL_FORMATS, "auto", "none")
"""The values of ``task.env.tool_parser``, besides ``vllm:<name>``."""
VLLM_PREFIX = "vllm:"


def check_tool_parser(name: str, key: str = "task.env.tool_parser") -> None:
    """ValueError naming ``key`` when ``name`` is none of :data:`TOOL_PARSERS` nor ``vllm:<name>`` (config time:
    whether vLLM has that parser is checked when the task is built)."""
    if name in TOOL_PARSERS or (name.startswith(VLLM_PREFIX) and name[len(VLLM_PREFIX) :].strip()):
        return
    raise ValueError(f"{key} must be one of {list(TOOL_PARSERS)} or 'vllm:<name>' (a parser of vLLM's registry), "
                     f"got {name!r}")  # fmt: skip


@dataclass(slots=True)
class ParsedTurn:
    """A model turn as the assistant message a server returns."""

    content: str | None
    """The text outside the parsed calls, as the parser returns it (None: nothing but calls)."""
    tool_calls: list[dict[str, Any]] = field(default_factory=list)
    """OpenAI-style calls: ``{"id", "type": "function", "function": {"name", "arguments": <JSON string>}}``."""
    num_malformed: int = 0
    """1 when the turn opened a call but none parsed (the whole turn is then content), else 0."""


Reader = Callable[[str, Sequence[dict[str, Any]]], tuple[str | None, list[Call]]]
"""``(text, tools offered) -> (content, calls)``."""


@dataclass(slots=True)
class ToolParser:
    """A parser resolved for a task: its name, who reads (``ours`` or ``vllm``) and the markers kept at decoding."""

    name: str
    """The format (``hermes``, ...), ``vllm:<name>``, or ``none``."""
    backend: str
    """``ours`` (:mod:`.tool_formats`), ``vllm`` (vLLM's parser of that name) or ``none``."""
    keep_tokens: tuple[str, ...]
    """Special tokens a turn must keep when decoded for this parser (its markers)."""
    read: Reader | None
    """None for ``none``."""

    def parse(self, text: str, *, id_prefix: str = "call_", tools: Sequence[dict[str, Any]] = ()) -> ParsedTurn:
        """``text`` as the assistant message (module docstring); ``tools`` are the tools offered (some of vLLM's
        parsers type the arguments by them)."""
        if self.read is None:
            return ParsedTurn(content=text)
        content, calls = self.read(text, tools)
        if not calls:
            return ParsedTurn(content=content, num_malformed=int(self._opened(text)))
        tool_calls = [{"id": f"{id_prefix}{i}", "type": "function", "function": {"name": name, "arguments": args}}
                      for i, (name, args) in enumerate(calls)]  # fmt: skip
        return ParsedTurn(content=content, tool_calls=tool_calls)

    def _opened(self, text: str) -> bool:
        if self.name == "llama3_json":
            return text.lstrip().startswith(("{", "<|python_tag|>"))
        return any(m in text for m in self.keep_tokens[:1])


def make_tool_parser(name: str, tokenizer: Any = None) -> ToolParser:
    """The parser ``name`` (:data:`TOOL_PARSERS` or ``vllm:<name>``) for a model whose tokenizer is ``tokenizer``
    (a Hugging Face tokenizer, or None for the toy one); ValueError naming ``task.env.tool_parser`` when it cannot
    be had (an ``auto`` template that teaches no known format, a ``vllm:`` parser without vLLM)."""
    name = resolve_auto(name, tokenizer)
    if name == "none":
        return ToolParser(name="none", backend="none", keep_tokens=(), read=None)
    if name.startswith(VLLM_PREFIX):
        from async_rl.tasks.envs.vllm_tool_parsers import vllm_reader

        vllm_name = name[len(VLLM_PREFIX) :]
        read = vllm_reader(vllm_name, tokenizer, f"task.env.tool_parser={name}")
        return ToolParser(name=name, backend="vllm", keep_tokens=(), read=read)
    keep = MARKERS[name]
    if tokenizer is not None:
        from async_rl.tasks.envs.vllm_tool_parsers import vllm_available, vllm_reader

        if vllm_available():
            try:
                return ToolParser(name=name, backend="vllm", keep_tokens=keep,
                                  read=vllm_reader(name, tokenizer, f"task.env.tool_parser={name}"))  # fmt: skip
            except ValueError as exc:  # vLLM refuses this tokenizer (its marker token is not in the vocabulary)
                log.info("%s; reading tool calls with our own %s parser", exc, name)
    return ToolParser(name=name, backend="ours", keep_tokens=keep, read=_our_reader(name, tokenizer))


def resolve_auto(name: str, tokenizer: Any) -> str:
    """``name``, or for ``auto`` the format the chat template of ``tokenizer`` teaches (ValueError naming
    ``task.env.tool_parser`` when it spells none); nothing heavy is imported."""
    check_tool_parser(name)
    if name != "auto":
        return name
    template = getattr(tokenizer, "chat_template", None)
    found = detect_format(template) if isinstance(template, str) else None
    if found is None:
        raise ValueError("task.env.tool_parser=auto: the chat template of task.tokenizer spells none of the "
                         f"tool-call formats {list(TOOL_FORMATS)} (name the format, or vllm:<name>)")  # fmt: skip
    return found


def _our_reader(name: str, tokenizer: Any) -> Reader:
    if name == "hermes":
        return lambda text, tools: read_hermes(text)
    if name == "llama3_json":
        return lambda text, tools: read_llama3_json(text)
    # vLLM reads the v11 form ([TOOL_CALLS]name[ARGS]{...}) exactly when the vocabulary has [ARGS]; without a
    # tokenizer the text says which form it is.
    vocab = tokenizer.get_vocab() if tokenizer is not None else None
    if vocab is not None:
        v11 = "[ARGS]" in vocab
        return lambda text, tools: read_mistral(text, v11=v11)
    return lambda text, tools: read_mistral(text, v11="[ARGS]" in text)


def parse_tool_calls(text: str, parser: str, *, id_prefix: str = "call_", tokenizer: Any = None) -> ParsedTurn:
    """``text`` read by the parser ``parser`` (one-off use; a task resolves its parser once: :func:`make_tool_parser`)."""
    return make_tool_parser(parser, tokenizer).parse(text, id_prefix=id_prefix)
