"""Prompts from a JSONL file, scored by a built-in or a user's ``module:function`` reward.

Each line is a JSON object with the prompt as text (``"prompt"``, or the field named by
``prompt_field``) or as token ids (``"prompt_ids"``); an optional ``"id"``; every other field
(for example ``"answer"``) goes into the prompt's metadata for the scorer. The file is read
once and checked line by line (errors name the line). Epochs are reshuffled deterministically
from ``(seed, epoch)``. A text prompt is encoded as :class:`~async_rl.tasks.text.PromptFormat` says: through the
tokenizer's chat template (a user message; with ``math_verify`` followed by :data:`MATH_ANSWER_FORMAT`) or as raw
text.

Built-in rewards compare the decoded response with the row's ``"answer"``: ``exact_match``
(1.0 when equal after stripping whitespace), ``positional`` (per-position partial credit) and ``math_verify``
(1.0 when math-verify finds the response's final answer, LaTeX or plain, equal to ``"answer"``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from async_rl.model import toy_tokenizer as tt
from async_rl.tasks.base import RewardFn, Score, Task, call_reward_fn, positional_credit, row_of
from async_rl.tasks.math_verify_reward import MathVerifyReward
from async_rl.tasks.text import PromptFormat, decode_response, show_ids
from async_rl.tasks.toy import response_text
from async_rl.wire import PromptSpec

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

BUILTIN_REWARDS = ("exact_match", "positional", "math_verify")
"""Rewards a JSONL task can name without code; all need an ``"answer"`` field (``math_verify``: the
math-verify package, mathematical equality of the response's answer and the row's)."""
MATH_ANSWER_FORMAT = "Please reason step by step, and put your final answer within \\boxed{}."
"""The instruction after a chat-formatted prompt scored by ``math_verify`` (``task.answer_format`` unset): the
scorer reads a ``\\boxed{}`` answer first (the phrasing of Qwen2.5-Math and DeepSeek-R1's math prompts)."""


class JsonlTask(Task):
    """Prompts read from a JSONL file (see the module docstring)."""

    name = "jsonl"
    path: Path
    seed: int
    shuffle: bool
    rows: list[tuple[str, np.ndarray, dict[str, Any]]]
    """(row id, prompt ids, metadata) per line."""
    eval_rows: list[tuple[str, np.ndarray, dict[str, Any]]]
    """The same, of the held-out file (``task.eval_jsonl_path``; empty without one)."""
    format: PromptFormat
    """How text prompts become token ids (chat template or raw text)."""
    _math: MathVerifyReward | None
    """The ``math_verify`` scorer (its parsed references cached), when that is the reward."""

    def __init__(
        self,
        path: str | Path,
        *,
        seed: int = 0,
        prompt_field: str = "prompt",
        reward: str = "exact_match",
        reward_fn: RewardFn | None = None,
        tokenizer: PreTrainedTokenizerBase | None = None,
        prompt_format: PromptFormat | None = None,
        shuffle: bool = True,
        max_new_tokens: int = 32,
        eval_path: str | Path | None = None,
    ) -> None:
        """``eval_path``: a second JSONL file of the same form, the held-out split (:meth:`eval_prompt`);
        ``prompt_format``: how text prompts become token ids (default: raw text with the bos in front)."""
        self.path = Path(path)
        if not self.path.is_file():
            raise ValueError(f"task.jsonl_path {str(self.path)!r} is not a file")
        if reward_fn is None and reward not in BUILTIN_REWARDS:
            raise ValueError(
                f"task.reward {reward!r} is neither built in ({', '.join(BUILTIN_REWARDS)}) nor module:function"
            )
        if max_new_tokens < 1:
            raise ValueError("task.max_new_tokens must be >= 1")
        self.seed, self.shuffle = seed, shuffle
        self._reward, self._reward_fn = reward, reward_fn
        self._math = MathVerifyReward() if reward_fn is None and reward == "math_verify" else None
        self._tokenizer = tokenizer
        self.format = prompt_format or PromptFormat()
        if self.format.chat and tokenizer is None:
            raise ValueError("task.chat_template needs task.tokenizer: the toy tokenizer has no chat template")
        self._max_new_tokens = max_new_tokens
        self.rows = []
        with self.path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if line.strip():
                    self.rows.append(self._parse(line, lineno, prompt_field))
        if not self.rows:
            raise ValueError(f"task.jsonl_path {str(self.path)!r} has no prompts")
        self.eval_rows = []
        if eval_path is not None:
            held_out = Path(eval_path)
            if not held_out.is_file():
                raise ValueError(f"task.eval_jsonl_path {str(held_out)!r} is not a file")
            main_path, self.path = self.path, held_out  # _parse names the file it reads
            with held_out.open(encoding="utf-8") as f:
                for lineno, line in enumerate(f, start=1):
                    if line.strip():
                        self.eval_rows.append(self._parse(line, lineno, prompt_field))
            self.path = main_path
            if not self.eval_rows:
                raise ValueError(f"task.eval_jsonl_path {str(held_out)!r} has no prompts")
        if reward_fn is None and any("answer" not in meta for _, _, meta in self.rows):
            missing = next(i for i, (_, _, meta) in enumerate(self.rows) if "answer" not in meta)
            raise ValueError(f"{self.path}: reward {reward!r} needs an 'answer' field; row {missing + 1} has none")

    def _parse(self, line: str, lineno: int, field: str) -> tuple[str, np.ndarray, dict[str, Any]]:
        where = f"{self.path}:{lineno}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}: not valid JSON ({exc})") from exc
        if not isinstance(row, dict):
            raise ValueError(f"{where}: each line must be a JSON object, got {type(row).__name__}")
        if "prompt_ids" in row:
            ids = row.pop("prompt_ids")
            if not isinstance(ids, list) or not ids or not all(isinstance(i, int) and i >= 0 for i in ids):
                raise ValueError(f"{where}: prompt_ids must be a non-empty list of token ids")
            text = row.pop(field, None)
        elif field in row:
            text = row.pop(field)
            if not isinstance(text, str) or not text:
                raise ValueError(f"{where}: {field!r} must be a non-empty string")
            try:
                if self._tokenizer is None:
                    ids = [tt.BOS_ID, *tt.encode(text)] if self.format.add_bos else tt.encode(text)
                else:
                    ids = self.format.encode(self._tokenizer, text).tolist()
            except ValueError as exc:
                hint = ("; the presets' toy tokenizer knows digits only: a text task needs task.tokenizer, a Hugging "
                        "Face model directory (the model's own: model.name / torch.model.name), see docs/tasks.md"
                        ) if self._tokenizer is None else ""  # fmt: skip
                raise ValueError(f"{where}: {exc}{hint}") from exc
        else:
            raise ValueError(f"{where}: needs a {field!r} (text) or 'prompt_ids' field")
        row_id = str(row.pop("id", lineno))
        meta = {"task": self.name, "row": row_id, **({"prompt": text} if text is not None else {}), **row}
        return row_id, np.asarray(ids, dtype=np.int32), meta

    @property
    def num_prompts(self) -> int | None:
        return len(self.rows)

    @property
    def max_new_tokens(self) -> int:
        return self._max_new_tokens

    def prompt(self, index: int) -> PromptSpec:
        pos = row_of(index, len(self.rows), self.seed, self.shuffle)
        _, ids, meta = self.rows[pos]
        return PromptSpec(prompt_id=f"jsonl-{self.seed}-{index}", prompt_ids=ids.copy(), metadata=dict(meta))

    def eval_prompt(self, index: int) -> PromptSpec:
        """Held-out row ``index`` (cycling through ``task.eval_jsonl_path`` in file order)."""
        if not self.eval_rows:
            raise ValueError("task 'jsonl' has no held-out split: set task.eval_jsonl_path")
        if index < 0:
            raise ValueError(f"eval prompt index must be >= 0, got {index}")
        _, ids, meta = self.eval_rows[index % len(self.eval_rows)]
        return PromptSpec(prompt_id=f"jsonl-eval-{index}", prompt_ids=ids.copy(), metadata=dict(meta))

    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        if self._tokenizer is None:
            return tt.decode(np.asarray(prompt_ids).tolist(), skip_special=False)
        return show_ids(self._tokenizer, prompt_ids)

    def decode(self, response_ids: np.ndarray) -> str:
        """Response text cut at the first end token."""
        if self._tokenizer is None:
            return response_text(response_ids)
        return decode_response(self._tokenizer, response_ids)

    def answer(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> str | None:
        """The answer the built-in reward compares: the response stripped, or for ``math_verify`` what math-verify
        reads from it, normalized (``\\frac{1}{2}`` and ``0.5`` vote together); None with a reward of your own."""
        if self._reward_fn is not None:
            return None
        text = self.decode(response_ids)
        if self._math is not None:
            return self._math.answer(text)
        return text.strip()

    def score(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> Score:
        text = self.decode(response_ids)
        if self._reward_fn is not None:
            return call_reward_fn(self._reward_fn, text, metadata)
        answer = metadata.get("answer")
        if answer is None:
            raise ValueError(f"prompt metadata has no 'answer' for reward {self._reward!r}: {dict(metadata)}")
        answer = str(answer)
        if self._reward == "math_verify":
            assert self._math is not None
            return self._math(text, answer, metadata)
        if self._reward == "exact_match":
            return Score(reward=float(text.strip() == answer.strip()))
        return positional_credit(text.strip(), answer.strip(), strict_length=True)
