"""A rollout group as text: its prompt and each response as the model read and wrote them, with reward and versions.

What a person looks at to see what the policy does (``async-rl samples`` from the rollout stream, the learner's
samples table): the tokens decoded by the task (:meth:`~async_rl.tasks.base.Task.prompt_text`, special tokens shown,
so an end token or a chat template's markers are visible), and in an episode of several turns each run of the
environment's tokens (loss mask 0: a tool's output, a user's reply) between :data:`ENV_OPEN` and :data:`ENV_CLOSE`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from async_rl.tasks.base import Task
from async_rl.wire.types import GroupRecord, Sample

ENV_OPEN = "[env]"
"""Opens a run of the environment's tokens in a response's text."""
ENV_CLOSE = "[/env]"
"""Closes it."""


def shown_response(task: Task, sample: Sample) -> str:
    """``sample``'s response as text, the environment's turns between :data:`ENV_OPEN` and :data:`ENV_CLOSE`."""
    ids = np.asarray(sample.response_ids)
    if sample.loss_mask is None or not ids.size:
        return task.prompt_text(ids) if ids.size else ""
    model = sample.model_token_mask()
    cuts = [0, *(np.flatnonzero(model[1:] != model[:-1]) + 1).tolist(), int(ids.size)]
    parts = []
    for start, end in zip(cuts[:-1], cuts[1:], strict=True):
        text = task.prompt_text(ids[start:end])
        parts.append(text if model[start] else f"{ENV_OPEN}{text}{ENV_CLOSE}")
    return "".join(parts)


def group_rows(group: GroupRecord, task: Task, advantages: Sequence[float] | None = None) -> list[dict[str, Any]]:
    """One dict per sample of ``group``: ids, prompt and response text, reward and its components, the weight
    versions of its tokens, how it finished, and its advantage when given (one per sample, in order)."""
    if advantages is not None and len(advantages) != len(group.samples):
        raise ValueError(f"{len(advantages)} advantages for the {len(group.samples)} samples of group {group.group_id}")
    prompt = task.prompt_text(np.asarray(group.prompt_ids))
    rows = []
    for i, s in enumerate(group.samples):
        versions = np.asarray(s.versions)
        rows.append({
            "group_id": group.group_id, "prompt_id": group.prompt_id, "sample": i, "prompt": prompt,
            "response": shown_response(task, s), "reward": float(s.reward),
            "reward_info": {str(k): float(v) for k, v in s.reward_info.items()},
            "advantage": None if advantages is None else float(advantages[i]),
            "min_version": int(versions.min()) if versions.size else None,
            "max_version": int(versions.max()) if versions.size else None,
            "finish_reason": s.finish_reason, "response_tokens": int(np.asarray(s.response_ids).size),
            "env_tokens": 0 if s.loss_mask is None else int(np.count_nonzero(~s.model_token_mask())),
        })  # fmt: skip
    return rows
