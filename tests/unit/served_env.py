"""An environment for ``test_env_http.py`` to serve with ``async-rl env-serve``: ``tool_copy`` with a held-out split,
whose step raises when the model's turn holds a ``-`` (the server's error path)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from async_rl.tasks.envs import EnvReply, Episode, ToolCopyEpisode, ToolCopyTask
from async_rl.tasks.toy import response_text
from async_rl.wire import PromptSpec

HELD_OUT = 1 << 20
"""Evaluation prompt j is training prompt HELD_OUT + j (never one of the training prompts here)."""


class RaisingCopyEpisode(ToolCopyEpisode):
    async def step(self, action_ids: np.ndarray) -> EnvReply:
        if "-" in response_text(action_ids):
            raise RuntimeError("boom: the turn holds a '-'")
        return await super().step(action_ids)


class ServedCopy(ToolCopyTask):
    """tool_copy served over HTTP in the tests, with a held-out split."""

    name = "served_copy"

    def __init__(self, *, seed: int = 0, tokenizer: Any = None, digits: int = 3) -> None:
        super().__init__(seed=seed, min_digits=digits, max_digits=digits)

    def eval_prompt(self, index: int) -> PromptSpec:
        spec = self.prompt(HELD_OUT + index)
        return PromptSpec(prompt_id=f"served_copy-eval-{index}", prompt_ids=spec.prompt_ids, metadata=spec.metadata)

    def episode(self, metadata: Mapping[str, Any]) -> Episode:
        return RaisingCopyEpisode(str(metadata["target"]))
