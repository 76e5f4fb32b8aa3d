"""A verifiers environment (classic API, ``import verifiers as vf``) for the adapter tests, written as a verifiers
user writes one: a ``vf.MultiTurnEnv`` with ``env_response``, a ``vf.Rubric`` of reward functions, and a
``load_environment`` that builds it on a ``datasets.Dataset``. The game is ``tool_copy`` in the toy vocabulary:
the first turn calls the tool with ``*`` and gets the hidden digits, the second copies them."""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset


def _text(message: Any) -> str:
    content = message["content"] if isinstance(message, dict) else message.content
    return content if isinstance(content, str) else ""


class DigitLookupEnv(vf.MultiTurnEnv):
    def __init__(self, broken: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.broken = broken

    async def env_response(self, messages: vf.Messages, state: vf.State, **kwargs: Any) -> vf.Messages:
        if self.broken:
            raise ConnectionError("the lookup service is down")
        called = "*" in _text(messages[-1])
        state["called"] = called
        return [vf.UserMessage(content=(str(state["answer"]) if called else "") + "=")]


def called(state: vf.State, **kwargs: Any) -> float:
    return float(bool(state.get("called")))


def correct(completion: vf.Messages, answer: str, **kwargs: Any) -> float:
    return float(bool(completion) and _text(completion[-1]).strip() == answer)


def load_environment(num_rows: int = 8, broken: bool = False) -> vf.Environment:
    rows = [{"prompt": [{"role": "user", "content": ","}], "answer": f"{i % 10}{(i + 1) % 10}"}
            for i in range(num_rows)]  # fmt: skip
    rubric = vf.Rubric(funcs=[called, correct], weights=[0.5, 0.5])
    return DigitLookupEnv(dataset=Dataset.from_list(rows), rubric=rubric, max_turns=2, broken=broken)
