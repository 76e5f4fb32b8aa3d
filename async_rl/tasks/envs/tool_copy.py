"""``tool_copy``: a toy environment of two turns, in which the model must call a tool before it can answer.

Every prompt is the same two tokens, ``<bos>,``; the digits to write are hidden in the prompt's metadata.

1. The model's first turn calls the lookup tool when it contains ``*`` (anything else is not a call).
   The environment replies with the hidden digits followed by ``=`` (``4821=``), or with ``=`` alone
   when the tool was not called: the model must then answer blind.
2. The model's second turn is its answer, scored by strict positional credit against the digits
   (:func:`~async_rl.tasks.base.positional_credit`); the episode ends there.

Reward: ``0.5 * called + 0.5 * credit``, so a policy learns to call the tool first (a random one does it
in about a fifth of its first turns), then to copy what the tool returned. Components: ``called``,
``exact`` (the answer is the digits), ``length_ok``. A tiny model learns it from scratch in a few
dozen steps on the CPU; the copy it learns reads the digits from the environment's tokens, which
are in its context and never in its loss.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from async_rl.model import toy_tokenizer as tt
from async_rl.tasks.base import positional_credit
from async_rl.tasks.envs.base import EnvReply, EnvTask, Episode
from async_rl.tasks.toy import response_text
from async_rl.wire import PromptSpec

TOOL_CALL = "*"
"""The character that calls the lookup tool."""
PROMPT_TEXT = ","
"""Every prompt (after ``<bos>``): the task is the same, only the hidden digits differ."""


class ToolCopyEpisode(Episode):
    """One episode: turn 1 may call the tool, turn 2 answers (see the module docstring)."""

    target: str
    called: bool
    turn: int

    def __init__(self, target: str) -> None:
        if not target.isdigit():
            raise ValueError(f"tool_copy: the hidden target must be digits, got {target!r}")
        self.target = target
        self.called = False
        self.turn = 0

    async def step(self, action_ids: np.ndarray) -> EnvReply:
        self.turn += 1
        text = response_text(action_ids)
        if self.turn == 1:
            self.called = TOOL_CALL in text
            reply = (self.target if self.called else "") + "="
            return EnvReply(tokens=np.array(tt.encode(reply), dtype=np.int32))
        score = positional_credit(text, self.target, strict_length=True)
        called = float(self.called)
        return EnvReply(tokens=np.zeros(0, dtype=np.int32), reward=0.5 * called + 0.5 * score.reward, done=True,
                        info={"called": called, **score.info})  # fmt: skip


class ToolCopyTask(EnvTask):
    """Prompts of the ``tool_copy`` environment; ``seed`` and the index fix each prompt's hidden digits."""

    name = "tool_copy"
    seed: int
    min_digits: int
    max_digits: int

    def __init__(self, *, seed: int = 0, min_digits: int = 3, max_digits: int = 3) -> None:
        if not 1 <= min_digits <= max_digits:
            raise ValueError(f"task digits must satisfy 1 <= min_digits <= max_digits, got {min_digits}, {max_digits}")
        if 3 * max_digits + 8 > tt.MODEL_MAX_LENGTH // 2:
            raise ValueError(f"task.max_digits {max_digits} is too long for the toy models")
        self.seed = seed
        self.min_digits = min_digits
        self.max_digits = max_digits

    @property
    def num_prompts(self) -> int | None:
        return None

    @property
    def max_new_tokens(self) -> int:
        """Per model turn: the longest answer and its end token."""
        return self.max_digits + 1

    def prompt(self, index: int) -> PromptSpec:
        if index < 0:
            raise ValueError(f"prompt index must be >= 0, got {index}")
        return self._make(np.random.default_rng([self.seed, index]), f"{self.name}-{self.seed}-{index}", index)

    def eval_prompt(self, index: int) -> PromptSpec:
        """Held-out prompt ``index``: its digits drawn from the seed sequence ``[seed, index, 1]``, a stream of its own
        (as the toy tasks' held-out split)."""
        if index < 0:
            raise ValueError(f"eval prompt index must be >= 0, got {index}")
        return self._make(np.random.default_rng([self.seed, index, 1]), f"{self.name}-{self.seed}-eval-{index}", index)

    def _make(self, rng: np.random.Generator, prompt_id: str, index: int) -> PromptSpec:
        n = int(rng.integers(self.min_digits, self.max_digits + 1))
        target = "".join(str(d) for d in rng.integers(0, 10, size=n))
        ids = np.array([tt.BOS_ID, *tt.encode(PROMPT_TEXT)], dtype=np.int32)
        return PromptSpec(prompt_id=prompt_id, prompt_ids=ids,
                          metadata={"task": self.name, "index": index, "target": target})  # fmt: skip

    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        return tt.decode(np.asarray(prompt_ids).tolist(), skip_special=False)

    def episode(self, metadata: Mapping[str, Any]) -> Episode:
        target = metadata.get("target")
        if not isinstance(target, str):
            raise ValueError(f"tool_copy prompt metadata has no 'target' string: {dict(metadata)}")
        return ToolCopyEpisode(target)
