"""Chat messages to token ids and back, for environments that speak text (the adapters' common need).

An episode's sequence is tokens; environments written for other systems (``verifiers``, ``skyrl-gym``) speak
chat messages (``{"role": ..., "content": ...}``). A :class:`TextCodec` renders the first prompt, renders the
messages an environment adds after a model turn, and decodes a model turn to text:

* :class:`ToyCodec`: the toy character tokenizer (:mod:`async_rl.model.toy_tokenizer`): a message is its content, the
  prompt is ``<bos>`` and the contents, a turn's text is cut at its first ``<eos>``. For tests and toy runs.
* :class:`ChatTemplateCodec`: a Hugging Face tokenizer and its chat template. The prompt is the template with the
  generation prompt (and the environment's tools, ``tools=``, for templates that list them). Messages added
  mid-episode are rendered as SkyRL does it: the template of a fixed base conversation followed by the new
  messages (with the generation prompt), less the template of the base alone, so that a reply's tokens do not
  depend on the conversation before it. The base is ``system, user, assistant`` (roles keep alternating), or
  ``system, user`` where the template renders that assistant message differently once something follows it
  (Qwen3 gives the last assistant message an empty ``<think>`` block): the cut is made only where the base's own
  tokens are a prefix. The model's own turn stays the tokens it sampled (never re-rendered), so the learner
  trains on exactly what was sampled.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from async_rl.model import toy_tokenizer as tt
from async_rl.tasks.text import show_ids

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
"""A chat message: ``{"role": "user" | "assistant" | "tool" | "system", "content": str, ...}``."""
Tool = dict[str, Any]
"""A tool as chat templates take it (OpenAI's format): ``{"type": "function", "function": {"name", "description",
"parameters"}}``."""


def as_messages(prompt: Any, what: str = "prompt") -> list[Message]:
    """A prompt given as text or as a list of chat messages, as messages (ValueError naming ``what``)."""
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if not isinstance(prompt, Sequence) or not all(isinstance(m, dict) and "content" in m for m in prompt):
        raise ValueError(f"{what} must be text or a list of chat messages with a 'content', got {prompt!r:.200}")
    return [dict(m) for m in prompt]


class TextCodec(abc.ABC):
    """Renders messages to token ids and decodes model turns (see the module docstring)."""

    @abc.abstractmethod
    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> np.ndarray:
        """int32 ids of the conversation that opens an episode, ready for the model's first turn, with ``tools``
        listed where the format has a place for them (ValueError where it has none)."""

    @abc.abstractmethod
    def reply_ids(self, messages: Sequence[Message]) -> np.ndarray:
        """int32 ids of messages an environment adds after a model turn, ready for the model's next turn."""

    @abc.abstractmethod
    def decode(self, ids: np.ndarray, keep: Sequence[str] = ()) -> str:
        """Text of a model turn, cut at its end token, special tokens dropped but those named in ``keep`` (a tool
        parser's markers, special tokens in some tokenizers: ``[TOOL_CALLS]``, ``<|python_tag|>``)."""

    def show(self, ids: np.ndarray) -> str:
        """Text of token ids with the special tokens shown, as the model reads them (for logs; default: the ids)."""
        return f"token ids {np.asarray(ids).tolist()}"


class ToyCodec(TextCodec):
    """The toy character tokenizer: messages are their contents, concatenated (no roles)."""

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> np.ndarray:
        if tools:
            raise ValueError(f"the toy tokenizer cannot show the model {len(tools)} tool(s): set task.tokenizer to "
                             "one whose chat template lists tools")  # fmt: skip
        return np.array([tt.BOS_ID, *self._encode(messages)], dtype=np.int32)

    def reply_ids(self, messages: Sequence[Message]) -> np.ndarray:
        return np.array(self._encode(messages), dtype=np.int32)

    def decode(self, ids: np.ndarray, keep: Sequence[str] = ()) -> str:
        out = np.asarray(ids).tolist()
        if tt.EOS_ID in out:
            out = out[: out.index(tt.EOS_ID)]
        return tt.decode(out)

    def show(self, ids: np.ndarray) -> str:
        return tt.decode(np.asarray(ids).tolist(), skip_special=False)

    @staticmethod
    def _encode(messages: Sequence[Message]) -> list[int]:
        return tt.encode("".join(str(m.get("content") or "") for m in messages))


