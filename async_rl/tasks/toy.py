"""Built-in toy tasks on digit strings, with verifiable rewards a tiny model learns from scratch.

Prompts are ``<bos>`` + digits + an operator character; the answer follows, ended by ``<eos>``:

========  ===============  ==========  =============================================
task      prompt           answer      the answer
========  ===============  ==========  =============================================
copy      ``12345=``       ``12345``   the input
reverse   ``12345<``       ``54321``   the reversed input
sort      ``31524>``       ``12345``   the sorted input
add       ``47+38=``       ``85``      the sum
========  ===============  ==========  =============================================

The response is cut at its first ``<eos>``; other special tokens decode to ``?`` (never right). The
reward is per-position partial credit with the end of the answer counted as a position
(:func:`~async_rl.tasks.base.positional_credit`): ``(matches + length_ok) / (max(len(target),
len(response)) + 1)``, 1.0 exactly when the response is the answer. With ``strict_length=False`` it is
``matches / len(target)``, which ignores whatever follows a right prefix (a policy that never stops
gets full credit). Each score also reports ``exact`` (the answer, nothing more) and ``length_ok``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from async_rl.model import toy_tokenizer as tt
from async_rl.tasks.base import RewardFn, Score, Task, call_reward_fn, positional_credit
from async_rl.wire import PromptSpec

TOY_TASKS = ("copy", "reverse", "sort", "add")
"""Names of the built-in toy tasks."""
_OPERATOR = {"copy": "=", "reverse": "<", "sort": ">", "add": "="}
_UNKNOWN_CHAR = "?"
"""What a special token inside a response decodes to: a character no target contains."""


def response_text(response_ids: np.ndarray) -> str:
    """Toy-vocabulary text of a response, cut at the first ``<eos>``; other specials become ``?``."""
    out = []
    for i in np.asarray(response_ids).tolist():
        if i == tt.EOS_ID:
            break
        tok = tt.VOCAB_ITEMS.get(i)
        out.append(_UNKNOWN_CHAR if tok is None or tok in tt.SPECIAL_TOKENS else tok)
    return "".join(out)


class ToyTask(Task):
    """One of :data:`TOY_TASKS` (see the module docstring)."""

    name: str
    seed: int
    min_digits: int
    max_digits: int
    strict_length: bool
    _max_new_tokens: int | None
    reward_fn: RewardFn | None

    def __init__(
        self,
        name: str,
        *,
        seed: int = 0,
        min_digits: int = 5,
        max_digits: int = 5,
        strict_length: bool = True,
        reward_fn: RewardFn | None = None,
        max_new_tokens: int | None = None,
    ) -> None:
        if name not in TOY_TASKS:
            raise ValueError(f"task.name {name!r} is not a toy task ({', '.join(TOY_TASKS)})")
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"task digits must satisfy 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if 2 * max_digits + 2 > tt.MODEL_MAX_LENGTH // 2:
            raise ValueError(f"task.max_digits {max_digits} is too long for the toy models")
        self.name = name
        self.seed = seed
        self.min_digits = min_digits
        self.max_digits = max_digits
        self.strict_length = strict_length
        self.reward_fn = reward_fn
        self._max_new_tokens = max_new_tokens
        if max_new_tokens is not None and max_new_tokens < 1:
            raise ValueError("task.max_new_tokens must be >= 1")

    @property
    def num_prompts(self) -> int | None:
        return None

    @property
    def max_new_tokens(self) -> int:
        if self._max_new_tokens is not None:
            return self._max_new_tokens
        # The longest answer (a sum can carry one more digit) plus <eos>.
        return self.max_digits + (2 if self.name == "add" else 1)

    def prompt(self, index: int) -> PromptSpec:
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        return self._make(np.random.default_rng([self.seed, index]), f"{self.name}-{self.seed}-{index}", index)

    def eval_prompt(self, index: int) -> PromptSpec:
        """Held-out prompt ``index``: drawn from the seed sequence ``[seed, index, 1]``, a stream of its own."""
        if index < 0:
            raise ValueError(f"eval prompt index must be >= 0, got {index}")
        return self._make(np.random.default_rng([self.seed, index, 1]), f"{self.name}-{self.seed}-eval-{index}", index)

    def _make(self, rng: np.random.Generator, prompt_id: str, index: int) -> PromptSpec:
        n = int(rng.integers(self.min_digits, self.max_digits + 1))
        if self.name == "add":
            lo = 0 if n == 1 else 10 ** (n - 1)
            a, b = (int(x) for x in rng.integers(lo, 10**n, size=2))
            text, target = f"{a}+{b}=", str(a + b)
        else:
            digits = "".join(str(d) for d in rng.integers(0, 10, size=n))
            text = digits + _OPERATOR[self.name]
            target = {"copy": digits, "reverse": digits[::-1], "sort": "".join(sorted(digits))}[self.name]
        ids = np.array([tt.BOS_ID, *tt.encode(text)], dtype=np.int32)
        return PromptSpec(
            prompt_id=prompt_id,
            prompt_ids=ids,
            metadata={"task": self.name, "index": index, "prompt": text, "target": target},
        )

    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        return tt.decode(np.asarray(prompt_ids).tolist(), skip_special=False)

    def score(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> Score:
        target = metadata.get("target")
        if not isinstance(target, str) or not target:
            raise ValueError(f"prompt metadata for task {self.name!r} has no 'target' string: {dict(metadata)}")
        text = response_text(response_ids)
        if self.reward_fn is not None:
            return call_reward_fn(self.reward_fn, text, metadata)
        return positional_credit(text, target, strict_length=self.strict_length)

    def answer(self, metadata: Mapping[str, Any], response_ids: np.ndarray) -> str | None:
        """The response's digits, cut at the end token (what the reward compares with the target)."""
        return response_text(response_ids)
