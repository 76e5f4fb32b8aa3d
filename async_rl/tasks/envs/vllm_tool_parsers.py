"""vLLM's own tool parsers, where vLLM is installed: the same reading of a turn as ``vllm serve --tool-call-parser``.

vLLM imported only here, and only when a task with a tool parser is built on a host that has it. Its registry,
``ToolParserManager``, moved from ``vllm.entrypoints.openai.tool_parsers`` to ``vllm.tool_parsers`` in later releases, and its
``ChatCompletionRequest`` from ``vllm.entrypoints.openai.protocol`` to ``...openai.chat_completion.protocol``; both
places are tried. A parser is built once per task with the model's tokenizer (``cls(tokenizer)``) and its
``extract_tool_calls(text, request)`` reads each turn, with a request that carries the tools offered (some parsers
type the arguments by them). vLLM logs every turn it cannot parse with a traceback; the episodes count those
(``reward/tool_calls/malformed``), so its parsers' loggers are set to CRITICAL here.
"""

from __future__ import annotations

import functools
import importlib.util
import logging
from collections.abc import Sequence
from typing import Any

from async_rl.tasks.envs.tool_formats import Call

PARSER_LOGGERS = ("vllm.tool_parsers", "vllm.entrypoints.openai.tool_parsers", "vllm.parser")
"""vLLM's loggers that report an unparsable turn (quieted: the episode counts them)."""


@functools.cache
def vllm_available() -> bool:
    """Whether vLLM is installed here (its package found; nothing imported)."""
    return importlib.util.find_spec("vllm") is not None


def _registry() -> tuple[Any, Any]:
    """(ToolParserManager, ChatCompletionRequest) of the installed vLLM."""
    try:
        from vllm.tool_parsers import ToolParserManager
    except ImportError:  # vLLM before 0.12
        from vllm.entrypoints.openai.tool_parsers import ToolParserManager  # type: ignore[no-redef]
    try:
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    except ImportError:
        from vllm.entrypoints.openai.protocol import ChatCompletionRequest  # type: ignore[no-redef]
    for name in PARSER_LOGGERS:
        logging.getLogger(name).setLevel(logging.CRITICAL)
    return ToolParserManager, ChatCompletionRequest


def vllm_parser_names() -> list[str]:
    """The parsers of the installed vLLM's registry."""
    manager, _ = _registry()
    return sorted(manager.list_registered())


def vllm_reader(name: str, tokenizer: Any, key: str) -> Any:
    """A reader ``(text, tools) -> (content, calls)`` backed by vLLM's parser ``name`` built on ``tokenizer``;
    ValueError naming ``key`` when vLLM is missing, has no such parser, or refuses the tokenizer."""
    if not vllm_available():
        raise ValueError(f"{key} needs vLLM installed (pip install 'async-rl[vllm]'), which this host does not have")
    if tokenizer is None:
        raise ValueError(f"{key} needs task.tokenizer: vLLM's parsers read a Hugging Face tokenizer")
    manager, request_cls = _registry()
    try:
        cls = manager.get_tool_parser(name)
    except KeyError:
        known = ", ".join(vllm_parser_names())
        raise ValueError(f"{key}: vLLM has no tool parser {name!r} (it has: {known})") from None
    try:
        parser = cls(tokenizer)
    except Exception as exc:  # vLLM's parsers raise RuntimeError/ValueError/KeyError for a tokenizer they cannot read
        raise ValueError(f"{key}: vLLM's {name} parser refuses task.tokenizer: {exc}") from exc
    plain = request_cls(model="async-rl", messages=[{"role": "user", "content": ""}])

    def read(text: str, tools: Sequence[dict[str, Any]]) -> tuple[str | None, list[Call]]:
        request = (request_cls(model="async-rl", messages=[{"role": "user", "content": ""}], tools=list(tools))
                   if tools else plain)  # fmt: skip
        out = parser.extract_tool_calls(text, request)
        if not out.tools_called:
            return out.content, []
        return out.content, [(c.function.name, c.function.arguments) for c in out.tool_calls]

    return read