BASE_CONVERSATION: list[Message] = [{"role": "system", "content": "You are a helpful assistant."},
                                    {"role": "user", "content": "Hi."},
                                    {"role": "assistant", "content": "Hello."}]  # fmt: skip
"""What a chat template renders mid-episode replies after (its own tokens are cut off again)."""
BASE_CONVERSATIONS = (BASE_CONVERSATION, BASE_CONVERSATION[:2])
"""Tried in order: the first whose tokens are a prefix of the base followed by the reply is cut off."""


class ChatTemplateCodec(TextCodec):
    """A Hugging Face tokenizer with a chat template."""

    tokenizer: PreTrainedTokenizerBase
    _bases: list[tuple[list[Message], list[int]]]
    """Each base conversation of :data:`BASE_CONVERSATIONS` with its tokens."""
    _kept: dict[tuple[str, ...], dict[int, str]]
    """Per ``keep`` of :meth:`decode`, the special tokens' ids it keeps."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template (task.tokenizer must name one that has)")
        self.tokenizer = tokenizer
        self._kept = {}
        self._bases = [(base, self._render(base, generation_prompt=False)) for base in BASE_CONVERSATIONS]

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool, tools: Sequence[Tool] = ()) -> list[int]:
        out: Any = self.tokenizer.apply_chat_template(list(messages), tools=list(tools) or None, tokenize=True,
                                                      add_generation_prompt=generation_prompt)  # fmt: skip
        return [int(i) for i in (out if isinstance(out, list) else out["input_ids"])]  # a list or a BatchEncoding

    def prompt_ids(self, messages: Sequence[Message], tools: Sequence[Tool] = ()) -> np.ndarray:
        return np.array(self._render(messages, generation_prompt=True, tools=tools), dtype=np.int32)

    def reply_ids(self, messages: Sequence[Message]) -> np.ndarray:
        for base, base_ids in self._bases:
            full = self._render([*base, *messages], generation_prompt=True)
            if full[: len(base_ids)] == base_ids:
                return np.array(full[len(base_ids) :], dtype=np.int32)
        raise ValueError("the chat template renders every base conversation differently once messages follow it, "
                         f"so a reply cannot be cut from it (roles {[m.get('role') for m in messages]})")  # fmt: skip

    def lists_tools(self) -> bool:
        """Whether the template shows the model the tools it is given (``tools=``; some templates ignore them)."""
        probe: Tool = {"type": "function", "function": {"name": "async_rl_probe_tool", "description": "",
                                                         "parameters": {"type": "object", "properties": {}}}}
        ids = self._render([{"role": "user", "content": "Hi."}], generation_prompt=True, tools=[probe])
        return "async_rl_probe_tool" in str(self.tokenizer.decode(ids))

    def decode(self, ids: np.ndarray, keep: Sequence[str] = ()) -> str:
        out = np.asarray(ids).tolist()
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos in out:
            out = out[: out.index(eos)]
        kept = self._kept_ids(tuple(keep))
        if not kept or not kept.keys() & set(out):
            return str(self.tokenizer.decode(out, skip_special_tokens=True))
        pieces: list[str] = []
        run: list[int] = []  # the kept tokens written as themselves, what lies between decoded as usual
        for i in out:
            if i in kept:
                pieces += [str(self.tokenizer.decode(run, skip_special_tokens=True)), kept[i]]
                run = []
            else:
                run.append(i)
        return "".join([*pieces, str(self.tokenizer.decode(run, skip_special_tokens=True))])

    def _kept_ids(self, keep: tuple[str, ...]) -> dict[int, str]:
        """The ids of the special tokens among ``keep`` (those decoding would drop), with their text."""
        if keep not in self._kept:
            special, found = set(self.tokenizer.all_special_ids), {}
            for token in keep:
                i = self.tokenizer.convert_tokens_to_ids(token)
                if isinstance(i, int) and i in special:
                    found[i] = token
            self._kept[keep] = found
        return self._kept[keep]

    def show(self, ids: np.ndarray) -> str:
        return show_ids(self.tokenizer, ids)


def make_codec(tokenizer: str) -> TextCodec:
    """The codec of ``task.tokenizer`` ('' = the toy character tokenizer)."""
    if not tokenizer:
        return ToyCodec()
    from async_rl.model.presets import load_tokenizer

    return ChatTemplateCodec(load_tokenizer(tokenizer))
