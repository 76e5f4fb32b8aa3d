"""Chat messages to token ids and back, for environments that speak text (the adapters' common need).

An episode's sequence is tokens; environments written for other systems (``verifiers``, ``skyrl-gym``) speak
chat messages (``{"role": ..., "content": ...}``). A :class:`TextCodec` renders the first prompt, renders the
messages an environment adds after a model turn, and decodes a model turn to text:

* :class:`ToyCodec`: the toy character tokenizer (:mod:`async_rl.tokenizer`): a message is its content, the
  prompt is ``<bos>`` and the contents, a turn's text is cut at its first ``<eos>``. For tests and toy runs.
* :class:`ChatTemplateCodec`: a Hugging Face tokenizer and its chat template. The prompt is the template with the
  generation prompt. Messages added mid-episode are rendered as SkyRL does it: the template of a fixed base
  conversation followed by the new messages (with the generation prompt), less the template of the base
  alone, so that a reply's tokens do not depend on the conversation before it. The model's own turn stays
  the tokens it sampled (never re-rendered), so the learner trains on exactly what was sampled.
"""

from __future__ import annotations

import abc
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from async_rl import tokenizer as tt

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

Message = dict[str, Any]
"""A chat message: ``{"role": "user" | "assistant" | "tool" | "system", "content": str, ...}``."""


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
    def prompt_ids(self, messages: Sequence[Message]) -> np.ndarray:
        """int32 ids of the conversation that opens an episode, ready for the model's first turn."""

    @abc.abstractmethod
    def reply_ids(self, messages: Sequence[Message]) -> np.ndarray:
        """int32 ids of messages an environment adds after a model turn, ready for the model's next turn."""

    @abc.abstractmethod
    def decode(self, ids: np.ndarray) -> str:
        """Text of a model turn, cut at its end token, special tokens dropped."""


class ToyCodec(TextCodec):
    """The toy character tokenizer: messages are their contents, concatenated (no roles)."""

    def prompt_ids(self, messages: Sequence[Message]) -> np.ndarray:
        return np.array([tt.BOS_ID, *self._encode(messages)], dtype=np.int32)

    def reply_ids(self, messages: Sequence[Message]) -> np.ndarray:
        return np.array(self._encode(messages), dtype=np.int32)

    def decode(self, ids: np.ndarray) -> str:
        out = np.asarray(ids).tolist()
        if tt.EOS_ID in out:
            out = out[: out.index(tt.EOS_ID)]
        return tt.decode(out)

    @staticmethod
    def _encode(messages: Sequence[Message]) -> list[int]:
        return tt.encode("".join(str(m.get("content") or "") for m in messages))


BASE_CONVERSATION: list[Message] = [{"role": "system", "content": "You are a helpful assistant."},
                                    {"role": "user", "content": "Hi."},
                                    {"role": "assistant", "content": "Hello."}]  # fmt: skip
"""What a chat template renders mid-episode replies after (its own tokens are cut off again)."""


class ChatTemplateCodec(TextCodec):
    """A Hugging Face tokenizer with a chat template."""

    tokenizer: PreTrainedTokenizerBase
    _base_len: int

    def __init__(self, tokenizer: PreTrainedTokenizerBase) -> None:
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("the tokenizer has no chat template (task.tokenizer must name one that has)")
        self.tokenizer = tokenizer
        self._base_len = len(self._render(BASE_CONVERSATION, generation_prompt=False))

    def _render(self, messages: Sequence[Message], *, generation_prompt: bool) -> list[int]:
        out: Any = self.tokenizer.apply_chat_template(list(messages), tokenize=True,
                                                      add_generation_prompt=generation_prompt)  # fmt: skip
        return [int(i) for i in (out if isinstance(out, list) else out["input_ids"])]  # a list or a BatchEncoding

    def prompt_ids(self, messages: Sequence[Message]) -> np.ndarray:
        return np.array(self._render(messages, generation_prompt=True), dtype=np.int32)

    def reply_ids(self, messages: Sequence[Message]) -> np.ndarray:
        full = self._render([*BASE_CONVERSATION, *messages], generation_prompt=True)
        return np.array(full[self._base_len :], dtype=np.int32)

    def decode(self, ids: np.ndarray) -> str:
        out = np.asarray(ids).tolist()
        eos = self.tokenizer.eos_token_id
        if eos is not None and eos in out:
            out = out[: out.index(eos)]
        return str(self.tokenizer.decode(out, skip_special_tokens=True))


def make_codec(tokenizer: str) -> TextCodec:
    """The codec of ``task.tokenizer`` ('' = the toy character tokenizer)."""
    if not tokenizer:
        return ToyCodec()
    from async_rl.models import load_tokenizer

    return ChatTemplateCodec(load_tokenizer(tokenizer))
