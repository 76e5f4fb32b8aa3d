"""Text prompts and responses through a Hugging Face tokenizer: what the text tasks (reasoning-gym, JSONL with a
tokenizer) share.

A text task's prompt becomes token ids in one of two ways (:class:`PromptFormat`): through the tokenizer's chat
template, as one user message (after a system message when there is one, with the answer-format instruction after
the text), ready for the assistant's turn; or as raw text, with the tokenizer's bos in front. ``task.chat_template``
chooses (unset: the chat template when the tokenizer has one, see :func:`prompt_format`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass(frozen=True, kw_only=True, slots=True)
class PromptFormat:
    """How a text task's prompt text becomes token ids (see the module docstring)."""

    chat: bool = False
    """Through the tokenizer's chat template (False: raw text)."""
    system_prompt: str = ""
    """chat: the system message ('' = none)."""
    instruction: str = ""
    """chat: appended to the user message after a blank line, e.g. the answer format the scorer extracts."""
    add_bos: bool = True
    """raw text: the tokenizer's bos token in front (a chat template places its own)."""

    def messages(self, text: str) -> list[dict[str, Any]]:
        """The conversation a chat-formatted prompt renders: an optional system message and the user's (``text`` with
        its trailing whitespace dropped, then the instruction)."""
        user = f"{text.rstrip()}\n\n{self.instruction}" if self.instruction else text.rstrip()
        system = [{"role": "system", "content": self.system_prompt}] if self.system_prompt else []
        return [*system, {"role": "user", "content": user}]

    def encode(self, tokenizer: PreTrainedTokenizerBase, text: str) -> np.ndarray:
        """int32 token ids of prompt ``text``."""
        if self.chat:
            out: Any = tokenizer.apply_chat_template(self.messages(text), tokenize=True, add_generation_prompt=True)
            ids = out if isinstance(out, list) else out["input_ids"]  # a list, or a BatchEncoding (transformers 5)
            return np.asarray([int(i) for i in ids], dtype=np.int32)
        return encode_prompt(tokenizer, text, add_bos=self.add_bos)


def has_chat_template(tokenizer: PreTrainedTokenizerBase | None) -> bool:
    return tokenizer is not None and bool(tokenizer.chat_template)


def prompt_format(tokenizer: PreTrainedTokenizerBase | None, *, chat_template: bool | None, system_prompt: str,
                  answer_format: str | None, default_answer_format: str, add_bos: bool) -> PromptFormat:  # fmt: skip
    """The format of ``task.chat_template`` (None: the chat template when ``tokenizer`` has one), ``task.system_prompt``
    and ``task.answer_format`` (None: ``default_answer_format``, the task's own); ValueError naming the field."""
    has = has_chat_template(tokenizer)
    chat = has if chat_template is None else chat_template
    if chat and not has:
        raise ValueError("task.chat_template is true, but the tokenizer of task.tokenizer has no chat template (a "
                         "directory from 'async-rl init-model' has one)")  # fmt: skip
    if not chat and (system_prompt or answer_format):
        field = "task.system_prompt" if system_prompt else "task.answer_format"
        why = "task.chat_template is false" if chat_template is False else "the tokenizer has no chat template"
        raise ValueError(f"{field} is set, but prompts are raw text ({why}): it goes into the chat template's messages")
    instruction = default_answer_format if answer_format is None else answer_format
    return PromptFormat(chat=chat, system_prompt=system_prompt, instruction=instruction if chat else "",
                        add_bos=add_bos)  # fmt: skip


def encode_prompt(tokenizer: PreTrainedTokenizerBase, text: str, *, add_bos: bool) -> np.ndarray:
    """Token ids of a raw text prompt (no special tokens but an optional bos in front)."""
    ids = list(tokenizer(text, add_special_tokens=False).input_ids)
    if add_bos and tokenizer.bos_token_id is not None:
        ids = [int(tokenizer.bos_token_id), *ids]
    return np.asarray(ids, dtype=np.int32)


def decode_response(tokenizer: PreTrainedTokenizerBase, response_ids: np.ndarray) -> str:
    """Response text cut at the first end token, special tokens dropped."""
    ids = np.asarray(response_ids).tolist()
    eos = tokenizer.eos_token_id
    if eos is not None and eos in ids:
        ids = ids[: ids.index(eos)]
    return str(tokenizer.decode(ids, skip_special_tokens=True))


def show_ids(tokenizer: PreTrainedTokenizerBase, ids: np.ndarray) -> str:
    """The text of token ids with the special tokens shown: what a model reads."""
    return str(tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=False))
