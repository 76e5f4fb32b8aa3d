"""A ``vf.ToolEnv`` (verifiers' classic API) for the adapter's tool-call tests, written as a verifiers user writes
one: a Python function as its only tool, a rubric that checks the final answer, a ``load_environment`` on a
``datasets.Dataset``. Each row asks for a sum; the tool adds."""

from __future__ import annotations

from typing import Any

import verifiers as vf
from datasets import Dataset


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: The first integer.
        b: The second integer.
    """
    return a + b


def correct(completion: vf.Messages, answer: str, **kwargs: Any) -> float:
    last = completion[-1] if completion else None
    content = last["content"] if isinstance(last, dict) else getattr(last, "content", None)
    return float(isinstance(content, str) and content.strip().endswith(answer))


def load_environment(num_rows: int = 4) -> vf.Environment:
    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + {i + 3}?"}], "answer": str(2 * i + 3)}
            for i in range(num_rows)]  # fmt: skip
    return vf.ToolEnv(dataset=Dataset.from_list(rows), tools=[add], rubric=vf.Rubric(funcs=[correct]), max_turns=4)
