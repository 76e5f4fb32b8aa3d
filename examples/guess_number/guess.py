"""Guess the number: an environment of your own in one file (docs/environments.md runs it as it is).

The model guesses a secret number between 1 and ``max_number``; after a wrong guess the environment answers
"higher" or "lower" and the model guesses again, up to ``max_guesses`` times. A right guess ends the episode with
reward 1. Run it with ``task.name=examples/guess_number/guess.py:GuessTask`` and ``task.tokenizer`` a model
directory with a chat template (``async-rl init-model models/bytes-moe``), the same for the learner and every
generator.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import numpy as np

from async_rl.tasks.envs import EnvReply, EnvTask, Episode
from async_rl.tasks.envs.text import ChatTemplateCodec
from async_rl.wire import PromptSpec

HELD_OUT = 1 << 30  # evaluation prompt j plays game HELD_OUT + j: never one of the training games


class GuessEpisode(Episode):
    """One game, a fresh instance per sample: each model turn is a guess, each reply a hint."""

    def __init__(self, secret: int, codec: ChatTemplateCodec, max_guesses: int) -> None:
        self.secret, self.codec, self.max_guesses = secret, codec, max_guesses
        self.guesses = 0

    async def step(self, action_ids: np.ndarray) -> EnvReply:
        self.guesses += 1
        text = self.codec.decode(action_ids)  # the model's turn as text, cut at its end token
        number = re.search(r"-?\d+", text)
        guess = int(number.group()) if number else None
        info = {"solved": float(guess == self.secret), "guesses": float(self.guesses)}
        if guess == self.secret or self.guesses >= self.max_guesses:
            return EnvReply(tokens=np.zeros(0, np.int32), reward=info["solved"], done=True, info=info)
        hint = "A number, please." if guess is None else ("Higher." if guess < self.secret else "Lower.")
        # The reply as the chat template renders a user message after the model's turn; appended to the context
        # and masked out of the loss.
        return EnvReply(tokens=self.codec.reply_ids([{"role": "user", "content": hint}]), info=info)


class GuessTask(EnvTask):
    """Prompts (one game each) for the learner, episodes for the generators; built by async-rl as
    ``GuessTask(seed=task.seed, tokenizer=<task.tokenizer loaded>, **task.args)``."""

    name = "guess"  # labels the prompts and the evaluation metrics (eval/guess/...)

    def __init__(self, *, seed: int = 0, tokenizer: Any = None, max_number: int = 100, max_guesses: int = 6) -> None:
        if tokenizer is None:
            raise ValueError("guess needs task.tokenizer: a model directory with a chat template")
        self.seed, self.max_number, self.max_guesses = seed, max_number, max_guesses
        self.codec = ChatTemplateCodec(tokenizer)  # renders chat messages to token ids and back

    @property
    def num_prompts(self) -> int | None:
        return None  # an endless stream of games

    @property
    def max_new_tokens(self) -> int:
        return 8  # per model turn: a number and the end token

    def _game(self, game: int, prompt_id: str) -> PromptSpec:
        secret = int(np.random.default_rng([self.seed, game]).integers(1, self.max_number + 1))
        ask = f"I am thinking of a number between 1 and {self.max_number}. Guess it: answer with the number only."
        return PromptSpec(
            prompt_id=prompt_id,
            prompt_ids=self.codec.prompt_ids([{"role": "user", "content": ask}]),  # what the model reads first
            metadata={"task": self.name, "secret": secret},  # travels with the prompt to the generator's episode
        )

    def prompt(self, index: int) -> PromptSpec:
        """Training prompt ``index``: the same index gives the same game, so the learner resumes by index."""
        return self._game(index, f"guess-{self.seed}-{index}")

    def eval_prompt(self, index: int) -> PromptSpec:
        """Held-out prompt ``index``, for evaluation during training (learner.eval.*)."""
        return self._game(HELD_OUT + index, f"guess-{self.seed}-eval-{index}")

    def prompt_text(self, prompt_ids: np.ndarray) -> str:
        return self.codec.show(prompt_ids)  # how the learner's log shows the first prompt

    def episode(self, metadata: Mapping[str, Any]) -> Episode:
        return GuessEpisode(int(metadata["secret"]), self.codec, self.max_guesses)
